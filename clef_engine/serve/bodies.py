"""Request bodies: the error answers the handlers send, the body's kind, decompression, JSON that is safe to use,
multipart parts, and the TypeSafe SDK's assets turned into images."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import re
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from ..protocol import SURROGATE, sniff_content_type

try:  # zstd is what the TypeSafe SDK sends when it has it; stdlib from Python 3.14, else the backport, else off.
    from compression.zstd import ZstdDecompressor, ZstdError
except ImportError:
    try:
        from backports.zstd import ZstdDecompressor, ZstdError
    except ImportError:  # pragma: no cover - depends on the environment
        ZstdDecompressor = None
        ZstdError = ValueError

MAX_JSON_DEPTH = 64  # deeper nesting only serves to blow Python's recursion limit in the encoder
GZIP_ENCODINGS = ("gzip", "x-gzip")  # RFC 9110 §8.4.1.3: x-gzip is gzip
MAX_MEMBERS = 256  # gzip members / zstd frames in one body; a compressor writes one, streaming ones a few
DECOMPRESS_WINDOW = 64 * 1024  # compressed bytes fed to a decoder at once
MAX_MULTIPART_PARTS = 64  # file parts, and text parts, of one multipart body (docs/api.md's limits table)
MAX_NUMBER_DIGITS = 100  # a JSON number longer than this is no probability, count or score
MAX_ECHO_CHARS = 80  # of a client's string quoted back in an error message
JSON_MEDIA_TYPE = "application/json"
MULTIPART_MEDIA_TYPE = "multipart/form-data"


class ApiError(Exception):
    """An error answer: status and the JSON `detail` to send."""

    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        self.status = status
        self.detail = detail
        self.headers = headers or {}
        super().__init__(status, detail)


def api_error(status: int, error_type: str, message: str, *, retry_after: int | None = None,
              **extra: Any) -> ApiError:
    headers = None if retry_after is None else {"retry-after": str(retry_after)}
    return ApiError(status, {"error_type": error_type, "message": message, **extra}, headers)


def invalid(loc: list[str | int], msg: str, type_: str) -> ApiError:
    return ApiError(422, [{"loc": ["body", *loc], "msg": msg, "type": type_}])


# --- bodies --------------------------------------------------------------------------------------------------------


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """A client's string as quoted back in an error: at most `limit` characters, and says so when cut."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def body_kind(content_type: str | None) -> str:
    """"json" or "multipart" from the Content-Type header; 415 for anything else. Only JSON is read as JSON: a
    browser sends text/plain or form bodies cross-origin without a preflight, JSON never."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return "json"
    if media_type == MULTIPART_MEDIA_TYPE:
        return "multipart"
    sent = f"Content-Type {clip(content_type)!r}" if content_type else "no Content-Type"
    raise api_error(415, "unsupported_media_type",
                 f"{sent} is not accepted: send {JSON_MEDIA_TYPE} (or {MULTIPART_MEDIA_TYPE} with a 'request' part, "
                 "as the TypeSafe SDK does for file assets)", accepted=[JSON_MEDIA_TYPE, MULTIPART_MEDIA_TYPE])


def _check_json_tree(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, or holding strings that are not Unicode (JSON allows escaped
    lone surrogates like "\\ud800"; nothing downstream can encode them), naming the place. A body of a million small
    objects takes a while to walk, holding the GIL every other request needs: the walk builds no locations (each
    container's entry points to its parent's) and names a place only for a fault. Iterative: no recursion to blow."""
    stack: list[tuple[Any, Any, Any, int]] = [(value, None, None, 0)]  # container, parent's entry, key there, depth
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[3]
        if depth >= MAX_JSON_DEPTH:
            raise invalid(_location(entry)[:8], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_too_deep")
        is_dict = type(item) is dict
        key: Any  # str in an object, int in an array
        for key, child in item.items() if is_dict else enumerate(item):
            if is_dict and not key.isascii() and (bad := SURROGATE.search(key)):
                raise _not_unicode(bad.start(), [*_location(entry), key])
            kind = type(child)
            if kind is str:
                if not child.isascii() and (bad := SURROGATE.search(child)):
                    raise _not_unicode(bad.start(), [*_location(entry), key])
            elif kind is dict or kind is list:
                stack.append((child, entry, key, depth + 1))


def _location(entry: tuple[Any, Any, Any, int]) -> list[str | int]:
    loc: list[str | int] = []
    while entry[1] is not None:
        loc.append(entry[2])
        entry = entry[1]
    return loc[::-1]


def _not_unicode(at: int, loc: list[str | int]) -> ApiError:
    where = [p.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(p, str) else p for p in loc]
    return invalid(where, f"string has an unpaired UTF-16 surrogate at character {at}: not valid Unicode",
                   "string_unicode")


def _number(convert: Callable[[str], float], unit: str) -> Callable[[str], float]:
    """A JSON number parser refusing numbers too long to mean anything (Python refuses very long digit strings
    itself, in a message about its own settings) and infinite ones."""

    def parse(text: str) -> float:
        length = len(text) - text.startswith("-")  # the sign is no digit
        if length > MAX_NUMBER_DIGITS:
            raise ValueError(f"a number of {length} {unit} is out of range")
        value = convert(text)
        if not math.isfinite(value):
            raise ValueError(f"number {text[:20]} is out of range")
        return value

    return parse


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict:
    """Bytes → the request object, or a 422 naming where the JSON is broken."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid([exc.start], f"body is not UTF-8: {exc.reason} at byte {exc.start}", "json_invalid") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_number(float, "characters"),
                           parse_int=_number(int, "digits"))
    except json.JSONDecodeError as exc:
        raise invalid([exc.pos], f"JSON decode error: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                       "json_invalid") from None
    except ValueError as exc:  # NaN / Infinity / numbers out of range: our own messages above
        raise invalid([], f"JSON decode error: {exc}", "json_invalid") from None
    except RecursionError:
        raise invalid([], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_too_deep") from None
    if not isinstance(value, dict):
        raise invalid([], f"the body must be a JSON object, not {_json_type(value)}", "model_attributes_type")
    _check_json_tree(value)
    return value


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def decompress(raw: bytes, encoding: str, limit: int, too_large: ApiError) -> bytes:
    """The body inflated per its Content-Encoding, at most `limit` bytes (`too_large` past it). Linear in the body:
    the input is fed a window at a time, so a member's leftover (the next members) is never copied whole."""
    if encoding in GZIP_ENCODINGS:
        new_decoder: Callable[[], Any] = lambda: _GzipMember()  # noqa: E731
    elif encoding == "zstd" and ZstdDecompressor is not None:
        new_decoder = ZstdDecompressor
    else:
        supported = "gzip, x-gzip, zstd" if ZstdDecompressor is not None else "gzip, x-gzip"
        raise api_error(415, "unsupported_encoding",
                        f"Content-Encoding {clip(encoding)!r} is not supported (supported: {supported})")
    # A gzip stream may hold several members and a zstd stream several frames, back to back (RFC 1952 §2.2,
    # RFC 8878 §3); each decoder stops after one, so go on with a fresh one on what it left over. Anything that
    # is not a whole member is refused: silently dropping part of a body would answer another request. A body of
    # many tiny members costs a decoder each and buys nothing: past MAX_MEMBERS it is refused.
    out = bytearray()
    view = memoryview(raw)
    position, pending, members = 0, b"", 0
    data: bytes | memoryview
    decoder = None
    try:
        while pending or position < len(raw):
            if decoder is None:
                members += 1
                if members > MAX_MEMBERS:
                    raise invalid([], f"the {encoding} body has more than {MAX_MEMBERS} members (frames); send it "
                                      "as one", "decompression_error")
                decoder = new_decoder()
            if pending:
                data, pending = pending, b""
            else:
                data = view[position: position + DECOMPRESS_WINDOW]
                position += len(data)
            while True:  # drain what this input gives, at most up to the limit
                out += decoder.decompress(data, limit + 1 - len(out))
                if len(out) > limit:  # zip bombs stop here, after at most limit + 1 bytes of output
                    raise too_large
                if decoder.eof or decoder.needs_input:
                    break
                data = b""
            if decoder.eof:
                pending, decoder = decoder.unused_data, None  # at most a window: the next member's start
        if decoder is not None or members == 0:  # the last member is cut short, or there is none
            raise EOFError
    except (zlib.error, ZstdError, EOFError):
        raise invalid([], f"the body is not valid {encoding} data (corrupt or cut short)", "decompression_error") \
            from None
    return bytes(out)


class _GzipMember:
    """zlib's decoder of one gzip member, with the interface of zstd's: `needs_input` and output bounded per call
    (zlib keeps the input it could not use yet in `unconsumed_tail`)."""

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def decompress(self, data: bytes | memoryview, max_length: int) -> bytes:
        if not data:
            data = self._zlib.unconsumed_tail
        return self._zlib.decompress(data, max_length)

    @property
    def needs_input(self) -> bool:
        return not self._zlib.unconsumed_tail

    @property
    def eof(self) -> bool:
        return self._zlib.eof

    @property
    def unused_data(self) -> bytes:
        return self._zlib.unused_data


async def parse_multipart(content_type: str, raw: bytes, max_part_bytes: int) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart body: name → (content type or None for a text field, bytes). Parsed in the thread
    pool, in an event loop of its own: the parser is Python over every byte of the body, which on the server's loop
    would hold up every other request meanwhile."""
    return await run_in_threadpool(lambda: asyncio.run(_parse_multipart(content_type, raw, max_part_bytes)))


async def _parse_multipart(content_type: str, raw: bytes, max_part_bytes: int) -> dict[str, tuple[str | None, bytes]]:
    async def stream() -> AsyncIterator[bytes]:
        yield raw

    parser = _RawFieldsParser(Headers({"content-type": content_type}), stream(), max_files=MAX_MULTIPART_PARTS,
                             max_fields=MAX_MULTIPART_PARTS, max_part_size=max_part_bytes)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise invalid([], f"bad multipart body: {exc.message}", "multipart_invalid") from None
    parts: dict[str, tuple[str | None, bytes]] = {}
    for name, value in form.multi_items():
        if name in parts:  # which one would count is a guess; the client meant one of them
            raise invalid([clip(name)], f"the multipart body has more than one part named {clip(name)!r}",
                           "multipart_duplicate_part")
        if isinstance(value, str):  # a text field: its bytes as sent, UTF-8 or refused as a JSON body would be
            data = parser.raw_fields.pop(0)
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise invalid([clip(name), exc.start], f"multipart part {clip(name)!r} is not UTF-8: {exc.reason} at "
                                                       f"byte {exc.start}", "json_invalid") from None
            parts[name] = (None, data)
        else:
            parts[name] = (value.content_type, await value.read())
            await value.close()
    return parts


class _RawFieldsParser(MultiPartParser):
    """Starlette's multipart parser, keeping each text field's bytes (in order): it would decode a field that is not
    UTF-8 as Latin-1, silently changing the text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw_fields: list[bytes] = []

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            self.raw_fields.append(bytes(self._current_part.data))
        super().on_part_end()


# --- assets --------------------------------------------------------------------------------------------------------


def _replace_in_strings(value: Any, replace: Callable[[str], str]) -> Any:
    """`replace` applied to every string inside a JSON value; object keys are structure and stay as they are."""
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, list):
        return [_replace_in_strings(v, replace) for v in value]
    if isinstance(value, dict):
        return {k: _replace_in_strings(v, replace) for k, v in value.items()}
    return value


