"""A Jev / System One–compatible HTTP API served from a resident Clef engine.

Routes (see `routes`):
- `POST /v1/systemone` — a System One request (spec §5) → a System One response, plus `x_` extras.
- `GET /v1/models` — every resident model, the default first, and the `jev-latest` alias of the default.
- `GET /health` — `{"ready", "model", "models", "revision", "device"}` (`model`: the default); 503 while no engine
  is loaded. Never needs a key. Models are named as /v1/models names them (a local release by its folder name,
  never a server path).
- `GET /metrics` — Prometheus text exposition (prometheus-client, one registry per app).
- `GET /openapi.json` and `GET /docs` — the OpenAPI document and a self-contained page rendering it (no CDN).

Wire contract beyond spec §5:
- Unknown top-level fields are ignored; `model` may be any string and is echoed in the response.
- Several models: the provider may give a mapping name → engine (the default first). A request's `model` picks the
  engine of that name (exactly, or ignoring case and an owner prefix: `Cloudflare/clef-flash` and `clef-flash` name
  the same model); `jev-latest` and any name that is not loaded go to the default model, as hosted Jev accepts any
  model name. /metrics reports every resident model's engine, labelled `model`.
- Overflow: a record over the token budget gets 413 unless the request body opts in with the top-level field
  `"x_overflow": "truncate_state"` (the reference's behaviour: cut the end of the state; the response says how many
  state tokens were dropped in `x_truncated_state_tokens`). `"x_max_length": N` raises or lowers the budget.
- Media: `images` (PNG/JPEG/WebP) and `videos` (MP4/WebM/MOV) as data URLs or `{"content_type", "base64"}` objects;
  the engine checks formats and limits. File paths, which the engine accepts from Python callers, are refused over
  HTTP (they would read the server's disk). The TypeSafe SDK's `assets` (JSON `{"format", "data_base64"}` or
  multipart parts) are accepted in both body kinds alike: each asset becomes one image after the request's own
  images, and its placeholder is replaced by `[image N]` inside text only — the state's strings, question
  instructions, option and level descriptions — never in keys, question ids, types or other structure.
- Bodies: `Content-Type: application/json` (parameters allowed) or the SDK's `multipart/form-data`; anything else
  gets 415. At most `max_body_bytes` (default 32 MiB) before and after decompression, nested at most 64 deep,
  strings valid Unicode, numbers finite. `Content-Encoding: gzip` or `zstd` (the TypeSafe SDK compresses with zstd
  when it can).
- Time: a body that has not arrived within `request_timeout` seconds gets 408; a request the engine has not
  answered within `request_timeout` seconds gets 503 `deadline_exceeded` (its queued work is cancelled).
- Errors: 422 `{"detail": [{"loc", "msg", "type"}]}` for invalid requests (locations start with "body", as in the
  ecosystem); other errors `{"detail": {"error_type", "message"}}`: 401 authentication_error (with
  `WWW-Authenticate: Bearer`), 408 request_timeout, 413 request_too_large / token_budget_exceeded, 415
  unsupported_media_type / unsupported_encoding, 429 overloaded (Retry-After: 1), 503 not_ready while no model is
  loaded or deadline_exceeded. Any other 5xx is a server fault, never the request's.
- With an API key configured, `/v1/*` and `/metrics` need `Authorization: Bearer KEY`; without one an
  Authorization header is ignored. No CORS headers are sent unless `create_app(cors_origins=...)` asks for them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import gzip
import hmac
import json
import logging
import math
import re
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import BusyError, RequestError, TokenBudgetError
from ..explain import explaining
from ..model.media import sniff_content_type
from ..protocol import validate_request
from . import openapi

try:  # zstd is what the TypeSafe SDK sends when it has it; stdlib from Python 3.14, else the backport, else off.
    from compression.zstd import ZstdDecompressor, ZstdError  # type: ignore[import-not-found]
except ImportError:
    try:
        from backports.zstd import ZstdDecompressor, ZstdError
    except ImportError:  # pragma: no cover - depends on the environment
        ZstdDecompressor = None  # type: ignore[assignment,misc]
        ZstdError = ValueError  # type: ignore[assignment,misc]

log = logging.getLogger("clef_engine.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # 4 images of 16 MP as base64 PNG fit; anything bigger is a mistake
DEFAULT_REQUEST_TIMEOUT = 120.0  # seconds; a long CPU batch fits, a wedged queue does not
MAX_JSON_DEPTH = 64  # deeper nesting only serves to blow Python's recursion limit in the encoder
MAX_LENGTH_CEILING = 1 << 20
MODEL_ALIAS = "jev-latest"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ENGINE_FIELDS = ("state", "questions", "images", "videos")  # what the engine gets; the rest is ours or ignored
JSON_MEDIA_TYPE = "application/json"
MULTIPART_MEDIA_TYPE = "multipart/form-data"

EngineProvider = Callable[[], Any]  # returns an engine, a mapping name → engine (default first), or None
# The engine scheduler's own counters (Engine.info()["scheduler"]): every batch of the process, the workbench's too.
SCHEDULER_METRICS = (
    ("batches", "clef_engine_batches_total", "counter", "Batches the GPU worker ran."),
    ("records", "clef_engine_batch_records_total", "counter", "Records in those batches; over batches: mean size."),
    ("tokens", "clef_engine_batch_tokens_total", "counter", "Tokens in those batches."),
    ("largest_batch_records", "clef_engine_batch_records_max", "gauge", "Most records in one batch so far."),
    ("last_batch_records", "clef_engine_batch_records_last", "gauge", "Records in the latest batch."),
    ("busy_seconds", "clef_engine_busy_seconds_total", "counter", "Time the GPU worker spent running batches."),
)


class ApiError(Exception):
    """An error answer: status and the JSON `detail` to send."""

    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        self.status = status
        self.detail = detail
        self.headers = headers or {}
        super().__init__(status, detail)


def _error(status: int, error_type: str, message: str, **extra: Any) -> ApiError:
    return ApiError(status, {"error_type": error_type, "message": message, **extra})


def _invalid(loc: list[str | int], msg: str, type_: str) -> ApiError:
    return ApiError(422, [{"loc": ["body", *loc], "msg": msg, "type": type_}])


# --- metrics -------------------------------------------------------------------------------------------------------


class Metrics:
    """The API's Prometheus metrics, in a registry of their own: two apps in one process (the workbench's and a
    test's) never share or double-register counters. The engine's numbers are read at scrape time."""

    def __init__(self, models_or_none: Callable[[], dict[str, Any] | None]):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("clef_api_requests", "HTTP requests answered, by path and status.",
                                ["path", "status"], registry=registry)
        self.latency = Histogram("clef_api_request_duration_seconds", "Time to answer POST /v1/systemone, any status.",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.input_tokens = Counter("clef_api_input_tokens", "Input tokens of answered requests.", registry=registry)
        self.decisions = Counter("clef_api_decisions", "Questions answered.", registry=registry)
        self.truncated_state_tokens = Counter("clef_api_truncated_state_tokens",
                                              "State tokens cut on requests that opted in to truncation.",
                                              registry=registry)
        self.in_flight = Gauge("clef_api_requests_in_flight", "Requests waiting for the engine now.",
                               registry=registry)
        self.max_in_flight = Gauge("clef_api_requests_in_flight_max", "Most requests waiting for the engine at once.",
                                   registry=registry)
        self._in_flight_lock = threading.Lock()  # the maximum is read-modify-write; a gauge alone cannot keep it
        self._in_flight_now = 0
        self._in_flight_most = 0
        registry.register(_EngineCollector(models_or_none))

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path=path, status=str(status)).inc()

    def count_answer(self, response: dict) -> None:
        usage = response.get("usage") or {}
        self.input_tokens.inc(int(usage.get("input_tokens") or 0))
        self.decisions.inc(len(response.get("answers") or {}))
        self.truncated_state_tokens.inc(int(response.get("x_truncated_state_tokens") or 0))

    def enter(self) -> None:
        with self._in_flight_lock:
            self._in_flight_now += 1
            self.in_flight.set(self._in_flight_now)
            if self._in_flight_now > self._in_flight_most:
                self._in_flight_most = self._in_flight_now
                self.max_in_flight.set(self._in_flight_most)

    def leave(self) -> None:
        with self._in_flight_lock:
            self._in_flight_now -= 1
            self.in_flight.set(self._in_flight_now)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engines' state at scrape time: readiness; per resident model (label `model`) its queue, the scheduler's
    counters and the memory its weights took; the device's memory once (read through the default model)."""

    def __init__(self, models_or_none: Callable[[], dict[str, Any] | None]):
        self._models_or_none = models_or_none

    def collect(self) -> Iterator[Metric]:
        models = self._models_or_none() or {}
        yield GaugeMetricFamily("clef_engine_ready", "1 when a model is loaded and answering.",
                                value=1 if models else 0)
        queue = GaugeMetricFamily("clef_engine_queue_depth", "Requests waiting for the GPU worker.", labels=["model"])
        scheduler_families = [(key, (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, help_text, labels=["model"])) for key, name, kind, help_text in SCHEDULER_METRICS]
        weights = GaugeMetricFamily("clef_engine_weights_bytes", "Accelerator memory the model took when it was "
                                    "loaded (0 on CPU).", labels=["model"])
        device_memory = None
        for name, engine in models.items():
            info = _safe_call(engine.info, default={})
            queue.add_metric([name], _safe_call(engine.queue_depth, default=0))
            scheduler = info.get("scheduler") or {}
            for key, family in scheduler_families:
                value = scheduler.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric([name], value)
            memory = {k: v for k, v in (info.get("memory") or {}).items() if isinstance(v, (int, float))}
            weights.add_metric([name], memory.get("loaded", 0))
            if device_memory is None:  # the default model's view: allocations are counted per device, not model
                device_memory = memory
        yield queue
        for _, family in scheduler_families:
            yield family
        yield weights
        memory = {"loaded": 0, "allocated": 0, "peak_allocated": 0, "peak_reserved": 0}
        memory.update(device_memory or {})
        family = GaugeMetricFamily("clef_engine_memory_bytes", "Accelerator memory: the default model's weights "
                                   "when loaded, allocated now, peak allocated, peak reserved (0 on CPU).",
                                   labels=["kind"])
        for kind, value in sorted(memory.items()):
            family.add_metric([kind], value)
        yield family


