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
import errno
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..protocol import HOSTED, IMAGE_CONTENT_TYPES, MAX_MEDIA_BYTES, VIDEO_CONTENT_TYPES, sniff_content_type

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # PIL's names of IMAGE_CONTENT_TYPES
# The hosted service's 16 MP limit, kept here too: it bounds the memory one image can take to decode.
MAX_IMAGE_PIXELS = HOSTED.max_image_pixels
# A video's sampled frames, decoded: at most this many, held in at most this many bytes (frames larger than their
# share are decoded scaled down, keeping their aspect). The processor turns the sample into float tensors several
# times its size, so this bounds a video's memory: 16 MiB costs about 300 MB in all on the CPU (32 frames of
# 556×312), where the processor's own budget (about 72 MiB of frames) cost over 1 GB.
MAX_VIDEO_FRAMES = 512
MAX_DECODED_VIDEO_BYTES = 16 * 1024 * 1024
MIN_VIDEO_SIDE = 32  # frames are never scaled below this many pixels a side
# the video processor's rule: (total frames, fps or None) -> the indices of the frames the model reads
SampleIndices = Callable[[int, float | None], list[int]]



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
        content_type = item.get("content_type") or ""
        if not isinstance(content_type, str):
            raise MediaError(f"content_type must be a string, one of {', '.join(allowed_types)}")
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
        except MemoryError:
            raise MediaError("the image is too large to read") from None
        except Exception:  # PIL raises many types for corrupt data, in messages about its own internals
            raise MediaError(f"not a readable image (the {len(data)} bytes are corrupt, cut short or use a feature "
                             "this server does not read; use PNG, JPEG or WebP)") from None
        if image.format not in IMAGE_FORMATS:
            raise MediaError(f"image format {image.format} not accepted; use PNG, JPEG or WebP")
        if image.format == "JPEG":
            _check_jpeg_size(image, len(data))
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise MediaError(f"image is {image.width}×{image.height} = {image.width * image.height / 1e6:.1f} MP; "
                         f"the limit is {MAX_IMAGE_PIXELS / 1e6:.0f} MP")
    return image


