"""The HTTP API routes of the workbench process (serve_workbench.py), over its resident models."""

from __future__ import annotations

from pathlib import Path

from clef_engine.calibrated import Calibration, calibrations_from_export
from clef_engine.serve.responses import default_allowed_hosts, host_allow_list
from clef_engine.serve.server import routes
from clef_workbench.calibration import export_document
from clef_workbench.model_loader import shared_manager
from clef_workbench.settings import WorkbenchSettings
from clef_workbench.store import Store

APP_SCRIPT = Path(__file__).resolve().parents[1] / "app.py"


def resident_models() -> dict | None:
    """The resident models, name → engine, the default first; None while none is loaded."""
    return {model.name: model.engine for model in shared_manager().loaded()} or None


def stored_calibrations() -> dict[str, Calibration]:
    return calibrations_from_export(export_document(Store(WorkbenchSettings.from_env().db_path)))


def api_routes() -> list:
    """The HTTP API's routes over the resident engines and stored calibrations, keyed by CLEF_API_KEY."""
    return routes(resident_models, api_key=WorkbenchSettings.from_env().api_key, calibrations=stored_calibrations)


def host_check(bound_to: str) -> list:
    """The standalone server's Host allow-list (421 against DNS rebinding), as middleware for the whole app."""
    return host_allow_list(default_allowed_hosts(bound_to),
                           setting="the workbench's address: --server.address, or CLEF_HOST")