def replace_placeholders(body: dict, labels: dict[str, str]) -> dict:
    """Asset placeholders → `[image N]` in the request's text: the state, each question's instructions and its
    option or level descriptions. Question ids, types, option ids and every other key or structural value are left
    alone (an asset named `noul` must not turn a question's type into `[image 1]`)."""
    if not labels:
        return body
    # One pass with the longest names first, so that "P1" never eats the start of "P10".
    pattern = re.compile("|".join(re.escape(name) for name in sorted(labels, key=len, reverse=True)))

    def replace(text: str) -> str:
        return pattern.sub(lambda match: labels[match.group(0)], text)

    out = dict(body)
    if "state" in out:
        out["state"] = _replace_in_strings(out["state"], replace)
    questions = out.get("questions")
    if isinstance(questions, dict):
        # criteria: option id → description (noul, choice) or level descriptions (score); keys are ids, kept as is
        out["questions"] = {qid: {key: _replace_in_strings(value, replace) if key in ("instructions", "criteria")
                                  else value for key, value in question.items()} if isinstance(question, dict)
                            else question for qid, question in questions.items()}
    return out


def assets_to_images(body: dict, parts: dict[str, tuple[str | None, bytes]]) -> tuple[dict, dict[int, str]]:
    """TypeSafe `assets` → Clef `images`, the same for JSON and multipart bodies: each asset one image (its bytes,
    handed to the engine as they are), appended after the request's own images; placeholders become `[image N]`.
    Also returns image index → asset name, so that the engine's complaint about an image names the asset."""
    assets = body.get("assets")
    if assets is None:
        return body, {}
    if not isinstance(assets, dict) or not assets:
        raise invalid(["assets"], "assets must be a non-empty object of placeholder → asset", "dict_type")
    images = body.get("images") if body.get("images") is not None else []
    if not isinstance(images, list):
        raise invalid(["images"], "images must be an array", "list_type")
    images = list(images)
    labels: dict[str, str] = {}
    sources: dict[int, str] = {}
    for placeholder, asset in assets.items():
        loc: list[str | int] = ["assets", placeholder]
        if not placeholder:
            raise invalid(loc, "an asset name must not be empty (it is the placeholder replaced in the text)",
                           "string_too_short")
        if not isinstance(asset, dict):
            raise invalid(loc, "an asset must be an object", "dict_type")
        if asset.get("type", "image") not in ("image", None):
            raise invalid([*loc, "type"], "only image assets are supported", "literal_error")
        data = _asset_bytes(asset, loc, parts)
        # The bytes say what the image is (as the hosted API does); a declared format is not trusted.
        content_type = sniff_content_type(data)
        if content_type is None or not content_type.startswith("image/"):
            raise invalid(loc, f"asset {clip(placeholder)!r} is not a PNG, JPEG or WebP image", "value_error.image")
        sources[len(images)] = placeholder
        images.append(data)
        labels[placeholder] = f"[image {len(images)}]"
    rest = replace_placeholders({k: v for k, v in body.items() if k != "assets"}, labels)
    rest["images"] = images
    return rest, sources


