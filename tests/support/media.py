"""Media files built in memory for requests: PNGs of noise or of one colour, a GIF, MP4s, and files that lie about
themselves (a PNG whose header claims 20 MP, a JPEG whose header claims more pixels than its scan holds)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels (`seed` picks them)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def plain_png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A PNG of one colour: a few bytes whatever its size."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def gif() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buffer, format="GIF")
    return buffer.getvalue()


def mp4_bytes(frames: int = 30, fps: int = 15, size: int = 64) -> bytes:
    """An MPEG-4 video of `frames` random frames of `size` × `size` pixels."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def h264_mp4(frames: int) -> bytes:
    """An H.264 MP4 of 32 × 32 pixels with `frames` frames (0: a container whose video stream holds none)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i % 256, dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def pixel_bomb() -> bytes:
    """A small PNG whose header says 20 MP: over the 16 MP limit, to be refused before its pixels are decoded."""
    buffer = io.BytesIO()
    Image.new("L", (5000, 4000)).save(buffer, format="PNG")
    return buffer.getvalue()


def lying_jpeg(width: int, height: int) -> bytes:
    """A JPEG whose header says width×height but whose scan data is cut to a few bytes before the end marker: the
    decoder fills the missing blocks in silently."""
    buffer = io.BytesIO()
    Image.new("L", (width, height), 128).save(buffer, "JPEG", quality=1)
    data = buffer.getvalue()
    scan = data.index(b"\xff\xda")
    header_length = int.from_bytes(data[scan + 2: scan + 4], "big")
    return data[: scan + 2 + header_length + 16] + b"\xff\xd9"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
