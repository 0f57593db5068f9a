"""The environment variables the engine's library entry points fall back on (the remote key, the demo release's
folder, `serve --api-key-env NAME`), read here and in config.py only; torch-free, so a remote client needs no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

API_KEY_ENV = "CLEF_API_KEY"  # the key `clef_engine.load("http://…")` sends when given no api_key
CACHE_DIR_ENV = "CLEF_CACHE_DIR"  # where demo_release() builds the demo release (~/.cache/clef-workbench if unset)


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "clef-workbench")


def variable(name: str) -> str:
    """The value of the environment variable `name`, stripped; "" when it is unset."""
    return os.environ.get(name, "").strip()
