"""The workbench and the System One HTTP API in one process, sharing one resident engine and its GPU queue.

    streamlit run serve_workbench.py --server.address 127.0.0.1 --server.port 8501
    # or: python serve_workbench.py            (same, via st.App.run; binds CLEF_HOST, default 127.0.0.1)
    # or: uvicorn serve_workbench:app --host 127.0.0.1 --port 8501

The browser UI is at http://127.0.0.1:8501/ and the API beside it: POST /v1/systemone, GET /v1/models, GET /health,
GET /metrics (see clef_engine/serve/server.py). The API answers with whatever model the workbench has resident
(CLEF_MODEL or the sidebar choice) and says 503 / "ready": false while a model loads. Set CLEF_API_KEY to require
`Authorization: Bearer <key>` on /v1/* and /metrics.
"""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from clef_engine.serve.server import routes

HERE = Path(__file__).resolve().parent


def resident_engine():
    """The workbench's engine (None while loading). The first call starts loading the default model."""
    from ui_common import model_manager  # the same st.cache_resource the pages use: one ModelManager per process

    return model_manager().state().engine


app = st.App(HERE / "app.py", routes=routes(resident_engine, api_key=os.environ.get("CLEF_API_KEY") or None))

if __name__ == "__main__":
    app.run(config={"server.address": os.environ.get("CLEF_HOST", "127.0.0.1"),
                    "server.port": int(os.environ.get("CLEF_PORT", "8501"))})
