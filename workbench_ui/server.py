"""The workbench and the System One HTTP API in one process, sharing one resident engine and its GPU queue.

`serve_workbench.py` at the repository root is the launcher (Streamlit finds its `st.App` there); this module
gives it the API routes. The API answers with the models the workbench has resident (CLEF_MODEL and the sidebar's
additions; a request's "model" picks one, any other name the default) and says 503 / "ready": false while none is.
With CLEF_API_KEY set, /v1/* and /metrics require `Authorization: Bearer <key>`.
"""

from __future__ import annotations

from pathlib import Path

from clef_engine.serve.server import routes
from clef_workbench.model_loader import shared_manager
from clef_workbench.settings import WorkbenchSettings

APP_SCRIPT = Path(__file__).resolve().parents[1] / "app.py"


def resident_models() -> dict | None:
    """The process's resident models, name → engine, the default first (None while none is loaded), from the same
    ModelManager the pages use: a request's "model" picks one. The first call starts loading the default model."""
    return {model.name: model.engine for model in shared_manager().loaded()} or None


def api_routes(api_key: str | None = None) -> list:
    """The HTTP API's routes over the resident engine; api_key defaults to CLEF_API_KEY."""
    return routes(resident_models, api_key=api_key if api_key is not None else WorkbenchSettings.from_env().api_key)
