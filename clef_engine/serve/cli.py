"""`clef-engine serve`: the System One API on resident engines, standalone (docs/operations.md says how to run it).

The models load, each checked first against the memory free on its device, before the server listens: once /health
answers, requests are answered. On SIGINT or SIGTERM it stops in order (see OrderlyServer); its big-body worker
processes end with it however it ends (see admission.die_with_parent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import signal
import sys
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import environment
from ..calibrated import load_calibrations
from ..errors import ClefError
from .responses import default_allowed_hosts
from .server import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_TIMEOUT, _public_model_name, create_app

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5
DEFAULT_SHUTDOWN_GRACE = 5.0
ANSWER_SECONDS = 5.0  # after the grace, for the 503s to be written before uvicorn cuts connections


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the Jev / System One HTTP API from a resident model",
        description="Serve POST /v1/systemone, GET /v1/models, GET /health and GET /metrics from one resident model.")
    parser.add_argument("--model", required=True, action="append",
                        help="release folder, Hugging Face repo id, or System One endpoint URL; repeat to serve "
                             "several models (the first is the default)")
    parser.add_argument("--revision", default=None, help="revision of a Hugging Face repo id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="name of an environment variable holding the API key; clients then must send "
                             "'Authorization: Bearer <key>'")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on CUDA)")
    parser.add_argument("--allow-slow-kernels", action="store_true", default=None,
                        help="on CUDA, start even without the fast kernels (or set CLEF_ALLOW_SLOW_KERNELS=1)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="largest request body accepted, in MiB (default %(default)s)")
    parser.add_argument("--max-tokens-per-request", type=int, default=None, metavar="N",
                        help="most tokens one request may buy; a request's x_max_length can lower it, never raise it; "
                             "larger requests get 413 before any work (default: the engine's token budget)")
    parser.add_argument("--allowed-host", action="append", default=None, metavar="HOST",
                        help="a Host header name this server answers (repeatable; '*' for any); other hosts get 421 "
                             "(default: the --host address, localhost, 127.0.0.1 and [::1]; any when bound to "
                             "0.0.0.0 or ::)")
    parser.add_argument("--max-queued-records", type=int, default=None, metavar="N",
                        help="bound of the engine's GPU queue; past it requests get 429 (default: the engine's)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT, metavar="S",
                        help="longest wait for a body to arrive, and for the model to answer a request; past it the "
                             "client gets 408 or 503 deadline_exceeded (default %(default)s)")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                        help="a connection that has not sent a whole request head (line and headers) this long after "
                             "connecting or after its last answer is closed (default %(default)s)")
    parser.add_argument("--keep-alive-timeout", type=int, default=DEFAULT_KEEP_ALIVE_TIMEOUT, metavar="S",
                        help="an idle keep-alive connection is closed after this many seconds (default %(default)s)")
    parser.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, metavar="S",
                        help="on SIGINT or SIGTERM, how long requests in flight may take to finish; those still "
                             "unanswered then get 503 shutting_down (default %(default)s)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="send CORS headers for this origin (repeatable; '*' for any). Default: no CORS headers, "
                             "so web pages elsewhere cannot read answers")
    parser.add_argument("--calibrations", default=None, metavar="FILE",
                        help="calibrations a request's \"x_calibration\" may name, as written by `python -m "
                             "clef_workbench calibrate --export FILE` (default: none)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(run=run_serve)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head. uvicorn arms its keep-alive timer only after an
    answer and any byte disarms it, so a client that connects and sends nothing, or trickles a header a byte at a
    time, would hold its connection (and a file descriptor) forever. Here a timer runs from the connection's start
    and from each answer until a whole request line and headers have arrived; when it fires, the connection closes.
    """

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request head has arrived
            self._disarm_head_timer()
        self._refuse_impossible_chunk()

    def _refuse_impossible_chunk(self) -> None:
        """A chunked body announcing one chunk larger than the body limit can never be accepted: answer 413 now and
        close, instead of waiting for bytes the client may never send (h11 keeps the announced size, privately)."""
        pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
        if not isinstance(pending, int) or pending <= self.max_body_bytes or self.transport.is_closing():
            return
        if self.conn.our_state is not h11.SEND_RESPONSE:  # an answer has begun: only closing is left
            self.transport.close()
            return
        body = json.dumps({"detail": {"error_type": "request_too_large",
                                      "message": f"a body chunk of {pending} bytes is larger than this server's "
                                                 f"limit of {self.max_body_bytes} bytes"}}).encode()
        self.transport.write(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection that sent no whole request head in %ss", self.header_timeout)
            self.transport.close()


class OrderlyServer(uvicorn.Server):
    """uvicorn's server, stopping in order on SIGINT or SIGTERM: no new connections, the requests in flight get
    `grace` seconds to finish, then those still unanswered get 503 (`SystemOneApi.stop`), and `run` returns. uvicorn
    alone cancels the requests still running after its timeout (their clients get a bare 500) and then raises the
    signal again, which ends the process before anything of its own is closed."""

    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace = grace

    async def shutdown(self, sockets: list | None = None) -> None:
        app: Any = self.config.app  # the Starlette app `routes` made
        stop = asyncio.get_running_loop().call_later(self.grace, app.state.system_one.stop)
        try:
            await super().shutdown(sockets)
        finally:
            stop.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handled.items():
                signal.signal(sig, handler)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return int(text)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_models(args: argparse.Namespace) -> dict:
    """Every --model, in order: name (as /v1/models lists it) → engine. Raises ClefError."""
    import clef_engine

    from .. import memory
    from ..config import EngineConfig
    from ..engine import load as load_engine
    from ..remote import is_endpoint

    models: dict = {}
    for source in args.model:
        print(f"loading {source} …", file=sys.stderr, flush=True)
        if is_endpoint(source):
            engine = clef_engine.load(source)  # key from CLEF_API_KEY
        else:
            config = EngineConfig.resolve(device=args.device, dtype=args.dtype,
                                          allow_slow_kernels=args.allow_slow_kernels)
            local = [name for name, e in models.items() if not e.info().get("remote")]
            memory.check_fits(source, revision=args.revision, config=config, loaded=local)
            local_engine = load_engine(source, revision=args.revision, config=config)
            if args.max_queued_records is not None:  # after warm-up, which queues more than one record at once
                local_engine.limit_queue(args.max_queued_records)
            engine = local_engine
        name = base = _public_model_name(engine.info())
        count = 2
        while name in models:
            name, count = f"{base}-{count}", count + 1
        models[name] = engine
    return models


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = environment.variable(args.api_key_env) if args.api_key_env is not None else None
    if args.api_key_env is not None and not api_key:
        raise SystemExit(f"--api-key-env {args.api_key_env}: the environment variable {args.api_key_env} is not set "
                         "or empty")
    if not _is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without an API key; anyone who can reach it can use the model",
              file=sys.stderr)
    if not 0 <= args.shutdown_grace < math.inf:  # NaN too
        print("error: --shutdown-grace must be a number of seconds, 0 or more", file=sys.stderr)
        return 2
    if args.max_tokens_per_request is not None and args.max_tokens_per_request < 1:
        print("error: --max-tokens-per-request must be at least 1", file=sys.stderr)
        return 2
    calibrations: dict = {}
    if args.calibrations is not None:
        try:
            calibrations = load_calibrations(args.calibrations)
        except ValueError as exc:
            print(f"error: --calibrations {exc}", file=sys.stderr)
            return 2
    try:
        models = load_models(args)
    except ClefError as exc:  # a missing or broken release, no fast kernels on CUDA, no room: say so, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    allowed_hosts = args.allowed_host or default_allowed_hosts(args.host)
    max_body_bytes = int(args.max_body_mb * 2**20)
    app = create_app(models, api_key=api_key, max_body_bytes=max_body_bytes,
                     request_timeout=args.request_timeout, max_tokens_per_request=args.max_tokens_per_request,
                     cors_origins=args.cors_origin, allowed_hosts=allowed_hosts,
                     calibrations=lambda: calibrations)
    if calibrations:
        print(f"calibrations: {', '.join(calibrations)}", file=sys.stderr, flush=True)
    print(f"serving {', '.join(models)} on http://{args.host}:{args.port} (default {next(iter(models))}; auth "
          f"{'on' if api_key else 'off'})", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_grace + ANSWER_SECONDS,
                            timeout_keep_alive=args.keep_alive_timeout,
                            http=type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                                      {"header_timeout": args.header_timeout, "max_body_bytes": max_body_bytes}))
    try:
        OrderlyServer(config, args.shutdown_grace).run()
    finally:
        for engine in models.values():  # a local engine's worker must be out of torch before the interpreter ends
            engine.close(wait=True)
    return 0
