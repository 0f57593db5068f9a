"""The workbench and the System One HTTP API in one process, sharing one resident engine and its GPU queue.

`serve_workbench.py` at the repository root is the launcher (Streamlit finds its `st.App` there); this module
gives it the API routes. The API answers with whatever model the workbench has resident (CLEF_MODEL or the
sidebar choice) and says 503 / "ready": false while a model loads. With CLEF_API_KEY set, /v1/* and /metrics
require `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import os
from pathlib import Path

from clef_engine.serve.server import routes
from clef_workbench.model_loader import shared_manager

APP_SCRIPT = Path(__file__).resolve().parents[1] / "app.py"


def resident_engine():
    """The process's engine (None while loading), from the same ModelManager the pages use. The first call
    starts loading the default model."""
    return shared_manager().state().engine


def api_routes(api_key: str | None = None) -> list:
    """The HTTP API's routes over the resident engine; api_key defaults to CLEF_API_KEY."""
    return routes(resident_engine, api_key=api_key if api_key is not None else os.environ.get("CLEF_API_KEY") or None)
