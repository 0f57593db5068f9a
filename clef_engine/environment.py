"""The environment variables the engine's library entry points fall back on, read here and nowhere else outside
config.py (whose EngineConfig holds the engine's own knobs and imports torch; this module does not, so a remote
client reads its key without it).

- CLEF_API_KEY: the bearer key `clef_engine.load("http://…")` sends when it is given no `api_key`.
- CLEF_CACHE_DIR: where `clef_engine.demo_release()` builds the demo release; ~/.cache/clef-workbench if unset.
- `clef-engine serve --api-key-env NAME`: the variable NAME holds the key the server requires.
"""

from __future__ import annotations

import os
from pathlib import Path

API_KEY_ENV = "CLEF_API_KEY"
CACHE_DIR_ENV = "CLEF_CACHE_DIR"


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "clef-workbench")


def variable(name: str) -> str:
    """The value of the environment variable `name`, stripped; "" when it is unset."""
    return os.environ.get(name, "").strip()
