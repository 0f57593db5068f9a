"""What the API answers with besides engine results: JSON that can always be delivered, error details bounded in
size whatever the request held, and the Host allow-list."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.websockets import WebSocketClose

from .bodies import MAX_JSON_DEPTH, ApiError, clip

MAX_PROBLEMS = 20  # problems listed in one 422; the rest are counted
MAX_MESSAGE_CHARS = 1000  # of one error message
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # names of this machine every loopback server answers to


def _bounded_problem(problem: dict) -> dict:
    loc = [clip(part) if isinstance(part, str) else part for part in problem.get("loc", [])[:MAX_JSON_DEPTH]]
    return {**problem, "msg": clip(str(problem.get("msg", "")), MAX_MESSAGE_CHARS), "loc": loc}


class SafeJSONResponse(JSONResponse):
    """JSON as UTF-8; if some string cannot be UTF-8 (a surrogate that slipped through), \\u-escape instead of
    failing: an error answer must always be deliverable."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(exc: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = dict(exc.headers)
    if request_id:
        headers["x-typesafe-request-id"] = request_id
    return SafeJSONResponse({"detail": bounded_detail(exc.detail)}, status_code=exc.status, headers=headers)


def bounded_detail(detail: Any) -> Any:
    """An error's detail, bounded in size whatever the request held: the first MAX_PROBLEMS problems of a 422 and a
    count of the rest; messages and the client's strings inside locations clipped."""
    if isinstance(detail, dict):
        return {key: clip(value, MAX_MESSAGE_CHARS) if isinstance(value, str) else value
                for key, value in detail.items()}
    if not isinstance(detail, list):
        return detail
    shown = [_bounded_problem(problem) if isinstance(problem, dict) else problem for problem in detail[:MAX_PROBLEMS]]
    if len(detail) > MAX_PROBLEMS:
        shown.append({"loc": ["body"], "msg": f"and {len(detail) - MAX_PROBLEMS} more problems not listed",
                      "type": "too_many_problems"})
    return shown


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The Host names a server bound to `bind_host` answers by default: that address and this machine's local names;
    bound to every address (0.0.0.0, ::) it cannot know its names, so any."""
    if bind_host in ("0.0.0.0", "::", ""):
        return ["*"]
    named = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
    return list(dict.fromkeys([named.lower(), *LOCAL_HOSTS]))


def host_allow_list(allowed: Collection[str], setting: str = "the server's --allowed-host") -> list[Middleware]:
    """The middleware refusing Host headers not in `allowed` with 421 (none when `allowed` holds '*'), so that a page
    whose name was made to point at this machine (DNS rebinding) cannot reach it; the 421 names `setting`."""
    return [] if "*" in allowed else [Middleware(HostAllowList, allowed=allowed, setting=setting)]


class HostAllowList:
    """ASGI middleware: HTTP requests whose Host header (without its port) is not allowed get 421; WebSocket
    connections are closed (the server answers 403)."""

    def __init__(self, app: Any, allowed: Collection[str], setting: str):
        self.app = app
        self.allowed = {host.lower() for host in allowed}
        self.setting = setting

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        host = Headers(scope=scope).get("host", "") if scope["type"] in ("http", "websocket") else None
        if host is None or (host.rsplit(":", 1)[0] if not host.endswith("]") else host).lower() in self.allowed:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":  # a browser page's live channel
            await WebSocketClose(code=1008)(scope, receive, send)  # policy violation: refused before accepting
        else:
            refusal = SafeJSONResponse({"detail": {
                "error_type": "misdirected_request",
                "message": f"this server does not answer for host {clip(host)!r}; allowed: "
                           f"{', '.join(sorted(self.allowed))} ({self.setting})"}}, status_code=421)
            await refusal(scope, receive, send)
