"""Clef engine: load a Clef / Clef-Flash release, keep it resident, and decide System One requests."""

from typing import Any

from . import engine as _engine
from .config import EngineConfig
from .engine import Engine
from .errors import BusyError, ClefError, Problem, ReleaseError, RequestError, TokenBudgetError
from .model.encoding import DEFAULT_MAX_LENGTH
from .remote import RemoteEngine, is_endpoint
from .tiny import demo_release, is_demo_release

# Options of engine.load that only mean something for weights loaded here.
_LOCAL_ONLY = ("device", "dtype", "revision", "packed", "allow_slow_kernels", "state_cache_bytes", "config")


def load(source: Any, *, api_key: str | None = None, **options: Any) -> Engine | RemoteEngine:
    """A release (folder, repo id, or 'clef' / 'clef-flash') → a resident `Engine` (options: `engine.load`); an
    http(s) URL of a System One endpoint → a `RemoteEngine` with the same interface (options: `RemoteEngine`, key
    from `api_key` or $CLEF_API_KEY)."""
    if is_endpoint(source):
        given = [name for name in _LOCAL_ONLY if options.get(name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only for a local release, not for the endpoint {source}")
        return RemoteEngine(source, api_key=api_key,
                            **{k: v for k, v in options.items() if k not in _LOCAL_ONLY})
    if api_key is not None:
        raise ValueError(f"api_key is for a System One endpoint (an http(s) URL), not for the release {source}")
    return _engine.load(source, **options)


__all__ = ["Engine", "EngineConfig", "RemoteEngine", "load", "demo_release", "is_demo_release", "DEFAULT_MAX_LENGTH",
           "ClefError", "Problem", "RequestError", "TokenBudgetError", "ReleaseError", "BusyError"]
