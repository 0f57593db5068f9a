"""The HTTP side of `RemoteEngine` (remote.py), torch-free like it: a deadline per call that every socket operation
of the exchange is held to (httpx's own timeouts are per operation: a server trickling a byte a second would never
trip them), `Retry-After` read as seconds or an HTTP date, an answer read as it streams in and abandoned past a size
cap, and what a server said about an error."""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpcore
import httpx


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header: a number of seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # "inf", "nan" and "-5" parse as floats but say nothing usable
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


_deadline = threading.local()  # `at`: the monotonic time the current thread's HTTP exchange must end by


@contextlib.contextmanager
def call_deadline(at: float) -> Iterator[None]:
    """While active, every socket operation of this thread's HTTP exchange gets what is left until `at`."""
    _deadline.at = at
    try:
        yield
    finally:
        _deadline.at = None


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    """`timeout` capped to what is left of this thread's deadline; `error` once it has passed."""
    at = getattr(_deadline, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the call's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes end by the deadline of the thread using it (see the module docstring)."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname,
                                                      _time_left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(super().connect_tcp(host, port, _time_left(timeout, httpcore.ConnectTimeout),
                                                   local_address, socket_options))


def deadline_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's transport with connections made by _DeadlineBackend (httpx takes no network backend of its own, so
    its connection pool is replaced by one built the same way with that backend)."""
    transport = httpx.HTTPTransport(limits=limits)
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=_DeadlineBackend())
    return transport


def exchange(client: httpx.Client, method: str, path: str, content: bytes | None, max_bytes: int,
             too_large: Callable[[httpx.Response, str], Exception]) -> httpx.Response:
    """One request, its answer read as it streams in and abandoned (the connection closed) past `max_bytes`
    (raising `too_large(response, why)`); returned as a response holding its body."""
    with client.stream(method, path, content=content,
                       headers={"content-type": "application/json"} if content else None) as response:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise too_large(response, f"says it is {int(declared):,} bytes long")
        body = bytearray()
        for chunk in response.iter_bytes():  # decoded: a compressed answer is counted as it inflates
            body += chunk
            if len(body) > max_bytes:
                raise too_large(response, "was still coming")
    # the body is decoded: the copy carries no encoding or length of the wire form
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body), request=response.request)


def detail_of(response: httpx.Response) -> tuple[Any, str]:
    """What the server said about an error: its JSON `detail` (else the start of the body), and that in one line,
    `error_type: message` when it has them."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        said = response.text[:300].strip() or response.reason_phrase
        return said, said
    if isinstance(detail, dict):
        return detail, ": ".join(str(detail[k]) for k in ("error_type", "message") if detail.get(k)) or \
            json.dumps(detail)
    return detail, json.dumps(detail, ensure_ascii=False)[:300]
