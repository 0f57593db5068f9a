"""Engines and endpoints that fail on purpose, for the tests of what a run says when its model does: the tiny engine
refusing chosen cases (`FailingEngine`), and a System One endpoint refusing every decision (`RefusingEndpoint`,
served in a thread by `serve`)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from clef_engine.errors import ClefError


class FailingEngine:
    """The tiny engine, except that every request whose state contains one of `failing` raises a ClefError (as a
    stopped endpoint or an engine fault does). `failing` can be emptied to let a retry through."""

    def __init__(self, engine, failing: set[str]):
        self.engine = engine
        self.failing = failing

    def validate(self, request: dict, **budget) -> dict:
        self.engine.validate(request, **budget)
        return request  # the plain dict, so that submit can look at its state (the engine validates it there)

    def _refuse(self, requests: list[dict]) -> None:
        for request in requests:
            if any(word in str(request["state"]) for word in self.failing):
                raise ClefError(f"engine fault on {request['state']!r}")

    def submit(self, requests: list[dict], **options) -> Future:
        if options.get("errors") != "return":
            self._refuse(requests)
            return self.engine.submit(requests, **options)
        # as the engines do with errors="return": a failing request's slot holds its error, the others their answers
        failing = {i for i, request in enumerate(requests) if any(w in str(request["state"]) for w in self.failing)}
        good = [request for i, request in enumerate(requests) if i not in failing]
        outcomes: Future = Future()

        def merge(answered: Future) -> None:
            answers = iter(answered.result())
            outcomes.set_result([ClefError(f"engine fault on {requests[i]['state']!r}") if i in failing
                                 else next(answers) for i in range(len(requests))])

        if good:
            self.engine.submit(good, **options).add_done_callback(merge)
        else:
            outcomes.set_result([ClefError(f"engine fault on {r['state']!r}") for r in requests])
        return outcomes

    def decide_many(self, requests: list[dict], **options) -> list[dict]:
        self._refuse(requests)
        return self.engine.decide_many(requests, **options)


class RefusingEndpoint(BaseHTTPRequestHandler):
    """A System One endpoint that lists a model and then refuses every decision (422), as a misconfigured gateway
    does: the run reaches it, and every case fails."""

    def do_GET(self):  # noqa: N802 — http.server's name
        self._reply(200, {"models": [{"name": "jev"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._reply(422, {"detail": [{"loc": ["body", "state"], "msg": "unsupported state", "type": "value_error"}]})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def serve(handler) -> ThreadingHTTPServer:
    """`handler` answering on a free 127.0.0.1 port in a daemon thread (stop it with `.shutdown()`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
