"""A remote System One endpoint used like a local engine: `RemoteEngine` implements interface.py's `DecisionEngine`
by POSTing to `/v1/systemone` (hosted Jev, a gateway to hosted Clef, another workbench's API).

At most `max_concurrency` requests in flight; a deadline of `timeout` seconds per request that every socket operation
and retry wait is held to (remote_http.py); retries with backoff and jitter on 408/429/5xx and connection failures
(decisions are pure functions of the request, so retrying a POST is safe); answers read up to `max_response_bytes`,
and a 200 whose answers are not what was asked for is a `RemoteError`, never passed on. The API key (`api_key`, else
`CLEF_API_KEY`) lives only in the client's headers: never an attribute, never in `info()`, never in the URL (URLs
end up in run records).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from . import environment
from .environment import API_KEY_ENV
from .errors import BusyError, CancelledError, ClefError, Problem, RequestError, TokenBudgetError
from .interface import Request
from .protocol import OVERFLOW_POLICIES, Question, Response, ValidRequest, data_url, prepare, sniff_content_type
from .remote_http import call_deadline, deadline_transport, detail_of, exchange, retry_after_seconds

SYSTEM_ONE_PATH = "/v1/systemone"
MODELS_PATH = "/v1/models"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})
BUSY_STATUSES = frozenset({429, 529})  # overloaded: after the retries, BusyError (batch jobs back off on it)
MAX_RESPONSE_BYTES = 32 * 1024 * 1024  # a System One answer is kilobytes; this leaves room for huge schemas


class RemoteError(ClefError):
    """The endpoint failed or could not be reached, or answered something that is not a System One response."""

    def __init__(self, message: str, *, endpoint: str, status: int | None = None):
        self.endpoint = endpoint
        self.status = status
        super().__init__(message)


class RemoteAuthError(RemoteError):
    """The endpoint refused the API key (401 missing / malformed, 403 wrong)."""


class RequestTooLargeError(ClefError, ValueError):
    """The request body is larger than the endpoint accepts (413 without a token count)."""


class RemoteRequestError(RequestError):
    """422 from the endpoint: `problems` as the server listed them (locations without the leading "body")."""

    def __init__(self, endpoint: str, problems: list[Problem]):
        super().__init__(problems)
        self.endpoint = endpoint
        self.args = (f"{endpoint} refused the request: {self.args[0]}",)


def parse_endpoint(url: str) -> str:
    """The base URL of a System One endpoint: http(s), a host, no credentials, no trailing `/v1/systemone`.
    Raises ValueError saying what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL of a System One endpoint (e.g. http://127.0.0.1:8000)")
    if parts.username or parts.password:
        raise ValueError(f"put the API key in api_key= or ${API_KEY_ENV}, not in the URL (URLs are recorded "
                         "with every run)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a System One endpoint URL takes no query or fragment")
    path = parts.path.rstrip("/").removesuffix(SYSTEM_ONE_PATH)
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def media_for_wire(request: dict) -> dict:
    """The request with media a local engine takes from Python callers (bytes, file paths) as data URLs, the form
    that travels over HTTP (a server refuses paths: they would read its own disk). Other items are left for the
    endpoint to judge. Raises RequestError for a path that cannot be read."""
    out = dict(request)
    for key in ("images", "videos"):
        if isinstance(request.get(key), list):
            out[key] = [_item_for_wire(item, (key, index)) for index, item in enumerate(request[key])]
    return out


def _item_for_wire(item: Any, loc: tuple[str, int]) -> Any:
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    elif isinstance(item, os.PathLike) or (isinstance(item, str) and not item.startswith("data:")):
        try:
            data = Path(item).read_bytes()
        except OSError as exc:
            raise RequestError([Problem(loc, f"cannot read {item}: {exc.strerror or exc}", "value_error.media")]) \
                from None
    else:
        return item
    # what the bytes are; the endpoint says whether it takes them
    return data_url(sniff_content_type(data) or "application/octet-stream", data)


def _problems(detail: Any) -> list[Problem]:
    """422 detail (pydantic style `[{loc, msg, type}]`) as Problems, locations relative to the request."""
    problems = []
    for item in detail if isinstance(detail, list) else [detail]:
        if not isinstance(item, dict):
            problems.append(Problem((), str(item)))
            continue
        loc = item["loc"] if isinstance(item.get("loc"), list) else []
        message = item.get("msg") or item.get("message") or json.dumps(item, ensure_ascii=False)
        problems.append(Problem(tuple(loc[1:] if loc[:1] == ["body"] else loc), str(message),
                                str(item.get("type") or item.get("error_type") or "value_error")))
    return problems


_ANSWER_KEYS: dict[Any, tuple[str, ...]] = {"noul": ("noul",), "choice": ("choice", "probabilities"),
                                             "score": ("score", "probabilities")}
PROBABILITY_SUM_TOLERANCE = 0.01  # answers are rounded to 4 decimals per option


def _is_probability(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0  # NaN fails too


def _answer_problem(answer: dict) -> str | None:
    """Why an answer's numbers cannot be right (None if they can): a probability that is not a number in [0, 1],
    probabilities that do not sum to 1, a choice that is not one of them, a score that is not a finite number."""
    if answer["type"] == "noul":
        return None if _is_probability(answer["noul"]) else "its noul is not a probability in [0, 1]"
    probabilities = answer["probabilities"]
    if not isinstance(probabilities, dict) or not probabilities:
        return "its probabilities are not an object of option: probability"
    if not all(_is_probability(p) for p in probabilities.values()):
        return "a probability is not a number in [0, 1]"
    if abs(sum(probabilities.values()) - 1.0) > PROBABILITY_SUM_TOLERANCE:
        return "its probabilities do not sum to 1"
    if answer["type"] == "choice" and answer["choice"] not in probabilities:
        return "its choice is not one of its options"
    score = answer.get("score")
    if answer["type"] == "score" and (isinstance(score, bool) or not isinstance(score, (int, float))
                                      or not math.isfinite(score)):
        return "its score is not a finite number"
    return None


def _check_response(body: Any, request: Mapping[str, Any]) -> str | None:
    """Why `body` is not a System One response to `request` (None if it is): every question answered, each answer
    of the question's type with its fields, its numbers probabilities."""
    if not isinstance(body, dict) or not isinstance(body.get("answers"), dict):
        return "no 'answers' object"
    given = request.get("questions")
    questions: dict = given if isinstance(given, dict) else {}
    for question_id, question in questions.items():
        answer = body["answers"].get(question_id)
        kind = question.get("type") if isinstance(question, dict) else None
        if not isinstance(answer, dict):
            return f"no answer for question {question_id!r}"
        if answer.get("type") != kind or any(k not in answer for k in _ANSWER_KEYS.get(kind, ())):
            return f"the answer for question {question_id!r} is not a {kind} answer: {json.dumps(answer)[:200]}"
        problem = _answer_problem(answer) if kind in _ANSWER_KEYS else None
        if problem is not None:
            return f"the answer for question {question_id!r} is wrong: {problem}: {json.dumps(answer)[:200]}"
    return None


def _gather(futures: list[Future], *, return_errors: bool) -> Future:
    """One future for a list of futures: their results in order, or the first exception (the others cancelled);
    with `return_errors`, a future's ClefError takes its place in the results instead."""
    outer: Future = Future()
    outer.set_running_or_notify_cancel()
    lock = threading.RLock()  # cancelling a sibling runs its callback in this thread, under this lock
    remaining = [len(futures)]

    def done(future: Future) -> None:
        with lock:
            if outer.done():
                return
            error = _error_of(future)
            if error is not None and not (return_errors and isinstance(error, ClefError)):
                outer.set_exception(error)
                for other in futures:
                    other.cancel()
                return
            remaining[0] -= 1
            if remaining[0] == 0:
                outer.set_result([_error_of(f) or f.result() for f in futures])

    if not futures:
        outer.set_result([])
    for future in futures:
        future.add_done_callback(done)
    return outer


def _error_of(future: Future) -> BaseException | None:
    return CancelledError("the request was cancelled") if future.cancelled() else future.exception()


class RemoteEngine:
    """A System One endpoint with the interface of a local `Engine` (see the module docstring)."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None, timeout: float = 120.0,
                 connect_timeout: float = 10.0, max_concurrency: int = 8, max_retries: int = 4,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, max_retry_wait_s: float = 120.0,
                 max_response_bytes: int = MAX_RESPONSE_BYTES, check: bool = True):
        """`timeout`: seconds a request may take from its sending to its answer, retries included."""
        self.endpoint = parse_endpoint(url)
        self.model_id = self.endpoint  # what runs record as the model; the key never is part of it
        self.token_budget: int | None = None  # the endpoint decides how much one request may take
        self.model = model
        self.timeout = timeout
        self.max_concurrency = max(1, max_concurrency)
        self.max_retries = max(0, max_retries)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_wait_s = max_retry_wait_s
        self.max_response_bytes = max_response_bytes
        key = api_key if api_key is not None else environment.api_key()
        headers: dict[str, Any] = {"accept": "application/json", "user-agent": "clef-workbench-remote"}
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        self._client = httpx.Client(
            base_url=self.endpoint,
            # UTF-8 bytes: httpx would encode a str header as ASCII and reject a non-ASCII key
            headers={**headers, **({"authorization": b"Bearer " + key.strip().encode()} if key else {})},
            timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)),
            limits=limits,
            transport=deadline_transport(limits),
        )
        self._has_key = bool(key)
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="clef-remote")
        self._closed = threading.Event()  # wakes retry waits on close
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stats = {"requests": 0, "retries": 0, "failures": 0}
        self.models: list[str] | None = None
        self.random_weight_models: set[str] = set()  # the listed models the endpoint says have random weights
        if check:
            try:
                self.check()
            except BaseException:
                self.close()
                raise

    # ---- HTTP -------------------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, content: bytes | None = None) -> tuple[httpx.Response, int]:
        """One HTTP exchange with retries, all within `timeout` seconds from now. Returns the final response (any
        status that is not retried, or a retried one after the last attempt) and the number of attempts; raises
        RemoteError when the endpoint cannot be reached or does not answer by the deadline, and the error for the
        server's answer when the wait it asks for (Retry-After) would pass the deadline."""
        url = self.endpoint + path
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            if self._closed.is_set():
                raise CancelledError(f"the remote engine for {self.endpoint} was closed")
            attempt += 1
            failure: RemoteError | None = None
            try:
                with call_deadline(deadline):
                    response = exchange(self._client, method, path, content, self.max_response_bytes,
                                        self._too_large)
            except httpx.TimeoutException as exc:
                failure = RemoteError(f"{url} did not answer within {self.timeout:g} s "
                                      f"({type(exc).__name__}, {attempt} attempt(s))", endpoint=self.endpoint)
            except RuntimeError:  # httpx refuses a request on a closed client
                if self._closed.is_set():
                    raise CancelledError(f"the remote engine for {self.endpoint} was closed") from None
                raise
            except httpx.TransportError as exc:
                failure = RemoteError(f"could not reach {url}: {exc or type(exc).__name__} ({attempt} attempt(s))",
                                      endpoint=self.endpoint)
            else:
                if response.status_code not in RETRY_STATUSES or attempt > self.max_retries:
                    return response, attempt
            if attempt > self.max_retries and failure is not None:
                raise failure
            asked = retry_after_seconds(response.headers.get("retry-after")) if failure is None else None
            # without a Retry-After: exponential backoff with full jitter, so clients that failed together spread out
            wait = min(self.max_retry_wait_s, asked if asked is not None else
                       random.uniform(0.5, 1.0) * min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            if time.monotonic() + wait >= deadline:  # no time left for another attempt: end now, not at the deadline
                if failure is not None:
                    raise failure
                note = (f"; it asked to be retried after {wait:g} s, past this call's {self.timeout:g} s deadline"
                        if asked is not None else "")
                raise self._error(response, attempt, note=note)
            with self._lock:
                self._stats["retries"] += 1
            if self._closed.wait(wait):
                raise CancelledError(f"the remote engine for {self.endpoint} was closed")

    def _too_large(self, response: httpx.Response, why: str) -> RemoteError:
        return RemoteError(f"{response.request.url} answered {response.status_code} with a body over this client's "
                           f"limit of {self.max_response_bytes:,} bytes ({why}); stopped reading it",
                           endpoint=self.endpoint, status=response.status_code)

    def _error(self, response: httpx.Response, attempts: int, *, note: str = "") -> ClefError:
        """The error for a non-200 answer, named after the endpoint and, for 422, after the fields at fault; `note`
        ends the message of a retried status."""
        status = response.status_code
        url = str(response.request.url)
        detail, said = detail_of(response)
        if status == 422:
            return RemoteRequestError(url, _problems(detail))
        if status in (401, 403):
            hint = (f"pass api_key= or set ${API_KEY_ENV}" if not self._has_key
                    else f"check the key in api_key= or ${API_KEY_ENV}")
            return RemoteAuthError(f"{url} refused the API key ({status} {said}); {hint}", endpoint=self.endpoint,
                                   status=status)
        if status == 404:
            return RemoteError(f"{url} does not exist (404 {said}); is {self.endpoint} a System One endpoint?",
                               endpoint=self.endpoint, status=status)
        if status == 413:
            if isinstance(detail, dict) and isinstance(detail.get("over_by"), int):
                return TokenBudgetError(f"{url}: {detail.get('message') or said}", over_by=detail["over_by"],
                                        part=str(detail.get("part") or "state"),
                                        token_counts=detail.get("token_counts") or {},
                                        max_length=int(detail.get("max_length") or 0))
            return RequestTooLargeError(f"{url} refused the request as too large (413 {said})")
        if status in BUSY_STATUSES:
            return BusyError(f"{url} is overloaded ({status} {said}) after {attempts} attempt(s){note}")
        return RemoteError(f"{url} answered {status} {said} after {attempts} attempt(s){note}",
                           endpoint=self.endpoint, status=status)

    def check(self) -> list[str] | None:
        """Reach the endpoint and check the key (GET /v1/models). Returns the model names it lists, None when it
        has no listing (404/405). Raises RemoteAuthError / RemoteError."""
        response, attempts = self._send("GET", MODELS_PATH)
        if response.status_code in (404, 405):
            self.models = None
            return None
        if response.status_code != 200:
            raise self._error(response, attempts)
        try:
            listed = [m for m in response.json()["models"] if isinstance(m, dict) and isinstance(m.get("name"), str)]
            self.models = [m["name"] for m in listed]
            self.random_weight_models = {m["name"] for m in listed if m.get("random_weights") is True}
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{self.endpoint}{MODELS_PATH} answered something that is not a model list: "
                              f"{response.text[:200]!r}", endpoint=self.endpoint, status=200) from None
        return self.models

    # ---- requests ---------------------------------------------------------------------------------------------

    def validate(self, request: Any, *, max_length: int | None = None, overflow: str | None = None,
                 questions: tuple[Question, ...] | None = None) -> ValidRequest:
        """As protocol.prepare, with no network: the endpoint may refuse more (a RemoteRequestError)."""
        return prepare(request, max_length=max_length, overflow=overflow, questions=questions)

    def _body(self, request: Any, max_length: int | None, overflow: str) -> bytes:
        if isinstance(request, ValidRequest):  # validated where it entered; it carries its own budget
            request, max_length, overflow = dict(request.request), request.max_length, request.overflow
        if not isinstance(request, dict):
            raise RequestError([Problem((), "the request must be a JSON object", "type_error.dict")])
        body = media_for_wire(request)
        if self.model is not None:  # this object stands for one model
            body["model"] = self.model
        if max_length is not None:  # sent only when not the default: other servers may not know these fields
            body["x_max_length"] = max_length
        if overflow != "refuse":
            body["x_overflow"] = overflow
        try:
            return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as exc:  # NaN, bytes, numpy arrays, file paths as Path objects …
            raise RequestError([Problem((), f"the request cannot be sent as JSON: {exc}", "type_error.json")]) \
                from None

    def _decide_one(self, request: Request, body: bytes, started: float) -> Response:
        # the model is named by the caller (as the local engine does): the HTTP server names its models
        asked, model = (request.request, request.model) if isinstance(request, ValidRequest) else (request, None)
        with self._lock:
            self._stats["requests"] += 1
        try:
            response, attempts = self._send("POST", SYSTEM_ONE_PATH, content=body)
            if response.status_code != 200:
                raise self._error(response, attempts)
            try:
                answer = response.json()
            except ValueError:
                answer = None
            problem = _check_response(answer, asked) if answer is not None else "not JSON"
            if problem is not None:
                raise RemoteError(f"{self.endpoint}{SYSTEM_ONE_PATH} answered 200 with a malformed response "
                                  f"({problem}): {response.text[:200]!r}", endpoint=self.endpoint, status=200)
        except BaseException:
            with self._lock:
                self._stats["failures"] += 1
            raise
        if "x_latency_ms" in answer:
            answer["x_server_latency_ms"] = answer["x_latency_ms"]
        answer["x_latency_ms"] = round((time.perf_counter() - started) * 1000, 2)
        answer["x_attempts"] = attempts
        if model is not None:
            answer["model"] = model
        return answer

    def submit(self, requests: Sequence[Request], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse", errors: str = "raise") -> Future:
        """As Engine.submit, up to `max_concurrency` requests at once; one that cannot be sent as JSON is a
        RequestError here (in its slot with errors="return"). `priority` is not sent: the endpoint schedules."""
        if errors not in ("raise", "return"):
            raise ValueError(f"errors must be 'raise' or 'return', not {errors!r}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
        if self._closed.is_set():
            raise CancelledError(f"the remote engine for {self.endpoint} is closed")
        started = time.perf_counter()
        bodies: list[bytes | ClefError] = []
        for request in requests:
            try:
                bodies.append(self._body(request, max_length, overflow))
            except ClefError as error:
                if errors == "raise":
                    raise
                bodies.append(error)
        futures = []
        for request, body in zip(requests, bodies):
            future: Future = Future()
            if isinstance(body, ClefError):
                future.set_exception(body)
            else:
                with self._lock:
                    self._in_flight += 1
                future = self._pool.submit(self._decide_one, request, body, started)
                future.add_done_callback(self._finished)
            futures.append(future)
        return _gather(futures, return_errors=errors == "return")

    def _finished(self, _future: Future) -> None:
        with self._lock:
            self._in_flight -= 1

    def decide(self, request: Request, *, max_length: int | None = None, overflow: str = "refuse") -> Response:
        return self.submit([request], max_length=max_length, overflow=overflow).result()[0]

    def decide_many(self, requests: Sequence[Request], *, max_length: int | None = None, overflow: str = "refuse",
                    priority: str = "bulk", errors: str = "raise") -> list[Any]:
        return self.submit(requests, priority=priority, max_length=max_length, overflow=overflow,
                           errors=errors).result()

    def count_tokens(self, request: Any, *, max_length: int | None = None) -> None:
        return None

    def sample_video_frames(self, video: bytes) -> None:
        return None

    def abandon(self, future: Future) -> None:
        """Its caller gives up on `future`: cancelled if it has not been sent (a request sent is answered anyway)."""
        future.cancel()

    # ---- status -----------------------------------------------------------------------------------------------

    def queue_position(self, future: Future) -> int | None:
        return None

    def queue_depth(self) -> int:
        """Requests submitted through this object and not answered yet (sent or waiting for a connection)."""
        with self._lock:
            return self._in_flight

    def info(self) -> dict:
        """What the workbench shows about the model; no network call (pages poll it). Holds no key."""
        with self._lock:
            stats = dict(self._stats)
        return {
            "model": self.model or (self.models[0] if self.models else self.endpoint),
            "remote": True,
            "endpoint": self.endpoint,
            "models": self.models,
            "revision": None,
            "device": "remote",
            "device_name": urlsplit(self.endpoint).netloc,
            "dtype": None,
            "demo": False,
            "random_weights": self.random_weights(),
            "authenticated": self._has_key,
            "queue_depth": self.queue_depth(),
            "max_concurrency": self.max_concurrency,
            "timeout_s": self.timeout,
            "max_retries": self.max_retries,
            "client": stats,
        }

    def random_weights(self) -> bool:
        """Whether the model this object's requests reach has random weights, as the endpoint's /v1/models says: the
        one named by `model` when it is listed, else the endpoint's default (listed first)."""
        models = self.models or []
        target = self.model if self.model in models else (models[0] if models else None)
        return target in self.random_weight_models

    def close(self, wait: bool = False) -> None:
        """Stop: queued requests are cancelled, waits between retries end, connections close; `wait`: once the
        requests under way have ended."""
        self._closed.set()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def is_endpoint(source: Any) -> bool:
    """True when a model source names a remote endpoint (an http or https URL) rather than a release."""
    return isinstance(source, str) and source.strip().lower().startswith(("http://", "https://"))

