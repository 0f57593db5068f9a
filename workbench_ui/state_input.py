"""What the Decide page turns into a System One request: the state text, the attached media, and the schema."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from clef_engine import protocol
from clef_engine.protocol import sniff_content_type

# Upload limits, stricter than the contract's: images as hosted Clef takes them (spec §5).
MAX_IMAGES = protocol.HOSTED.max_images
MAX_IMAGE_PIXELS = protocol.HOSTED.max_image_pixels
# 1,000,000 bytes, as the uploaders' file chips count a megabyte
MB = 1_000_000
MAX_IMAGE_BYTES = 20 * MB
# videos have no published limit: these keep one request reasonable on one GPU
MAX_VIDEOS = protocol.HOSTED.max_images
MAX_VIDEO_BYTES = 64 * MB
MAX_VIDEO_SECONDS = 120.0
MAX_STATE_CHARS = 2_000_000

IMAGE_TYPES = {t: protocol.MEDIA_TYPE_NAMES[t] for t in protocol.IMAGE_CONTENT_TYPES}
VIDEO_TYPES = {t: protocol.MEDIA_TYPE_NAMES[t] for t in protocol.VIDEO_CONTENT_TYPES}
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
VIDEO_EXTENSIONS = ("mp4", "webm", "mov")

StateMode = Literal["auto", "text", "json"]


class StateInputError(ValueError):
    """The state text cannot be used. `line` and `column` (1-based) point at the problem when there is one."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None):
        self.message = message
        self.line = line
        self.column = column
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(message + where)


@dataclass(frozen=True)
class ParsedState:
    value: Any
    kind: Literal["text", "json"]
    warnings: tuple[str, ...] = ()


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, column


