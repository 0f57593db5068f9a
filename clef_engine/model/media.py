"""Turn what callers send as images and videos into what the processor takes: PIL images and sampled frames.

Accepted images: PIL images, bytes, file paths, data URLs, or {"content_type", "base64"} (PNG, JPEG, WebP).
Accepted videos: a T×H×W×3 uint8 array (+ fps), {"frames", "fps"}, bytes, file paths, data URLs or
{"content_type", "base64"} (MP4, WebM, MOV), decoded with PyAV at their real frame rate, or a `Video` already
sampled (an explanation's variants pass the record's own frames, one painted over). Only the frames the video
processor will sample are decoded and kept, so a long video costs what the model reads, not its full length.

Images are opened in two steps: `open_image` reads only the header (format, size), so limits and the token budget
are checked before `decode_image` spends memory on pixels. A frame array with no fps stays without one, as the
release code hands it to the processor (which then applies its own defaults).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..protocol import HOSTED, IMAGE_CONTENT_TYPES, VIDEO_CONTENT_TYPES

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # PIL's names of IMAGE_CONTENT_TYPES
# The hosted service's 16 MP limit, kept here too: it bounds the memory one image can take to decode.
MAX_IMAGE_PIXELS = HOSTED.max_image_pixels
MAX_MEDIA_BYTES = 64 * 1024 * 1024


def sniff_content_type(data: bytes) -> str | None:
    """The media type from the file's first bytes (the bytes decide, not a declared name or type), or None when it
    is none of the accepted formats."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp":
        # ISO base media: QuickTime brands are MOV, everything else we accept as MP4.
        return "video/quicktime" if data[8:12] == b"qt  " else "video/mp4"
    if data[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "video/quicktime"  # old QuickTime files without an ftyp box
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm"  # EBML header: WebM (or Matroska, which the decoder also reads)
    return None


class MediaError(ValueError):
    """A media item cannot be used; the message says why."""


@dataclass
class Video:
    """Sampled frames (T×H×W×3 uint8), the video's fps (None for a frame array given without one: the processor
    then assumes its own default), the source frame index of each sampled frame, and the source's frame count."""

    frames: np.ndarray
    fps: float | None
    frame_indices: list[int]
    total_frames: int


def _bytes_from(item: Any, allowed_types: tuple[str, ...]) -> bytes | None:
    """Bytes of a data URL / {content_type, base64} / bytes / path item; None if it is none of those."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, dict) and "base64" in item:
        content_type = str(item.get("content_type", ""))
        if content_type and content_type not in allowed_types:
            raise MediaError(f"content_type {content_type!r} not accepted; use one of {', '.join(allowed_types)}")
        return _b64(item["base64"])
    if isinstance(item, str) and item.startswith("data:"):
        header, _, payload = item.partition(",")
        content_type = header[5:].split(";")[0]
        if content_type not in allowed_types:
            raise MediaError(f"data URL type {content_type!r} not accepted; use one of {', '.join(allowed_types)}")
        if ";base64" not in header:
            raise MediaError("data URL must be base64-encoded")
        return _b64(payload)
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if not path.is_file():
            raise MediaError(f"file not found: {path}")
        if path.stat().st_size > MAX_MEDIA_BYTES:
            raise MediaError(f"{path} is larger than {MAX_MEDIA_BYTES // 2**20} MiB")
        return path.read_bytes()
    return None


def _b64(payload: Any) -> bytes:
    if not isinstance(payload, str):
        raise MediaError("base64 payload must be a string")
    if len(payload) > MAX_MEDIA_BYTES * 4 // 3 + 4:
        raise MediaError(f"media larger than {MAX_MEDIA_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise MediaError(f"invalid base64 ({error})") from error


def open_image(item: Any) -> Image.Image:
    """The image with only its header read (format and size known, pixels not decoded yet). Checks the format and
    the 16 MP limit."""
    if isinstance(item, Image.Image):
        image = item
    else:
        data = _bytes_from(item, IMAGE_CONTENT_TYPES)
        if data is None:
            raise MediaError("an image must be a data URL, {content_type, base64}, bytes, a file path or a PIL image")
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:  # its message names a Python object, of no use to a caller
            what = sniff_content_type(data)
            raise MediaError(f"not a readable image (the {len(data)} bytes are "
                             f"{what or 'not a known image format'}; use PNG, JPEG or WebP)") from None
        except Exception as error:  # PIL raises many types for corrupt data
            raise MediaError(f"not a readable image ({error}; use PNG, JPEG or WebP)") from error
        if image.format not in IMAGE_FORMATS:
            raise MediaError(f"image format {image.format} not accepted; use PNG, JPEG or WebP")
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise MediaError(f"image is {image.width}×{image.height} = {image.width * image.height / 1e6:.1f} MP; "
                         f"the limit is {MAX_IMAGE_PIXELS / 1e6:.0f} MP")
    return image


def decode_image(image: Image.Image) -> Image.Image:
    """The pixels of an opened image, as RGB."""
    try:
        return image.convert("RGB")
    except Exception as error:  # truncated or corrupt data shows only when the pixels are decoded
        raise MediaError(f"image cannot be decoded ({error})") from error


def load_image(item: Any) -> Image.Image:
    """An RGB PIL image from any accepted form; checks format and the 16 MP limit before decoding pixels."""
    return decode_image(open_image(item))


def video_frames(item: Any) -> tuple[np.ndarray, float | None] | None:
    """(frames, fps or None) of a video given as a frame array; None when the item is a file of some form."""
    if not (isinstance(item, np.ndarray) or (isinstance(item, dict) and "frames" in item)):
        return None
    frames = np.asarray(item["frames"] if isinstance(item, dict) else item)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise MediaError(f"video frames must be a T×H×W×3 uint8 array, got {frames.dtype} {frames.shape}")
    fps = item.get("fps") if isinstance(item, dict) else None
    if fps is not None:
        try:
            fps = float(fps)
        except (TypeError, ValueError) as error:
            raise MediaError(f"video fps must be a number, got {fps!r}") from error
        if not np.isfinite(fps) or fps <= 0:
            raise MediaError(f"video fps must be positive, got {fps}")
    return frames, fps


def video_bytes(item: Any) -> bytes:
    """The bytes of a video file given in any accepted form; the bytes must be an MP4, WebM or MOV file."""
    data = _bytes_from(item, VIDEO_CONTENT_TYPES)
    if data is None:
        raise MediaError("a video must be frames, a data URL, {content_type, base64}, bytes or a file path")
    content_type = sniff_content_type(data)
    if content_type not in VIDEO_CONTENT_TYPES:
        # e.g. PNG bytes labelled video/mp4: the demuxer would read them as a one-frame "video"
        what = f"the bytes are {content_type}" if content_type else "not an MP4, WebM or MOV file"
        raise MediaError(f"not a readable video ({what}; videos must be MP4, WebM or MOV)")
    return data


def load_video(item: Any, sample_indices) -> Video:
    """Sampled frames of a video. `sample_indices(total_frames, fps or None) -> indices` is the video processor's
    rule."""
    if isinstance(item, Video):
        return item
    given = video_frames(item)
    if given is not None:
        frames, fps = given
        indices = [int(i) for i in sample_indices(len(frames), fps)] if len(frames) else []
        return Video(frames[indices], fps, indices, len(frames))
    return decode_video(video_bytes(item), sample_indices)


def decode_video(data: bytes, sample_indices) -> Video:
    """Decode only the sampled frames of an MP4/WebM/MOV file with PyAV."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 24.0
            total = stream.frames or 0
            if total <= 0:  # some containers do not store a frame count: count by demuxing (cheap, no decode)
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            if total <= 0:
                raise MediaError("the video has no frames")
            wanted = [int(i) for i in sample_indices(total, fps)]
            wanted_set = set(wanted)
            frames: dict[int, np.ndarray] = {}
            for index, frame in enumerate(container.decode(stream)):
                if index in wanted_set:
                    frames[index] = frame.to_ndarray(format="rgb24")
                if index >= wanted[-1]:
                    break
    except MediaError:
        raise
    except Exception as error:  # PyAV raises its own error types for corrupt or unsupported files
        raise MediaError(f"not a readable video ({type(error).__name__}: {error})") from error
    if not frames:
        raise MediaError("no frame could be decoded")
    last = frames[max(frames)]
    # A stored frame count can overstate what decodes; repeat the last decoded frame for any missing index.
    stacked = np.stack([frames.get(i, last) for i in wanted])
    return Video(stacked, fps, wanted, total)
