"""Clef Workbench: `streamlit run app.py`. The default page ("/") opens the Decide page.

Streamlit's pages-directory mode, its documented behaviour for a `pages/` folder: each `pages/NAME.py` is a page at
/NAME (so links such as /runs?run=2 open their page on any server, fresh or not) and draws the workbench's shell
itself (`workbench_ui.shell.render_shell`); Streamlit's own navigation of file names is hidden (.streamlit/config.toml).
"""

from __future__ import annotations

import streamlit as st

# keeps the link's parameters (/?run=3&case=9 opens that case in Decide)
st.switch_page("pages/decide.py", query_params=st.query_params.to_dict())