class _NonStandardConstant(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, but they are not JSON: the request could not be serialized for HTTP.
    raise _NonStandardConstant(name)


def parse_state(text: str, mode: StateMode = "auto") -> ParsedState:
    """The editor's text as a state. Raises StateInputError with line and column."""
    if not text.strip():
        raise StateInputError("The state is empty: write the record the model should read (plain text or JSON).")
    if len(text) > MAX_STATE_CHARS:
        raise StateInputError(f"The state has {len(text):,} characters; at most {MAX_STATE_CHARS:,} are accepted.")
    if mode == "text" or (mode == "auto" and text.lstrip()[:1] not in ("{", "[")):
        return ParsedState(text, "text")
    duplicates: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                duplicates.append(key)
            obj[key] = value
        return obj

    try:
        value = json.loads(text, object_pairs_hook=pairs_hook, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise StateInputError(f"The state is not valid JSON: {exc.msg}.", line=exc.lineno, column=exc.colno) from None
    except _NonStandardConstant as exc:
        match = re.search(rf"(?<![\w\"]){re.escape(str(exc))}", text)
        line, column = _line_col(text, match.start()) if match else (None, None)
        raise StateInputError(f"The state is not valid JSON: {exc} is not a JSON value (use null or a string).",
                              line=line, column=column) from None
    warnings = tuple(f'The key "{key}" appears more than once; only its last value is kept.'
                     for key in dict.fromkeys(duplicates))
    return ParsedState(value, "json", warnings)


def state_to_text(state: Any) -> str:
    return state if isinstance(state, str) else json.dumps(state, indent=2, ensure_ascii=False)


class MediaError(ValueError):
    """An upload cannot be sent to the model. The message names the file and says what is wrong."""


@dataclass(frozen=True)
class Media:
    """An accepted image or video: its bytes, its sniffed content type, and what the UI shows about it."""

    kind: Literal["image", "video"]
    name: str
    content_type: str
    data: bytes = field(repr=False)
    width: int
    height: int
    duration_s: float | None = None

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    def data_url(self) -> str:
        return protocol.data_url(self.content_type, self.data)


def _mb(n: int) -> str:
    return f"{n / MB:.0f} MB"


def _names(types: dict[str, str]) -> str:
    names = list(types.values())
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _sniffed_type(name: str, data: bytes, kind: str, types: dict[str, str], max_bytes: int) -> str:
    """The upload's content type when it is one of `types` within `max_bytes`, else MediaError saying why not."""
    if len(data) > max_bytes:
        raise MediaError(f"{name}: {len(data) / MB:.1f} MB is over the {_mb(max_bytes)} {kind} limit.")
    content_type = sniff_content_type(data)
    if content_type not in types:
        what = f"a {content_type} file" if content_type else "not a file type the engine reads"
        raise MediaError(f"{name}: {what}; {kind}s must be {_names(types)}.")
    return content_type


def check_image(name: str, data: bytes) -> Media:
    """Accept a PNG, JPEG or WebP image within the limits, or raise MediaError saying why not."""
    content_type = _sniffed_type(name, data, "image", IMAGE_TYPES, MAX_IMAGE_BYTES)
    from PIL import (  # Pillow is imported only when an image is checked
        Image,
        UnidentifiedImageError,
    )

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            image.verify()  # catches truncated or corrupt files before the engine sees them
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"{name}: the image cannot be decoded ({exc}).") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(f"{name}: {width}×{height} = {width * height / 1e6:.1f} MP is over the "
                         f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP limit per image.")
    return Media("image", name, content_type, data, width, height)


def check_video(name: str, data: bytes) -> Media:
    """Accept an MP4, WebM or MOV video within the limits whose first video stream decodes, or raise MediaError."""
    content_type = _sniffed_type(name, data, "video", VIDEO_TYPES, MAX_VIDEO_BYTES)
    import av  # PyAV, imported only when a video is checked

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(f"{name}: the file has no video stream.")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            else:
                duration = None
            next(container.decode(stream), None)  # one frame proves the codec is readable
    except MediaError:
        raise
    except (av.error.FFmpegError, StopIteration, ValueError) as exc:
        raise MediaError(f"{name}: the video cannot be decoded ({exc}).") from None
    if duration is not None and duration > MAX_VIDEO_SECONDS:
        raise MediaError(f"{name}: {duration:.0f} s is longer than the {MAX_VIDEO_SECONDS:.0f} s limit per video.")
    return Media("video", name, content_type, data, width, height, duration)


def check_media_counts(images: Sequence[Any], videos: Sequence[Any]) -> None:
    if len(images) > MAX_IMAGES:
        raise MediaError(f"{len(images)} images attached; a request carries at most {MAX_IMAGES}.")
    if len(videos) > MAX_VIDEOS:
        raise MediaError(f"{len(videos)} videos attached; a request carries at most {MAX_VIDEOS}.")


def media_limits_text() -> str:
    return (f"Images: {_names(IMAGE_TYPES)}, up to {MAX_IMAGES} per request, {_mb(MAX_IMAGE_BYTES)} and "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP each. Videos: {_names(VIDEO_TYPES)}, up to {MAX_VIDEOS} per request, "
            f"{_mb(MAX_VIDEO_BYTES)} and {MAX_VIDEO_SECONDS:.0f} s each.")


def build_request(state: Any, questions: dict[str, Any], *, images: Sequence[Media] = (),
                  videos: Sequence[Media] = (), model: str = protocol.DEFAULT_MODEL_NAME) -> dict[str, Any]:
    """The System One request for a state, questions and media (as data URLs, images first)."""
    check_media_counts(images, videos)
    return protocol.build_request(state, questions, images=[m.data_url() for m in images],
                                  videos=[m.data_url() for m in videos], model=model)


def redact_media(request: dict[str, Any], images: Sequence[Media] = (), videos: Sequence[Media] = (),
                 keep_chars: int = 48) -> dict[str, Any]:
    """A request for display, each data URL shortened (the full request is a download)."""
    shown = dict(request)
    for key, items in (("images", images), ("videos", videos)):
        urls = request.get(key)
        if not urls:
            continue
        shown[key] = []
        for i, url in enumerate(urls):
            label = f"{items[i].name}, {items[i].size_bytes:,} bytes" if i < len(items) else f"{len(url):,} chars"
            shown[key].append(url if len(url) <= keep_chars else f"{url[:keep_chars]}… [{label}]")
    return shown
