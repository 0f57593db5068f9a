"""Clef Workbench: `streamlit run app.py`. The default page ("/"): it opens the Decide page.

Navigation is Streamlit's public pages-directory mode: each `pages/NAME.py` is a page at /NAME (so links such as
/runs?run=2 and /review open their page on any server, fresh or not), and each page draws the workbench's shell
itself (`workbench_ui.shell.render_shell`: the browser tab's title, the navigation by title, the sidebar's model
selector and status). Streamlit's own navigation of file names is hidden (`client.showSidebarNavigation = false` in
.streamlit/config.toml). Why this mode: it is Streamlit's documented behaviour for a `pages/` folder, and `pages/`
is the product's layout.
"""

from __future__ import annotations

import streamlit as st

# keeps the link's parameters (/?run=3&case=9 opens that case in Decide)
st.switch_page("pages/decide.py", query_params=st.query_params.to_dict())
