"""A Jev / System One–compatible HTTP API served from a resident Clef engine.

Routes (see `routes`):
- `POST /v1/systemone` — a System One request (spec §5) → a System One response, plus `x_` extras.
- `GET /v1/models` — the resident model and the `jev-latest` alias (any model name maps to the resident model).
- `GET /health` — `{"ready", "model", "revision", "device"}`; 503 while no engine is loaded. Never needs a key.
- `GET /metrics` — Prometheus text exposition.

Wire contract beyond spec §5:
- Unknown top-level fields are ignored; `model` may be any string and is echoed in the response.
- Overflow: a record over the token budget gets 413 unless the request body opts in with the top-level field
  `"x_overflow": "truncate_state"` (the reference's behaviour: cut the end of the state; the response says how many
  state tokens were dropped in `x_truncated_state_tokens`). `"x_max_length": N` raises or lowers the budget.
- Media: `images` (PNG/JPEG/WebP, up to 4, 16 MP each) and `videos` (MP4/WebM/MOV) as data URLs or
  `{"content_type", "base64"}` objects; the engine checks formats and limits. File paths, which the engine accepts
  from Python callers, are refused over HTTP (they would read the server's disk). The TypeSafe SDK's `assets` (JSON
  `{"format", "data_base64"}` or multipart parts) are accepted too: each asset becomes one image, in order, and its
  placeholder in the text is replaced by `[image N]`.
- Bodies: JSON (or the SDK's multipart form), at most `max_body_bytes` (default 32 MiB) before and after
  decompression, nested at most 64 deep, strings valid Unicode, numbers finite. `Content-Encoding: gzip` or `zstd`
  (the TypeSafe SDK compresses with zstd when it can).
- Errors: 422 `{"detail": [{"loc", "msg", "type"}]}` for invalid requests (locations start with "body", as in the
  ecosystem); other errors `{"detail": {"error_type", "message"}}`: 401/403 authentication_error, 413
  request_too_large / token_budget_exceeded, 415 unsupported_encoding, 429 overloaded (Retry-After: 1), 503 not_ready
  while no model is loaded. Any other 5xx is a server fault, never the request's.
- With an API key configured, `/v1/*` and `/metrics` need `Authorization: Bearer KEY`; without one an
  Authorization header is ignored.
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
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..errors import BusyError, RequestError, TokenBudgetError
from ..model.media import sniff_content_type

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
MAX_JSON_DEPTH = 64  # deeper nesting only serves to blow Python's recursion limit in the encoder
MAX_LENGTH_CEILING = 1 << 20
MODEL_ALIAS = "jev-latest"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ENGINE_FIELDS = ("state", "questions", "images", "videos")  # what the engine gets; the rest is ours or ignored
OVERFLOW_POLICIES = ("refuse", "truncate_state")

EngineProvider = Callable[[], Any]
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


class Metrics:
    """Counters for /metrics. Written from the event loop and read by scrapes, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_count = 0
        self.latency_sum = 0.0
        self.input_tokens = 0
        self.decisions = 0
        self.truncated_state_tokens = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def count_request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency_count += 1
            self.latency_sum += seconds
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_buckets[i] += 1

    def count_answer(self, response: dict) -> None:
        with self._lock:
            usage = response.get("usage") or {}
            self.input_tokens += int(usage.get("input_tokens") or 0)
            self.decisions += len(response.get("answers") or {})
            self.truncated_state_tokens += int(response.get("x_truncated_state_tokens") or 0)

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def render(self, engine: Any | None, info: dict | None) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for suffix_labels, value in samples:
                lines.append(f"{name}{suffix_labels} {_number(value)}")

        with self._lock:
            metric(
                "clef_api_requests_total", "counter", "HTTP requests answered, by path and status.",
                [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())],
            )
            lines.append("# HELP clef_api_request_duration_seconds Time to answer POST /v1/systemone, any status.")
            lines.append("# TYPE clef_api_request_duration_seconds histogram")
            for bound, count in zip(LATENCY_BUCKETS, self.latency_buckets, strict=True):
                lines.append(f'clef_api_request_duration_seconds_bucket{{le="{bound}"}} {count}')
            lines.append(f'clef_api_request_duration_seconds_bucket{{le="+Inf"}} {self.latency_count}')
            lines.append(f"clef_api_request_duration_seconds_sum {_number(self.latency_sum)}")
            lines.append(f"clef_api_request_duration_seconds_count {self.latency_count}")
            metric("clef_api_input_tokens_total", "counter", "Input tokens of answered requests.",
                   [("", self.input_tokens)])
            metric("clef_api_decisions_total", "counter", "Questions answered.", [("", self.decisions)])
            metric("clef_api_truncated_state_tokens_total", "counter",
                   "State tokens cut on requests that opted in to truncation.", [("", self.truncated_state_tokens)])
            metric("clef_api_requests_in_flight", "gauge", "Requests waiting for the engine now.",
                   [("", self.in_flight)])
            metric("clef_api_requests_in_flight_max", "gauge", "Most requests waiting for the engine at once.",
                   [("", self.max_in_flight)])
        metric("clef_engine_ready", "gauge", "1 when a model is loaded and answering.", [("", 1 if engine else 0)])
        if engine is not None:
            metric("clef_engine_queue_depth", "gauge", "Requests waiting for the GPU worker.",
                   [("", _safe_call(engine.queue_depth, default=0))])
        scheduler = (info or {}).get("scheduler") or {}
        for key, name, kind, help_text in SCHEDULER_METRICS:
            if isinstance(scheduler.get(key), (int, float)):
                metric(name, kind, help_text, [("", scheduler[key])])
        memory = {"loaded": 0, "allocated": 0, "peak_allocated": 0, "peak_reserved": 0}
        memory.update({k: v for k, v in ((info or {}).get("memory") or {}).items() if isinstance(v, (int, float))})
        metric("clef_engine_memory_bytes", "gauge", "Accelerator memory: weights loaded, allocated now, peak "
               "allocated, peak reserved (0 on CPU).", [(f'{{kind="{k}"}}', v) for k, v in sorted(memory.items())])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _safe_call(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # a metrics scrape must not fail because the engine is busy or gone
        log.exception("metrics: %s failed", getattr(fn, "__name__", fn))
        return default


def _check_json_tree(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, and strings that are not Unicode (JSON allows escaped lone
    surrogates like "\\ud800"; nothing downstream can encode them). Iterative: no recursion to blow."""
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


def _replace_placeholders(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        for placeholder, label in names.items():
            value = value.replace(placeholder, label)
        return value
    if isinstance(value, list):
        return [_replace_placeholders(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _replace_placeholders(v, names) for k, v in value.items()}
    return value


def assets_to_images(body: dict, parts: dict[str, tuple[str | None, bytes]]) -> dict:
    """TypeSafe `assets` → Clef `images`: each asset one image (data URL), placeholders become `[image N]`."""
    assets = body.get("assets")
    if assets is None:
        return body
    if not isinstance(assets, dict) or not assets:
        raise _invalid(["assets"], "assets must be a non-empty object of placeholder → asset", "dict_type")
    images = body.get("images") if body.get("images") is not None else []
    if not isinstance(images, list):
        raise _invalid(["images"], "images must be an array", "list_type")
    images = list(images)
    labels: dict[str, str] = {}
    for placeholder, asset in assets.items():
        loc: list[str | int] = ["assets", placeholder]
        if not isinstance(asset, dict):
            raise _invalid(loc, "an asset must be an object", "dict_type")
        if asset.get("type", "image") not in ("image", None):
            raise _invalid([*loc, "type"], "only image assets are supported", "literal_error")
        part = asset.get("part")
        if part is not None:
            if not isinstance(part, str) or part not in parts:
                raise _invalid([*loc, "part"], f"no multipart part named {part!r} in the request", "value_error")
            data = parts[part][1]
        else:
            encoded = asset.get("data_base64")
            if not isinstance(encoded, str):
                raise _invalid([*loc, "data_base64"], "data_base64 (a string) or part is required", "missing")
            try:
                data = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise _invalid([*loc, "data_base64"], "data_base64 is not valid base64", "value_error") from None
        # The bytes say what the image is (as the hosted API does); a declared format is not trusted.
        content_type = sniff_content_type(data)
        if content_type is None or not content_type.startswith("image/"):
            raise _invalid(loc, "the asset is not a PNG, JPEG or WebP image", "value_error")
        images.append(f"data:{content_type};base64,{base64.b64encode(data).decode('ascii')}")
        labels[placeholder] = f"[image {len(images)}]"
    rest = {k: v for k, v in body.items() if k != "assets"}
    for key in ("state", "questions"):
        if key in rest:
            rest[key] = _replace_placeholders(rest[key], labels)
    rest["images"] = images
    return rest


class SystemOneApi:
    """The handlers, bound to an engine provider, an optional key and the metrics they keep."""

    def __init__(self, engine_provider: EngineProvider | Any, *, api_key: str | None, max_body_bytes: int,
                 metrics: Metrics | None = None):
        self._provider = engine_provider if callable(engine_provider) and not _looks_like_engine(engine_provider) \
            else (lambda: engine_provider)
        self._key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics or Metrics()

    # --- engine access -------------------------------------------------------------------------------------
    def engine_or_none(self) -> Any | None:
        try:
            return self._provider()
        except Exception:  # not loaded / failed to load: health says so, requests get 503
            log.exception("engine provider failed")
            return None

    async def _engine(self) -> Any:
        engine = await run_in_threadpool(self.engine_or_none)
        if engine is None:
            error = _error(503, "not_ready", "the model is not loaded yet; see GET /health")
            error.headers["retry-after"] = "5"
            raise error
        return engine

    # --- auth and body ---------------------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> None:
        if self._key is None:
            return
        header = request.headers.get("authorization")
        if not header:
            raise _error(401, "authentication_error", "missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _error(401, "authentication_error", "the Authorization header must be 'Bearer <key>'")
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes sent (a UTF-8 key compares right).
        if not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            raise _error(403, "authentication_error", "invalid API key")

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
        return self._decompress(raw, encoding, too_large)

    def _decompress(self, raw: bytes, encoding: str, too_large: ApiError) -> bytes:
        limit = self.max_body_bytes
        try:
            if encoding == "gzip":
                decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                out = decoder.decompress(raw, limit + 1)
            elif encoding == "zstd" and ZstdDecompressor is not None:
                out = ZstdDecompressor().decompress(raw, max_length=limit + 1)
            else:
                supported = "gzip, zstd" if ZstdDecompressor is not None else "gzip"
                raise _error(415, "unsupported_encoding",
                             f"Content-Encoding {encoding!r} is not supported (supported: {supported})")
        except (zlib.error, ZstdError, gzip.BadGzipFile, EOFError) as exc:
            raise _invalid([], f"the body could not be decompressed as {encoding}: {exc}", "decompression_error") \
                from None
        if len(out) > limit:  # zip bombs stop here, after at most limit + 1 bytes of output
            raise too_large
        return out

    async def _parse_request(self, request: Request, raw: bytes) -> dict:
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            return parse_json_body(raw)
        parts = await self._parse_multipart(content_type, raw)
        request_part = parts.pop("request", None)
        if request_part is None:
            raise _invalid(["request"], "a multipart request needs a part named 'request' holding the JSON body",
                           "missing")
        return assets_to_images(parse_json_body(request_part[1]), parts)

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
            raw = await self._read_body(request)
            body = await self._parse_request(request, raw)
            engine = await self._engine()
            answer = await self._decide(engine, body)
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
            self.metrics.observe_latency(time.perf_counter() - started)

    async def _decide(self, engine: Any, body: dict) -> dict:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _invalid(["model"], "model must be a string", "string_type")
        overflow = body.get("x_overflow", "refuse")
        if overflow not in OVERFLOW_POLICIES:
            raise _invalid(["x_overflow"], f"x_overflow must be one of {list(OVERFLOW_POLICIES)}", "literal_error")
        max_length = body.get("x_max_length")
        if max_length is not None and (
            not isinstance(max_length, int) or isinstance(max_length, bool) or not 1 <= max_length <= MAX_LENGTH_CEILING
        ):
            raise _invalid(["x_max_length"], f"x_max_length must be an integer from 1 to {MAX_LENGTH_CEILING}",
                           "int_type")
        record = {k: body[k] for k in ENGINE_FIELDS if k in body}
        _check_media(record)
        self.metrics.enter()
        try:
            # submit validates and encodes (tokenizer, image and video decoding) in the calling thread, so it runs in
            # the thread pool; the batch itself runs on the engine's GPU worker, where concurrent requests share one.
            future: concurrent.futures.Future = await run_in_threadpool(
                engine.submit, [record], priority="interactive", max_length=max_length, overflow=overflow
            )
            results = await asyncio.wrap_future(future)
        except RequestError as exc:
            raise ApiError(422, [{**p.as_dict(), "loc": ["body", *p.as_dict()["loc"]]} for p in exc.problems]) \
                from None
        except TokenBudgetError as exc:
            raise _error(413, "token_budget_exceeded",
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
        response["model"] = model if model is not None else self._model_name(engine)
        _check_finite(response)
        self.metrics.count_answer(response)
        return response

    def _model_name(self, engine: Any) -> str:
        return _public_model_name(_safe_call(engine.info, default={}))

    async def models(self, request: Request) -> Response:
        status = 500
        try:
            self._authenticate(request)
            engine = await self._engine()
            info = await run_in_threadpool(_safe_call, engine.info, {})
            name = _public_model_name(info)
            released = _release_date(info)
            description = (f"Clef decision model {name} (revision {info.get('revision') or 'local'}) on "
                           f"{info.get('device', '?')}. Any model name, including {MODEL_ALIAS}, maps to it.")
            status = 200
            return JSONResponse({"models": [
                {"name": name, "description": description, "release_date": released},
                {"name": MODEL_ALIAS, "description": f"Alias of {name}.", "release_date": released},
            ]})
        except ApiError as exc:
            status = exc.status
            return _error_response(exc)
        finally:
            self.metrics.count_request("/v1/models", status)

    async def health(self, request: Request) -> Response:
        engine = await run_in_threadpool(self.engine_or_none)
        info = await run_in_threadpool(_safe_call, engine.info, {}) if engine is not None else {}
        body = {
            "ready": engine is not None,
            "model": info.get("model"),
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
        engine = await run_in_threadpool(self.engine_or_none)
        info = await run_in_threadpool(_safe_call, engine.info, {}) if engine is not None else {}
        text = await run_in_threadpool(self.metrics.render, engine, info)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _public_model_name(info: dict) -> str:
    """A repo id as is; a local release folder by its folder name (clients need not see server paths)."""
    source = str(info.get("model") or "clef")
    return Path(source).name if ("/" in source or "\\" in source) and Path(source).exists() else source


def _looks_like_engine(obj: Any) -> bool:
    return hasattr(obj, "submit") and hasattr(obj, "info")


def _check_media(record: dict) -> None:
    """Over HTTP, media must travel in the request: a data URL or {content_type, base64}. (The engine also takes
    file paths and frame arrays from Python callers; over the network a path would read the server's files.)"""
    problems = []
    for key in ("images", "videos"):
        items = record.get(key)
        if not isinstance(items, list):
            continue  # None is fine; other types get the engine's own message
        for index, item in enumerate(items):
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
           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics: Metrics | None = None) -> list[Route]:
    """The API's routes, to mount in another Starlette app (e.g. `st.App(..., routes=routes(get_engine))`).

    `engine_provider` is the engine or a callable returning it (called per request; it may load on first call,
    e.g. a `st.cache_resource` function, and may raise while no model is loaded).
    """
    api = SystemOneApi(engine_provider, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    return [
        Route("/v1/systemone", api.system_one, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]


def create_app(engine_provider: EngineProvider | Any, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """A standalone Starlette app serving the System One API from `engine_provider`."""
    return Starlette(
        routes=routes(engine_provider, api_key=api_key, max_body_bytes=max_body_bytes),
        exception_handlers={HTTPException: _http_exception},
    )
