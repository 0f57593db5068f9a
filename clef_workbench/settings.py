"""WorkbenchSettings: every environment variable the workbench, its app and its command line read, in one place.

`WorkbenchSettings.from_env()` reads them when called (a test or a launcher may set them just before) and returns a
frozen object; a value that cannot be used raises SettingsError naming the variable and what it takes. The engine's
own knobs (CLEF_DEVICE, CLEF_TOKEN_BUDGET, ...) are `clef_engine/config.py`'s EngineConfig to read.
docs/operations.md says what each variable does and its default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENVIRONMENT = {
    "model": "CLEF_MODEL",
    "revision": "CLEF_REVISION",
    "db_path": "CLEF_DB",
    "schemas_dir": "CLEF_SCHEMAS_DIR",
    "host": "CLEF_HOST",
    "port": "CLEF_PORT",
    "status_refresh_s": "CLEF_STATUS_REFRESH_S",
    "api_key": "CLEF_API_KEY",
    "ray_address": "CLEF_RAY_ADDRESS",
}


class SettingsError(ValueError):
    """An environment variable holds a value the workbench cannot use; the message names it and what it takes."""


@dataclass(frozen=True)
class WorkbenchSettings:
    model: str | None = None
    revision: str | None = None
    db_path: Path = Path("data") / "workbench.sqlite3"
    schemas_dir: Path = Path("schemas")
    host: str = "127.0.0.1"
    port: int = 8501
    status_refresh_s: float = 3.0
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a log line or a traceback's locals
    ray_address: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkbenchSettings:
        """The settings from `env` (default: the process's environment); an unset or blank variable takes its
        default."""
        env = os.environ if env is None else env
        parse: dict[str, Callable[[str], Any]] = {"db_path": Path, "schemas_dir": Path, "port": _port,
                                                  "status_refresh_s": _seconds}
        return cls(**{name: parse.get(name, str)(text) for name, variable in ENVIRONMENT.items()
                      if (text := (env.get(variable) or "").strip())})


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else 0
    if not 1 <= port <= 65_535:
        raise SettingsError(f"{ENVIRONMENT['port']}={text!r}: use a port number from 1 to 65535")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        name = ENVIRONMENT["status_refresh_s"]
        raise SettingsError(f"{name}={text!r}: use a number of seconds above 0, like 3 or 0.5")
    return seconds
