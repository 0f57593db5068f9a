"""Clef engine: load a Clef / Clef-Flash release, keep it resident, and decide System One requests.

Importing the package (or its contract, `clef_engine.protocol` and `clef_engine.errors`) does not import torch: the
engine's modules load on first use of `Engine`, `EngineConfig`, `RemoteEngine`, `demo_release`, `is_demo_release` or
`load`, so clients, the store and the schema library stay light."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BusyError, ClefError, Problem, ReleaseError, RequestError, TokenBudgetError
from .protocol import DEFAULT_MAX_LENGTH

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import Engine
    from .remote import RemoteEngine
    from .tiny import demo_release, is_demo_release

# Names of the package that live in modules importing torch (or httpx), loaded when first asked for.
_LAZY = {"Engine": ".engine", "EngineConfig": ".config", "RemoteEngine": ".remote", "demo_release": ".tiny",
         "is_demo_release": ".tiny"}

# Options of engine.load that only mean something for weights loaded here.
_LOCAL_ONLY = ("device", "dtype", "revision", "packed", "allow_slow_kernels", "state_cache_bytes", "config")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(source: Any, *, api_key: str | None = None, **options: Any) -> Engine | RemoteEngine:
    """A release (folder, repo id, or 'clef' / 'clef-flash') → a resident `Engine` (options: `engine.load`); an
    http(s) URL of a System One endpoint → a `RemoteEngine` with the same interface (options: `RemoteEngine`, key
    from `api_key` or $CLEF_API_KEY)."""
    from .model import page_cache

    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        page_cache.read_in_background(Path(source))  # the disk works while torch and transformers import
    from . import engine, remote

    if remote.is_endpoint(source):
        given = [name for name in _LOCAL_ONLY if options.get(name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only for a local release, not for the endpoint {source}")
        return remote.RemoteEngine(source, api_key=api_key,
                                   **{k: v for k, v in options.items() if k not in _LOCAL_ONLY})
    if api_key is not None:
        raise ValueError(f"api_key is for a System One endpoint (an http(s) URL), not for the release {source}")
    return engine.load(source, **options)


__all__ = ["Engine", "EngineConfig", "RemoteEngine", "load", "demo_release", "is_demo_release", "DEFAULT_MAX_LENGTH",
           "ClefError", "Problem", "RequestError", "TokenBudgetError", "ReleaseError", "BusyError"]
