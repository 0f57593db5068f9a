"""The workbench and the System One HTTP API in one process, sharing one resident engine:
`streamlit run serve_workbench.py`, or `python serve_workbench.py` (binds CLEF_HOST). Like the standalone server,
it answers only a Host naming its address or this machine (421 otherwise)."""

from __future__ import annotations

import streamlit as st
from streamlit import config

from clef_workbench.settings import WorkbenchSettings
from workbench_ui.server import APP_SCRIPT, api_routes, host_check

settings = WorkbenchSettings.from_env()
# `streamlit run` has set its options before it imports this file; run as a script, `app.run` below binds CLEF_HOST
bound_to = settings.host if __name__ == "__main__" else config.get_option("server.address") or ""
app = st.App(APP_SCRIPT, routes=api_routes(), middleware=host_check(bound_to))

if __name__ == "__main__":
    app.run(config={"server.address": settings.host, "server.port": settings.port})
