"""The workbench and the System One HTTP API in one process, sharing one resident engine and its GPU queue.

`serve_workbench.py` at the repository root is the launcher (Streamlit finds its `st.App` there); this module
gives it the API routes. The API answers with the models the workbench has resident (CLEF_MODEL and the sidebar's
additions; a request's "model" picks one, any other name the default) and says 503 / "ready": false while none is.
With CLEF_API_KEY set, /v1/* and /metrics require `Authorization: Bearer <key>`. A request's "x_calibration" may
name any calibration in the workbench's store (CLEF_DB), read when a request names one, so one fitted on the Runs
page is served at once.
"""

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
    """The pages' resident models, name → engine, the default first (None while none is loaded). The first call
    starts loading the default model."""
    return {model.name: model.engine for model in shared_manager().loaded()} or None


def stored_calibrations() -> dict[str, Calibration]:
    """Every calibration in the workbench's store (CLEF_DB, as the pages open it), by name."""
    return calibrations_from_export(export_document(Store(WorkbenchSettings.from_env().db_path)))


def api_routes(api_key: str | None = None) -> list:
    """The HTTP API's routes over the resident engines and the store's calibrations; api_key defaults to
    CLEF_API_KEY."""
    return routes(resident_models, api_key=api_key if api_key is not None else WorkbenchSettings.from_env().api_key,
                  calibrations=stored_calibrations)


def host_check(bound_to: str) -> list:
    """The standalone server's Host allow-list for a workbench bound to `bound_to` (every address: any host), as
    middleware for the whole app, UI and API: a web page whose own name was made to point at this machine (DNS
    rebinding) gets 421."""
    return host_allow_list(default_allowed_hosts(bound_to),
                           setting="the workbench's address: --server.address, or CLEF_HOST")
