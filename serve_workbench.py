"""The workbench and the System One HTTP API in one process, sharing one resident engine and its GPU queue.

    streamlit run serve_workbench.py --server.address 127.0.0.1 --server.port 8501
    # or: python serve_workbench.py            (same, via st.App.run; binds CLEF_HOST, default 127.0.0.1)
    # or: uvicorn serve_workbench:app --host 127.0.0.1 --port 8501

The browser UI is at http://127.0.0.1:8501/ and the API beside it: POST /v1/systemone, GET /v1/models, GET /health,
GET /metrics (see clef_engine/serve/server.py and workbench_ui/server.py). This file is only the launcher: Streamlit
looks for the `st.App(...)` assignment in the script it runs.

Like the standalone server, it answers only requests whose Host header names the address it is bound to or this
machine (localhost, 127.0.0.1, [::1]); others get 421, so that a web page whose own name was made to point at this
machine (DNS rebinding) cannot use it. Bound to every address (0.0.0.0), it answers any Host.
"""

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