def _check_jpeg_size(image: Image.Image, size: int) -> None:
    """Refuse a JPEG too small for the size its header claims. Every 8×8 block of the full-resolution component
    takes at least one bit of entropy-coded data, so a smaller file cannot hold that image: it is cut short or
    crafted, and the decoder would fill the missing blocks in silently (PNG and WebP decoders refuse instead)."""
    blocks = -(-image.width // 8) * -(-image.height // 8)
    if size * 8 < blocks:
        raise MediaError(f"the JPEG's header claims {image.width}×{image.height} pixels, more than its {size} bytes "
                         "can hold (the file is cut short or not a real photo)")


def decode_image(image: Image.Image) -> Image.Image:
    """The pixels of an opened image, as RGB."""
    try:
        return image.convert("RGB")
    except MemoryError:
        raise MediaError(f"the {image.width}×{image.height} image is too large to decode in this server's "
                         "memory") from None
    except Exception:  # truncated or corrupt data shows only when the pixels are decoded
        raise MediaError("the image cannot be decoded (its data is corrupt or cut short)") from None


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


def open_video(item: Any, sample_indices: SampleIndices) -> Video | bytes:
    """The sampled frames of a video given as frames (a `Video` is sampled already), else the checked bytes of its
    file, not decoded yet (see decode_video)."""
    if isinstance(item, Video):
        return item
    given = video_frames(item)
    if given is None:
        return video_bytes(item)
    frames, fps = given
    indices = [int(i) for i in sample_indices(len(frames), fps)] if len(frames) else []
    return Video(frames[indices], fps, indices, len(frames))


def decode_video(data: bytes, sample_indices: SampleIndices) -> Video:
    """Decode only the sampled frames of an MP4/WebM/MOV file with PyAV, within MAX_VIDEO_FRAMES and
    MAX_DECODED_VIDEO_BYTES: each frame is converted straight to its place in the one output array, scaled down when
    the sample at full size would not fit."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            # the decoder's own threads (frame and slice): the same frames, bit for bit, in a fraction of the wall
            # time; every frame up to the last sampled one must be decoded (later frames are predicted from it)
            stream.thread_type = "AUTO"
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 24.0
            width, height = stream.codec_context.width, stream.codec_context.height
            if width <= 0 or height <= 0:
                raise MediaError("the video's frame size is unknown")
            if width * height > MAX_IMAGE_PIXELS:
                raise MediaError(f"the video's frames are {width}×{height}; the limit is "
                                 f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP a frame")
            total = stream.frames or 0
            if total <= 0:  # some containers do not store a frame count: count by demuxing (cheap, no decode)
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            if total <= 0:
                raise MediaError("the video has no frames")
            wanted = [int(i) for i in sample_indices(total, fps)]
            if len(wanted) > MAX_VIDEO_FRAMES:
                raise MediaError(f"the video would be sampled at {len(wanted)} frames; the limit is "
                                 f"{MAX_VIDEO_FRAMES} (send a shorter video)")
            out_width, out_height = _decoded_frame_size(width, height, len(wanted))
            frames = np.empty((len(wanted), out_height, out_width, 3), dtype=np.uint8)
            slots: dict[int, list[int]] = {}
            for slot, index in enumerate(wanted):
                slots.setdefault(index, []).append(slot)
            filled = np.zeros(len(wanted), dtype=bool)
            last = max(wanted)
            for index, frame in enumerate(container.decode(stream)):
                if index in slots:
                    pixels = frame.to_ndarray(format="rgb24", width=out_width, height=out_height)
                    for slot in slots[index]:
                        frames[slot] = pixels
                        filled[slot] = True
                if index >= last:
                    break
    except (MediaError, MemoryError):  # a memory failure is the server's state, answered as such (413)
        raise
    except OSError as error:
        if error.errno not in (errno.ENOMEM, errno.EAGAIN):
            raise MediaError(_UNREADABLE_VIDEO) from None
        raise MemoryError from None  # no memory or no thread for the decoder: never "the file is corrupt"
    except Exception:  # PyAV raises its own error types for corrupt or unsupported files, in its own words
        raise MediaError(_UNREADABLE_VIDEO) from None
    if not filled.any():
        raise MediaError("no frame could be decoded")
    # A stored frame count can overstate what decodes: a missing frame repeats the last decoded frame before it.
    for slot in range(len(wanted)):
        if not filled[slot]:
            frames[slot] = frames[slot - 1] if slot else frames[int(np.argmax(filled))]
    return Video(frames, fps, wanted, total)


_UNREADABLE_VIDEO = ("not a readable video (the file is corrupt, cut short or encoded in a way this server does not "
                     "decode; use MP4, WebM or MOV with H.264, VP8/VP9 or AV1)")


def _decoded_frame_size(width: int, height: int, count: int) -> tuple[int, int]:
    """(width, height) to decode `count` frames of width×height at: as they are when they fit
    MAX_DECODED_VIDEO_BYTES, else scaled down evenly (even sides, as the frame formats want); refused when even
    MIN_VIDEO_SIDE frames would not fit."""
    scale = min(1.0, (MAX_DECODED_VIDEO_BYTES / (count * width * height * 3)) ** 0.5)
    if scale >= 1.0:
        return width, height
    out_width, out_height = (max(MIN_VIDEO_SIDE, int(side * scale) // 2 * 2) for side in (width, height))
    if count * out_width * out_height * 3 > MAX_DECODED_VIDEO_BYTES:
        raise MediaError(f"{count} sampled frames do not fit this server's video budget "
                         f"({MAX_DECODED_VIDEO_BYTES // 2**20} MiB decoded); send a shorter video")
    return out_width, out_height