def _safe_call(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # a metrics scrape must not fail because the engine is busy or gone
        log.exception("metrics: %s failed", getattr(fn, "__name__", fn))
        return default


# --- bodies --------------------------------------------------------------------------------------------------------


def body_kind(content_type: str | None) -> str:
    """"json" or "multipart" from the Content-Type header; 415 for anything else. Only JSON is read as JSON: a
    browser sends text/plain or form bodies cross-origin without a preflight, JSON never."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return "json"
    if media_type == MULTIPART_MEDIA_TYPE:
        return "multipart"
    sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    raise _error(415, "unsupported_media_type",
                 f"{sent} is not accepted: send {JSON_MEDIA_TYPE} (or {MULTIPART_MEDIA_TYPE} with a 'request' part, "
                 "as the TypeSafe SDK does for file assets)", accepted=[JSON_MEDIA_TYPE, MULTIPART_MEDIA_TYPE])


def _check_json_tree(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, and strings that are not Unicode (JSON allows escaped lone
    surrogates like "\\ud800"; nothing downstream can encode them). Iterative: no recursion to blow."""
    # A body of a million small objects takes a while to walk, holding the GIL that every other request needs: the
    # quick walk below keeps no locations, and only a body it finds fault with is walked again to name the place.
    if not _json_tree_at_fault(value):
        return
    _locate_json_fault(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_tree_at_fault(value: Any) -> bool:
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            return True
        if type(item) is dict:
            if any(not key.isascii() and _SURROGATE.search(key) for key in item):
                return True
            children = item.values()
        else:
            children = item
        for child in children:
            kind = type(child)
            if kind is str:
                if not child.isascii() and _SURROGATE.search(child):
                    return True
            elif kind is dict or kind is list:
                stack.append((child, depth + 1))
    return False


def _locate_json_fault(value: Any) -> None:
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, str):
            _check_text(item, loc)
            continue
        if isinstance(item, dict):
            children: list[tuple[str | int, Any]] = list(item.items())
            for key in item:
                _check_text(key, [*loc, key])
        elif isinstance(item, list):
            children = list(enumerate(item))
        else:
            continue
        if len(loc) >= MAX_JSON_DEPTH:
            raise _invalid(loc[:8], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_too_deep")
        stack.extend((child, [*loc, key]) for key, child in children)


def _check_text(text: str, loc: list[str | int]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = [part.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(part, str) else part
                 for part in loc]
        raise _invalid(where, f"string has an unpaired UTF-16 surrogate at character {exc.start}: not valid "
                              "Unicode", "string_unicode") from None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict:
    """Bytes → the request object, or a 422 naming where the JSON is broken."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid([exc.start], f"body is not UTF-8: {exc.reason} at byte {exc.start}", "json_invalid") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise _invalid([exc.pos], f"JSON decode error: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                       "json_invalid") from None
    except ValueError as exc:  # NaN / Infinity
        raise _invalid([], f"JSON decode error: {exc}", "json_invalid") from None
    except RecursionError:
        raise _invalid([], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_too_deep") from None
    if not isinstance(value, dict):
        raise _invalid([], f"the body must be a JSON object, not {_json_type(value)}", "model_attributes_type")
    _check_json_tree(value)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), type(value).__name__
    )


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
        out["questions"] = {qid: _replace_in_question(question, replace) for qid, question in questions.items()}
    return out


def _replace_in_question(question: Any, replace: Callable[[str], str]) -> Any:
    if not isinstance(question, dict):
        return question
    out = dict(question)
    if "instructions" in out:
        out["instructions"] = _replace_in_strings(out["instructions"], replace)
    criteria = out.get("criteria")
    if isinstance(criteria, dict):  # noul / choice: option id → description
        out["criteria"] = {option: _replace_in_strings(text, replace) for option, text in criteria.items()}
    elif isinstance(criteria, list):  # score: level descriptions
        out["criteria"] = [_replace_in_strings(text, replace) for text in criteria]
    return out


def assets_to_images(body: dict, parts: dict[str, tuple[str | None, bytes]]) -> tuple[dict, dict[int, str]]:
    """TypeSafe `assets` → Clef `images`, the same for JSON and multipart bodies: each asset one image (its bytes,
    handed to the engine as they are), appended after the request's own images; placeholders become `[image N]`.
    Also returns image index → asset name, so that the engine's complaint about an image names the asset."""
    assets = body.get("assets")
    if assets is None:
        return body, {}
    if not isinstance(assets, dict) or not assets:
        raise _invalid(["assets"], "assets must be a non-empty object of placeholder → asset", "dict_type")
    images = body.get("images") if body.get("images") is not None else []
    if not isinstance(images, list):
        raise _invalid(["images"], "images must be an array", "list_type")
    images = list(images)
    labels: dict[str, str] = {}
    sources: dict[int, str] = {}
    for placeholder, asset in assets.items():
        loc: list[str | int] = ["assets", placeholder]
        if not placeholder:
            raise _invalid(loc, "an asset name must not be empty (it is the placeholder replaced in the text)",
                           "string_too_short")
        if not isinstance(asset, dict):
            raise _invalid(loc, "an asset must be an object", "dict_type")
        if asset.get("type", "image") not in ("image", None):
            raise _invalid([*loc, "type"], "only image assets are supported", "literal_error")
        data = _asset_bytes(asset, loc, parts)
        # The bytes say what the image is (as the hosted API does); a declared format is not trusted.
        content_type = sniff_content_type(data)
        if content_type is None or not content_type.startswith("image/"):
            raise _invalid(loc, f"asset {placeholder!r} is not a PNG, JPEG or WebP image", "value_error.image")
        sources[len(images)] = placeholder
        images.append(data)
        labels[placeholder] = f"[image {len(images)}]"
    rest = replace_placeholders({k: v for k, v in body.items() if k != "assets"}, labels)
    rest["images"] = images
    return rest, sources


def _asset_bytes(asset: dict, loc: list[str | int], parts: dict[str, tuple[str | None, bytes]]) -> bytes:
    part = asset.get("part")
    if part is not None:
        if not isinstance(part, str) or part not in parts:
            raise _invalid([*loc, "part"], f"no multipart part named {part!r} in the request", "value_error")
        return parts[part][1]
    encoded = asset.get("data_base64")
    if not isinstance(encoded, str):
        raise _invalid([*loc, "data_base64"], "data_base64 (a string) or part is required", "missing")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid([*loc, "data_base64"], f"asset {loc[-1]!r}: data_base64 is not valid base64",
                       "value_error.base64") from None


def _request_from_json(raw: bytes, parts: dict[str, tuple[str | None, bytes]]) -> tuple[dict, dict[int, str]]:
    return assets_to_images(parse_json_body(raw), parts)


def _name_assets(problems: list[dict], sources: dict[int, str]) -> list[dict]:
    """The engine reports a bad image as ["images", i]; when image i came from an asset, say which asset."""
    named = []
    for problem in problems:
        loc = list(problem["loc"])
        if len(loc) >= 2 and loc[0] == "images" and loc[1] in sources:
            name = sources[loc[1]]
            problem = {**problem, "loc": ["assets", name, *loc[2:]], "msg": f"asset {name!r}: {problem['msg']}"}
        named.append(problem)
    return named


# --- the API -------------------------------------------------------------------------------------------------------


class SystemOneApi:
    """The handlers, bound to an engine provider, an optional key, limits and the metrics they keep."""

    def __init__(self, engine_provider: EngineProvider | Any, *, api_key: str | None, max_body_bytes: int,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self._provider = engine_provider if callable(engine_provider) and not _looks_like_engine(engine_provider) \
            else (lambda: engine_provider)
        self._key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self._named: tuple[weakref.ref, str] | None = None  # (engine, its public name): see _name_of
        self.metrics = Metrics(self.models_or_none)

    # --- engine access -------------------------------------------------------------------------------------
    def models_or_none(self) -> dict[str, Any] | None:
        """Name → engine of every resident model, the default first; None while none is loaded."""
        try:
            provided = self._provider()
        except Exception:  # not loaded / failed to load: health says so, requests get 503
            log.exception("engine provider failed")
            return None
        if provided is None:
            return None
        if isinstance(provided, Mapping):
            return dict(provided) or None
        return {self._name_of(provided): provided}

    def _name_of(self, engine: Any) -> str:
        """A lone engine's public name, worked out once per engine: info() gathers memory and cache statistics,
        too much to redo on every request. Held by a weak reference: a model switched out must not stay in memory."""
        named = self._named
        if named is None or named[0]() is not engine:
            named = self._named = (weakref.ref(engine), _public_model_name(_safe_call(engine.info, default={})))
        return named[1]

    async def _engine(self, model: Any = None) -> tuple[str, Any]:
        """(name, engine) of the model a request's `model` field names (see pick_model)."""
        return pick_model(await self._models(), model)

    async def _models(self) -> dict[str, Any]:
        models = await run_in_threadpool(self.models_or_none)
        if not models:
            error = _error(503, "not_ready", "the model is not loaded yet; see GET /health")
            error.headers["retry-after"] = "5"
            raise error
        return models

    # --- auth and body ---------------------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> None:
        """RFC 9110 §11.6.1 / RFC 6750 §3: every refusal for want of valid credentials is a 401 carrying a
        `WWW-Authenticate` challenge; a wrong key adds `error="invalid_token"`."""
        if self._key is None:
            return
        header = request.headers.get("authorization")
        if not header:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'", 'Bearer realm="clef"')
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <key>'",
                                'Bearer realm="clef", error="invalid_request"')
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes sent (a UTF-8 key compares right).
        if not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            raise _unauthorized("invalid API key", 'Bearer realm="clef", error="invalid_token"')

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        too_large = _error(413, "request_too_large", f"the request body is larger than {limit} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        raw = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return raw
        # Inflating up to max_body_bytes takes a while; off the event loop, so that other requests go on meanwhile.
        return await run_in_threadpool(self._decompress, raw, encoding, too_large)

    async def _read_body_in_time(self, request: Request) -> bytes:
        # A client trickling its body would otherwise hold a connection and a handler as long as it likes.
        try:
            return await asyncio.wait_for(self._read_body(request), self.request_timeout)
        except TimeoutError:
            raise _error(408, "request_timeout",
                         f"the request body did not arrive within {self.request_timeout:g} seconds") from None

    def _decompress(self, raw: bytes, encoding: str, too_large: ApiError) -> bytes:
        limit = self.max_body_bytes
        if encoding == "gzip":
            new_decoder: Callable[[], Any] = lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)  # noqa: E731
        elif encoding == "zstd" and ZstdDecompressor is not None:
            new_decoder = ZstdDecompressor
        else:
            supported = "gzip, zstd" if ZstdDecompressor is not None else "gzip"
            raise _error(415, "unsupported_encoding",
                         f"Content-Encoding {encoding!r} is not supported (supported: {supported})")
        # A gzip stream may hold several members and a zstd stream several frames, back to back (RFC 1952 §2.2,
        # RFC 8878 §3); each decoder stops after one, so go on with a fresh one on what it left over. Anything that
        # is not a whole member is refused: silently dropping part of a body would answer another request.
        out, rest, first = bytearray(), raw, True
        try:
            while rest or first:
                first = False
                decoder = new_decoder()
                out += decoder.decompress(rest, limit + 1 - len(out))
                if len(out) > limit:  # zip bombs stop here, after at most limit + 1 bytes of output
                    raise too_large
                if not decoder.eof:
                    raise EOFError("the compressed data ends early")
                rest = decoder.unused_data
        except (zlib.error, ZstdError, gzip.BadGzipFile, EOFError) as exc:
            raise _invalid([], f"the body could not be decompressed as {encoding}: {exc}", "decompression_error") \
                from None
        return bytes(out)

    async def _parse_request(self, kind: str, content_type: str, raw: bytes) -> tuple[dict, dict[int, str]]:
        """The request object and, when assets became images, image index → asset name."""
        # Parsing a body of many megabytes (and decoding its base64 assets) runs in the thread pool: on the event loop
        # it would hold up every other request meanwhile.
        if kind == "json":
            return await run_in_threadpool(_request_from_json, raw, {})
        parts = await self._parse_multipart(content_type, raw)
        request_part = parts.pop("request", None)
        if request_part is None:
            raise _invalid(["request"], "a multipart request needs a part named 'request' holding the JSON body",
                           "missing")
        return await run_in_threadpool(_request_from_json, request_part[1], parts)

    async def _parse_multipart(self, content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
        async def stream():
            yield raw

        parser = MultiPartParser(Headers({"content-type": content_type}), stream(), max_files=64, max_fields=64,
                                 max_part_size=self.max_body_bytes)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise _invalid([], f"bad multipart body: {exc.message}", "multipart_invalid") from None
        parts: dict[str, tuple[str | None, bytes]] = {}
        for name, value in form.multi_items():
            if name in parts:  # which one would count is a guess; the client meant one of them
                raise _invalid([name], f"the multipart body has more than one part named {name!r}",
                               "multipart_duplicate_part")
            if isinstance(value, str):
                parts[name] = (None, value.encode("utf-8"))
            else:
                parts[name] = (value.content_type, await value.read())
                await value.close()
        return parts

    # --- handlers ----------------------------------------------------------------------------------------------
    async def system_one(self, request: Request) -> Response:
        started = time.perf_counter()
        request_id = uuid.uuid4().hex
        status = 500
        try:
            self._authenticate(request)
            content_type = request.headers.get("content-type", "")
            kind = body_kind(content_type)
            raw = await self._read_body_in_time(request)
            body, asset_images = await self._parse_request(kind, content_type, raw)
            name, engine = await self._engine(body.get("model"))
            answer = await self._decide(engine, name, body, asset_images)
            status = 200
            return SafeJSONResponse(answer, headers={"x-typesafe-request-id": request_id})
        except ApiError as exc:
            status = exc.status
            return _error_response(exc, request_id)
        except ClientDisconnect:
            status = 499
            return Response(status_code=499)
        except Exception:  # a fault of ours, never of the input (the input's faults are ApiErrors above)
            log.exception("POST /v1/systemone failed (request %s)", request_id)
            status = 500
            return _error_response(_error(500, "internal_error", f"internal error (request {request_id})"),
                                   request_id)
        finally:
            self.metrics.count_request("/v1/systemone", status)
            self.metrics.latency.observe(time.perf_counter() - started)

    async def _decide(self, engine: Any, name: str, body: dict, asset_images: dict[int, str]) -> dict:
        record = {k: body[k] for k in ENGINE_FIELDS if k in body}
        _check_media(record, skip_images=set(asset_images))
        # The contract's models say what a valid request is (the 422 body lists every problem). The state is left
        # out here: the engine's encoder validates the whole request again, and any parsed JSON is a valid state,
        # while walking a large state takes seconds. In the thread pool: media strings can be large too.
        try:
            request = await run_in_threadpool(validate_request, {**body, "state": None} if "state" in body else body)
        except RequestError as exc:
            raise _invalid_request(exc, asset_images) from None
        if request.x_max_length is not None and request.x_max_length > MAX_LENGTH_CEILING:
            raise _invalid(["x_max_length"], f"x_max_length must be at most {MAX_LENGTH_CEILING}", "less_than_equal")
        model, max_length, overflow = request.model, request.x_max_length, request.x_overflow
        self.metrics.enter()
        try:
            results = await self._run_in_time(explaining(engine, request.x_explain), record, max_length=max_length,
                                              overflow=overflow)
        except RequestError as exc:  # what only encoding finds: media that cannot be decoded
            raise _invalid_request(exc, asset_images) from None
        except TokenBudgetError as exc:
            raise _error(413, "token_budget_exceeded", str(exc) if exc.part == "explanation" else
                         f"{exc} (send \"x_overflow\": \"truncate_state\" to cut the state instead, or a larger "
                         f"\"x_max_length\")",
                         over_by=exc.over_by, part=exc.part, max_length=exc.max_length,
                         token_counts=exc.token_counts) from None
        except BusyError as exc:
            raise ApiError(429, {"error_type": "overloaded", "message": str(exc) or "the model queue is full"},
                           headers={"retry-after": "1"}) from None
        finally:
            self.metrics.leave()
        response = dict(results[0] if isinstance(results, list) else results)
        response["model"] = model if model is not None else name
        _check_finite(response)
        self.metrics.count_answer(response)
        return response

    async def _run_in_time(self, engine: Any, record: dict, **options: Any) -> list:
        """Encode (in the thread pool: tokenizer, media decoding) and wait for the GPU worker, all within
        `request_timeout`. Past it the request is answered at once and its queued work cancelled; encoding already
        running in a thread cannot be interrupted, so its future is cancelled as soon as it is queued."""
        deadline = time.monotonic() + self.request_timeout
        submitting = asyncio.ensure_future(
            run_in_threadpool(engine.submit, [record], priority="interactive", **options))
        try:
            future: concurrent.futures.Future = await asyncio.wait_for(asyncio.shield(submitting),
                                                                       self.request_timeout)
        except TimeoutError:
            submitting.add_done_callback(_cancel_submitted)
            raise self._deadline_error() from None
        waiting = asyncio.wrap_future(future)
        try:
            return await asyncio.wait_for(waiting, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            future.cancel()  # the scheduler skips a job cancelled before it runs
            raise self._deadline_error() from None

    def _deadline_error(self) -> ApiError:
        return ApiError(503, {"error_type": "deadline_exceeded",
                              "message": f"the model did not answer within {self.request_timeout:g} seconds "
                                         "(the server is busy or the request is very large); try again later"},
                        headers={"retry-after": "1"})

    async def models(self, request: Request) -> Response:
        status = 500
        try:
            self._authenticate(request)
            models = await self._models()
            listed = []
            for index, (name, engine) in enumerate(models.items()):
                info = await run_in_threadpool(_safe_call, engine.info, {})
                where = "remote endpoint" if info.get("remote") else f"on {info.get('device', '?')}"
                description = (f"Clef decision model {name} (revision {info.get('revision') or 'local'}) {where}."
                               + (f" The default: {MODEL_ALIAS} and any name not listed here map to it."
                                  if index == 0 else ""))
                listed.append({"name": name, "description": description, "release_date": _release_date(info)})
            default = listed[0]
            listed.append({"name": MODEL_ALIAS, "description": f"Alias of {default['name']}.",
                           "release_date": default["release_date"]})
            status = 200
            return JSONResponse({"models": listed})
        except ApiError as exc:
            status = exc.status
            return _error_response(exc)
        finally:
            self.metrics.count_request("/v1/models", status)

    async def health(self, request: Request) -> Response:
        models = await run_in_threadpool(self.models_or_none) or {}
        name, engine = next(iter(models.items()), (None, None))
        info = await run_in_threadpool(_safe_call, engine.info, {}) if engine is not None else {}
        body = {
            "ready": engine is not None,
            "model": name,
            "models": list(models),
            "revision": info.get("revision"),
            "device": info.get("device"),
        }
        status = 200 if engine is not None else 503
        self.metrics.count_request("/health", status)
        return JSONResponse(body, status_code=status)

    async def metrics_text(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except ApiError as exc:
            self.metrics.count_request("/metrics", exc.status)
            return _error_response(exc)
        self.metrics.count_request("/metrics", 200)
        text = await run_in_threadpool(self.metrics.exposition)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(openapi.document())

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(openapi.docs_page(openapi.document()))


def _invalid_request(exc: RequestError, asset_images: dict[int, str]) -> ApiError:
    problems = _name_assets([p.as_dict() for p in exc.problems], asset_images)
    return ApiError(422, [{**p, "loc": ["body", *p["loc"]]} for p in problems])


def _unauthorized(message: str, challenge: str) -> ApiError:
    return ApiError(401, {"error_type": "authentication_error", "message": message},
                    headers={"www-authenticate": challenge})


def _cancel_submitted(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().cancel()


def pick_model(models: dict[str, Any], model: Any) -> tuple[str, Any]:
    """(name, engine) for a request's `model`: the model of that name, exactly or ignoring case and an owner prefix;
    otherwise (jev-latest, an unknown name, none) the default, the first. Any name is accepted, as by hosted Jev."""
    if isinstance(model, str):
        if model in models:
            return model, models[model]
        wanted = model.strip().lower().rsplit("/", 1)[-1]
        for name, engine in models.items():
            if name.lower().rsplit("/", 1)[-1] == wanted:
                return name, engine
    return next(iter(models.items()))


def _public_model_name(info: dict) -> str:
    """A repo id as is; a local release folder by its folder name (clients need not see server paths)."""
    source = str(info.get("model") or "clef")
    return Path(source).name if ("/" in source or "\\" in source) and Path(source).exists() else source


def _looks_like_engine(obj: Any) -> bool:
    return hasattr(obj, "submit") and hasattr(obj, "info")


def _check_media(record: dict, skip_images: Collection[int] = ()) -> None:
    """Over HTTP, media must travel in the request: a data URL or {content_type, base64}. (The engine also takes
    file paths and frame arrays from Python callers; over the network a path would read the server's files.)
    `skip_images`: indices holding asset bytes the server decoded itself."""
    problems = []
    for key in ("images", "videos"):
        items = record.get(key)
        if not isinstance(items, list):
            continue  # None is fine; other types get the engine's own message
        for index, item in enumerate(items):
            if key == "images" and index in skip_images:
                continue
            ok = (isinstance(item, str) and item.startswith("data:")) or (
                isinstance(item, dict) and "base64" in item and set(item) <= {"base64", "content_type"})
            if not ok:
                problems.append({"loc": ["body", key, index], "type": "value_error.media",
                                 "msg": f"each of {key} must be a data URL (data:<type>;base64,...) or an object "
                                        "{\"content_type\": ..., \"base64\": ...}"})
    if problems:
        raise ApiError(422, problems)


def _check_finite(response: dict) -> None:
    try:
        json.dumps(response, allow_nan=False)
    except ValueError:
        raise RuntimeError("the engine produced a non-finite number") from None


def _release_date(info: dict) -> str:
    date = info.get("release_date")
    if isinstance(date, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        return date
    source = info.get("path") or info.get("source")
    try:
        mtime = (Path(source) / "config.json").stat().st_mtime if source else None
    except (OSError, TypeError):
        mtime = None
    when = datetime.fromtimestamp(mtime, UTC) if mtime else datetime.now(UTC)
    return when.strftime("%Y-%m-%d")


class SafeJSONResponse(JSONResponse):
    """JSON as UTF-8; if some string cannot be UTF-8 (a surrogate that slipped through), \\u-escape instead of
    failing: an error answer must always be deliverable."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(exc: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = dict(exc.headers)
    if request_id:
        headers["x-typesafe-request-id"] = request_id
    return SafeJSONResponse({"detail": exc.detail}, status_code=exc.status, headers=headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse({"detail": {"error_type": kind, "message": str(exc.detail)}}, status_code=exc.status_code,
                        headers=exc.headers)


def routes(engine_provider: EngineProvider | Any, *, api_key: str | None = None,
           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
           request_timeout: float = DEFAULT_REQUEST_TIMEOUT) -> list[Route]:
    """The API's routes, to mount in another Starlette app (e.g. `st.App(..., routes=routes(get_engine))`).

    `engine_provider` is the engine, a mapping name → engine (several models, the default first), or a callable
    returning either (called per request; it may load on first call, e.g. a `st.cache_resource` function, and may
    raise or return None while no model is loaded).
    """
    api = SystemOneApi(engine_provider, api_key=api_key, max_body_bytes=max_body_bytes,
                       request_timeout=request_timeout)
    return [
        Route("/v1/systemone", api.system_one, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
        Route("/openapi.json", api.openapi_json, methods=["GET"]),
        Route("/docs", api.docs, methods=["GET"]),
    ]


def create_app(engine_provider: EngineProvider | Any, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
               cors_origins: list[str] | None = None) -> Starlette:
    """A standalone Starlette app serving the System One API from `engine_provider`. CORS headers only for the
    origins named in `cors_origins` (none by default: a web page elsewhere gets no readable answer)."""
    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["authorization", "content-type", "content-encoding"],
                                     expose_headers=["x-typesafe-request-id", "retry-after"]))
    return Starlette(
        routes=routes(engine_provider, api_key=api_key, max_body_bytes=max_body_bytes,
                      request_timeout=request_timeout),
        exception_handlers={HTTPException: _http_exception},
        middleware=middleware,
    )