def _asset_bytes(asset: dict, loc: list[str | int], parts: dict[str, tuple[str | None, bytes]]) -> bytes:
    part = asset.get("part")
    if part is not None:
        if not isinstance(part, str):
            raise invalid([*loc, "part"], "part must be the name (a string) of a multipart part", "string_type")
        if part not in parts:
            raise invalid([*loc, "part"], f"no multipart part named {clip(part)!r} in the request", "value_error")
        return parts[part][1]
    encoded = asset.get("data_base64")
    if not isinstance(encoded, str):
        raise invalid([*loc, "data_base64"], "data_base64 (a string) or part is required", "missing")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise invalid([*loc, "data_base64"], f"asset {clip(str(loc[-1]))!r}: data_base64 is not valid base64",
                       "value_error.base64") from None


def request_from_json(raw: bytes | str, parts: dict[str, tuple[str | None, bytes]]) -> tuple[dict, dict[int, str]]:
    """The request object of a JSON body (or of a body spooled to a file at path `raw`: what the big-body worker
    processes run), its assets turned into images."""
    return assets_to_images(parse_json_body(Path(raw).read_bytes() if isinstance(raw, str) else raw), parts)


def name_assets(problems: list[dict], sources: dict[int, str]) -> list[dict]:
    """The engine reports a bad image as ["images", i]; when image i came from an asset, say which asset."""
    named = []
    for problem in problems:
        loc = list(problem["loc"])
        if len(loc) >= 2 and loc[0] == "images" and loc[1] in sources:
            name = sources[loc[1]]
            problem = {**problem, "loc": ["assets", name, *loc[2:]], "msg": f"asset {clip(name)!r}: {problem['msg']}"}
        named.append(problem)
    return named
