"""The Streamlit side of the workbench: the shell the pages share (`shell`), the Decide page's view-model
(`decide_model`, plain Python, unit-tested), and the combined workbench + HTTP API server (`server`). `app.py` and
`pages/` at the repository root only render and call these and the UI-free services in `clef_workbench`."""
