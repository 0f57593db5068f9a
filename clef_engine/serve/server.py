"""The System One HTTP API (Jev-compatible) on resident Clef engines: `POST /v1/systemone`, `GET /v1/models`,
`/health`, `/metrics`, `/openapi.json` and `/docs`. The wire contract (fields, limits, errors) is docs/api.md.
bodies.py reads bodies, admission.py paces big ones, metrics.py counts, responses.py shapes error answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..calibrated import Calibration, CalibrationProvider, calibrate_answers
from ..errors import BusyError, RequestError, TokenBudgetError
from ..explain import Explaining, explaining
from ..interface import DecisionEngine
from ..model.encoding import SHORTEN
from ..protocol import DEFAULT_MAX_LENGTH, ValidRequest, check_schema_floor, prepare
from ..protocol import Response as SystemOneAnswer
from . import openapi
from .admission import PACED_REQUEST_BYTES, PACED_SHARE, BigBodies, Paced, Turns
from .bodies import (
    ApiError,
    api_error,
    body_kind,
    clip,
    decompress,
    invalid,
    name_assets,
    parse_multipart,
)
from .metrics import Metrics, safe_call
from .responses import SafeJSONResponse, error_response, host_allow_list

log = logging.getLogger("clef_engine.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # 4 images of 16 MP as base64 PNG fit; anything bigger is a mistake
DEFAULT_REQUEST_TIMEOUT = 120.0  # seconds; a long CPU batch fits, a wedged queue does not
MODEL_ALIAS = "jev-latest"
MAX_MODEL_CHARS = 256  # a model name is echoed in every answer
ENGINE_FIELDS = ("state", "questions", "images", "videos")  # what the engine gets; the rest is ours or ignored
EngineProvider = Callable[[], Any]  # returns an engine, a mapping name → engine (default first), or None


# --- the API -------------------------------------------------------------------------------------------------------


class SystemOneApi:
    """The handlers, bound to an engine provider, an optional key, limits and the metrics they keep."""

    def __init__(self, engine_provider: EngineProvider | Any, *, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 max_tokens_per_request: int | None = None, calibrations: CalibrationProvider | None = None):
        """`engine_provider`: an engine, a mapping name → engine (the default first), or a callable returning either
        per request (it may load on first call, raise or return None while none is loaded). `max_tokens_per_request`:
        the most tokens one request may buy (None: each engine's token budget); `x_max_length` may lower it, never
        raise it. `calibrations`: returns those a request's `x_calibration` may name (None: none)."""
        self._provider = engine_provider if callable(engine_provider) and not isinstance(
            engine_provider, DecisionEngine) else (lambda: engine_provider)
        self._key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.max_tokens_per_request = max_tokens_per_request
        self._calibrations = calibrations
        self._named: tuple[weakref.ref, str] | None = None  # (engine, its public name): see _name_of
        self.metrics = Metrics(self.models_or_none)
        self._big_bodies = BigBodies()  # bodies of a megabyte or more are parsed in worker processes
        self._paced = Turns(PACED_SHARE)
        self._requests_in_flight = 0  # POST /v1/systemone requests being handled now
        self._handling: set[asyncio.Task] = set()  # their tasks, for `stop`
        self._stopped = False

    def routes(self) -> list[Route]:
        return [
            Route("/v1/systemone", self.system_one, methods=["POST"]),
            Route("/v1/models", self._counted("/v1/models", self._models_list), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self._counted("/metrics", self._exposition), methods=["GET"]),
            Route("/openapi.json", lambda request: JSONResponse(openapi.document()), methods=["GET"]),
            Route("/docs", lambda request: HTMLResponse(openapi.docs_page(openapi.document())), methods=["GET"]),
        ]

    def stop(self) -> None:
        """The server is stopping and waits no longer: every request still being handled is answered at once with
        503 shutting_down, and its work is abandoned (cancelled if queued, stopped at the engine's next layer if
        running), rather than cut off without an answer."""
        self._stopped = True
        for task in self._handling:
            task.cancel()

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
            named = self._named = (weakref.ref(engine), _public_model_name(safe_call(engine.info, default={})))
        return named[1]

    async def _models(self) -> dict[str, Any]:
        models = await run_in_threadpool(self.models_or_none)
        if not models:
            raise api_error(503, "not_ready", "the model is not loaded yet; see GET /health", retry_after=5)
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

    async def _read_body(self, request: Request, declared_size: int | None) -> bytes:
        limit = self.max_body_bytes
        too_large = api_error(413, "request_too_large", f"the request body is larger than {limit} bytes")
        if declared_size is not None and declared_size > limit:
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise too_large
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return bytes(raw)
        # Inflating up to max_body_bytes takes a while; off the event loop, so that other requests go on meanwhile.
        return await run_in_threadpool(decompress, bytes(raw), encoding, limit, too_large)

    async def _parse_request(self, kind: str, content_type: str, raw: bytes,
                             client: str) -> tuple[dict, dict[int, str]]:
        """The request object and, when assets became images, image index → asset name."""
        if kind == "json":
            return await self._big_bodies.parse(client, raw, {})
        parts = await parse_multipart(content_type, raw, self.max_body_bytes)
        request_part = parts.pop("request", None)
        if request_part is None:
            raise invalid(["request"], "a multipart request needs a part named 'request' holding the JSON body",
                          "missing")
        return await self._big_bodies.parse(client, request_part[1], parts)

    # --- handlers ----------------------------------------------------------------------------------------------
    async def system_one(self, request: Request) -> Response:
        started = time.perf_counter()
        request_id = uuid.uuid4().hex
        response: Response | None = None  # None: a fault of ours, raised on (counted as a 500)
        paced: Paced | None = None
        self._requests_in_flight += 1
        handling = asyncio.current_task()
        assert handling is not None
        self._handling.add(handling)
        try:
            if self._stopped:  # come on a connection kept alive while the server stops
                raise _shutting_down()
            self._authenticate(request)
            content_type = request.headers.get("content-type", "")
            kind = body_kind(content_type)
            client = request.client.host if request.client else "?"
            declared = request.headers.get("content-length")
            size = int(declared) if declared and declared.isdigit() else None
            # a body over the limit is refused from its Content-Length at once, with no turn to wait for
            if size is None or PACED_REQUEST_BYTES <= size <= self.max_body_bytes:
                paced = await self._paced.begin(client, lambda: self._requests_in_flight > 1, self.request_timeout)
            try:  # a client trickling its body would otherwise hold a connection and a handler as long as it likes
                raw = await asyncio.wait_for(self._read_body(request, size), self.request_timeout)
            except TimeoutError:
                raise api_error(408, "request_timeout",
                                f"the request body did not arrive within {self.request_timeout:g} seconds") from None
            body, asset_images = await self._parse_request(kind, content_type, raw, client)
            # an explanation costs many decides, whatever its size: paced as big requests are, until it is answered
            explaining_it = body.get("x_explain") not in (None, False)
            if explaining_it and paced is None:
                paced = await self._paced.begin(client, lambda: self._requests_in_flight > 1, self.request_timeout)
            _check_model_name(body.get("model"))
            name, engine = pick_model(await self._models(), body.get("model"))
            answer = await self._decide(engine, name, body, asset_images,
                                        queued=paced.end if paced and not explaining_it else None)
            # serialized once, here; a number that is not finite fails it: a fault of ours (500), never sent
            response = SafeJSONResponse(answer, headers={"x-typesafe-request-id": request_id})
            self.metrics.count_answer(answer)
        except ApiError as exc:
            response = error_response(exc, request_id)
        except ClientDisconnect:
            response = Response(status_code=499)
        except asyncio.CancelledError:
            if not self._stopped or handling.uncancel() > 0:  # not (only) `stop`'s cancellation: not ours to end
                raise
            response = error_response(_shutting_down(), request_id)
        except MemoryError:  # the request needed more memory than the server has: the request's size, not a fault
            log.warning("request %s ran out of memory", request_id)
            response = error_response(api_error(413, "request_too_large", "the request needs more memory than this "
                                                "server has to give one request; send less (fewer or smaller media, "
                                                "a shorter state)"), request_id)
        except Exception:  # a fault of ours, never of the input (the input's faults are ApiErrors above)
            log.exception("POST /v1/systemone failed (request %s)", request_id)
            response = error_response(api_error(500, "internal_error", f"internal error (request {request_id})"),
                                      request_id)
        finally:
            self._handling.discard(handling)
            self._requests_in_flight -= 1
            if paced is not None:
                paced.end()
            self.metrics.count_request("/v1/systemone", response.status_code if response is not None else 500)
            self.metrics.latency.observe(time.perf_counter() - started)
        return response

    async def _decide(self, engine: Any, name: str, body: dict, asset_images: dict[int, str],
                      queued: Callable[[], None] | None = None) -> SystemOneAnswer:
        """The engine's answer to `body`; `queued` is called once the engine has the record queued."""
        record = {k: body[k] for k in ENGINE_FIELDS if k in body}
        _check_media(record, skip_images=set(asset_images))
        # the most tokens one request may buy: the operator's limit, else the engine's token budget, else the model's
        # default length (a remote engine has no budget here)
        ceiling = self.max_tokens_per_request
        if ceiling is None:
            ceiling = engine.token_budget if engine.token_budget and engine.token_budget > 0 else DEFAULT_MAX_LENGTH
        asked = body.get("x_max_length")
        asked = asked if type(asked) is int and asked >= 1 else DEFAULT_MAX_LENGTH  # validated below
        try:
            check_schema_floor(body, min(asked, ceiling))  # thousands of questions: refused before they are read
        except TokenBudgetError as exc:
            raise _too_many_tokens(exc, asked, ceiling) from None
        # The contract's models say what a valid request is (the 422 body lists every problem): validated here, once,
        # and handed to the engine as a ValidRequest, which it encodes without validating again. In the thread pool:
        # a large state or large media strings take a while to walk.
        try:
            valid = await run_in_threadpool(prepare, body)
        except RequestError as exc:
            raise _invalid_request(exc, asset_images) from None
        # a calibration that does not exist is the request's fault, found before any work is paid for
        named = body.get("x_calibration")
        calibration = None if named is None else await self._calibration(named)
        # the engine (and an endpoint a remote engine forwards to) gets the engine's fields, under this server's budget;
        # the response names the model as the request did, else as this server does
        request = replace(valid, request=record, model=name if valid.model is None else valid.model,
                          max_length=min(asked, ceiling))
        self.metrics.enter()
        try:
            results = await self._run_in_time(explaining(engine, valid.explain, self.max_tokens_per_request), request,
                                              queued)
        except RequestError as exc:  # what only encoding finds: media that cannot be decoded
            raise _invalid_request(exc, asset_images) from None
        except TokenBudgetError as exc:
            raise _too_many_tokens(exc, asked, ceiling) from None
        except BusyError as exc:
            raise api_error(429, "overloaded", str(exc) or "the model queue is full", retry_after=1) from None
        finally:
            self.metrics.leave()
        [response] = results
        if calibration is not None:
            response["x_calibrated"] = calibrate_answers(calibration, response["answers"])
        return response

    async def _calibration(self, name: str) -> Calibration:
        known = await run_in_threadpool(self._calibrations) if self._calibrations is not None else {}
        if name not in known:
            listed = ", ".join(repr(n) for n in sorted(known)) or "none"
            raise invalid(["x_calibration"], f"no calibration named {clip(name)!r} on this server; it has: {listed}",
                          "value_error.calibration")
        return known[name]

    async def _run_in_time(self, engine: DecisionEngine | Explaining, request: ValidRequest,
                           queued: Callable[[], None] | None = None) -> list:
        """Encode (in the thread pool: tokenizer, media decoding) and wait for the GPU worker, all within
        `request_timeout`. Past it the request is answered at once and its work abandoned: cancelled if queued,
        stopped between layers if running (the engine's `abandon`); encoding already running in a thread cannot be
        interrupted, so its work is abandoned as soon as it is queued."""
        deadline = time.monotonic() + self.request_timeout
        submitting = asyncio.ensure_future(run_in_threadpool(engine.submit, [request], priority="interactive"))
        try:
            future: concurrent.futures.Future = await asyncio.wait_for(asyncio.shield(submitting),
                                                                       self.request_timeout)
            if queued is not None:
                queued()
            return await asyncio.wait_for(asyncio.wrap_future(future), max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.CancelledError) as exc:  # past the deadline, or the server stops (`stop`)
            # a remote engine only cancels what it has not sent
            submitting.add_done_callback(lambda task: _abandon_submitted(engine, task))
            if isinstance(exc, TimeoutError):
                raise api_error(503, "deadline_exceeded", f"the model did not answer within "
                                f"{self.request_timeout:g} seconds (the server is busy or the request is very large); "
                                "try again later", retry_after=1) from None
            raise

    async def _models_list(self) -> Response:
        listed = []
        for index, (name, engine) in enumerate((await self._models()).items()):
            info = await run_in_threadpool(safe_call, engine.info, {})
            where = "remote endpoint" if info.get("remote") else f"on {info.get('device', '?')}"
            description = (f"Clef decision model {name} (revision {info.get('revision') or 'local'}) {where}."
                           + (f" The default: {MODEL_ALIAS} and any name not listed here map to it."
                              if index == 0 else ""))
            # a client (the workbench) flags answers of a model whose weights are random as meaning nothing
            entry = {"name": name, "description": description, "release_date": _release_date(info),
                     "random_weights": bool(info.get("random_weights"))}
            listed.append(entry)
        default = listed[0]
        listed.append({**{key: value for key, value in default.items() if key not in ("name", "description")},
                       "name": MODEL_ALIAS, "description": f"Alias of {default['name']}."})
        return JSONResponse({"models": listed})

    def _counted(self, path: str,
                 answer: Callable[[], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """The handler of `path`: `answer()` for an authenticated request, or the error answer; counted by status."""

        async def handle(request: Request) -> Response:
            try:
                self._authenticate(request)
                response = await answer()
            except ApiError as exc:
                response = error_response(exc)
            self.metrics.count_request(path, response.status_code)
            return response

        return handle

    async def health(self, request: Request) -> Response:
        models = await run_in_threadpool(self.models_or_none) or {}
        name, engine = next(iter(models.items()), (None, None))
        info = await run_in_threadpool(safe_call, engine.info, {}) if engine is not None else {}
        body = {
            "ready": engine is not None,
            "state": info.get("state", "ready") if engine is not None else "loading",
            "model": name,
            "models": list(models),
            "revision": info.get("revision"),
            "device": info.get("device"),
        }
        status = 200 if engine is not None else 503
        self.metrics.count_request("/health", status)
        return JSONResponse(body, status_code=status)

    async def _exposition(self) -> Response:
        text = await run_in_threadpool(self.metrics.exposition)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _invalid_request(exc: RequestError, asset_images: dict[int, str]) -> ApiError:
    problems = name_assets([p.as_dict() for p in exc.problems], asset_images)
    return ApiError(422, [{**p, "loc": ["body", *p["loc"]]} for p in problems])


def _too_many_tokens(exc: TokenBudgetError, asked: int, ceiling: int) -> ApiError:
    """The engine's facts with advice in the API's words: only what this request could change (a schema over budget
    is not helped by cutting the state, nor any record by a larger "x_max_length" past this server's ceiling)."""
    larger = ", or a larger \"x_max_length\"" if exc.max_length < ceiling else ""
    frame = exc.token_counts.get("prefix", 0) + exc.token_counts.get("suffix", 0)
    if exc.part == "explanation":  # the variants of x_explain: the message names their cost
        advice = "ask for a coarser x_explain unit or a shorter state"
    elif frame >= exc.max_length:  # the prompt's own text fills "x_max_length"
        advice = "send a larger \"x_max_length\""
    elif exc.part == "state":
        advice = f"send \"x_overflow\": \"truncate_state\" to cut the state{larger}"
    else:
        advice = f"{SHORTEN.get(exc.part, 'shorten the request')}{larger}"
    if asked > ceiling:  # the client asked for more than this server sells
        advice = f"this server answers at most {ceiling:,} tokens per request, whatever \"x_max_length\" asks; {advice}"
    return api_error(413, "token_budget_exceeded", f"{exc.facts} ({advice})", over_by=exc.over_by, part=exc.part,
                     max_length=exc.max_length, max_tokens_per_request=ceiling, token_counts=exc.token_counts)


def _unauthorized(message: str, challenge: str) -> ApiError:
    return ApiError(401, {"error_type": "authentication_error", "message": message},
                    headers={"www-authenticate": challenge})


def _shutting_down() -> ApiError:
    return api_error(503, "shutting_down", "the server is shutting down and did not answer; send the request again",
                     retry_after=1)


def _abandon_submitted(engine: DecisionEngine | Explaining, task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        engine.abandon(task.result())


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


def _check_media(record: dict, skip_images: Collection[int] = ()) -> None:
    """Over HTTP, media must travel in the request: a data URL or {content_type, base64}. (The engine also takes
    file paths and frame arrays from Python callers; over the network a path would read the server's files.)
    `skip_images`: indices holding asset bytes the server decoded itself."""
    problems = [{"loc": ["body", key, index], "type": "value_error.media",
                 "msg": f"each of {key} must be a data URL (data:<type>;base64,...) or an object "
                        "{\"content_type\": ..., \"base64\": ...}"}
                for key in ("images", "videos") if isinstance(record.get(key), list)  # others: the engine's message
                for index, item in enumerate(record[key]) if not (key == "images" and index in skip_images)
                and not (isinstance(item, str) and item.startswith("data:"))
                and not (isinstance(item, dict) and "base64" in item and set(item) <= {"base64", "content_type"})]
    if problems:
        raise ApiError(422, problems)


def _check_model_name(model: Any) -> None:
    """`model` is echoed in the answer: a name, not a payload."""
    if isinstance(model, str) and len(model) > MAX_MODEL_CHARS:
        raise invalid(["model"], f"model must be at most {MAX_MODEL_CHARS} characters (it has {len(model)})",
                      "string_too_long")


def _release_date(info: dict) -> str:
    """When the release's config.json was written; today for an endpoint (no release folder here)."""
    try:
        when = datetime.fromtimestamp((Path(info["path"]) / "config.json").stat().st_mtime, UTC)
    except (KeyError, OSError):
        when = datetime.now(UTC)
    return when.strftime("%Y-%m-%d")


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse({"detail": {"error_type": kind, "message": str(exc.detail)}}, status_code=exc.status_code,
                        headers=exc.headers)


def routes(engine_provider: EngineProvider | Any, **settings: Any) -> list[Route]:
    """The API's routes, to mount in another Starlette app (the workbench's); `settings` as SystemOneApi takes them."""
    return SystemOneApi(engine_provider, **settings).routes()


def create_app(engine_provider: EngineProvider | Any, *, cors_origins: list[str] | None = None,
               allowed_hosts: Collection[str] | None = None, **settings: Any) -> Starlette:
    """A standalone app serving the API. CORS headers only for `cors_origins` (none by default: a page elsewhere gets
    no readable answer); with `allowed_hosts`, another Host gets 421 (DNS rebinding); no redirects, so a Location is
    never built from the client's Host. `app.state.system_one` is the SystemOneApi (`stop` at shutdown)."""
    middleware = host_allow_list(allowed_hosts) if allowed_hosts is not None else []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["authorization", "content-type", "content-encoding"],
                                     expose_headers=["x-typesafe-request-id", "retry-after"]))
    api = SystemOneApi(engine_provider, **settings)
    app = Starlette(routes=api.routes(), exception_handlers={HTTPException: _http_exception}, middleware=middleware)
    app.router.redirect_slashes = False
    app.state.system_one = api
    return app
