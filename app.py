"""Clef Workbench: `streamlit run app.py`. The shell: navigation over app_pages/, the sidebar model selector and status.

The page folder is not named `pages/`: Streamlit treats a `pages/` folder beside the main script as an old-style
multipage app until st.navigation has run once in the process, so a deep link (/review) on a fresh server would run
the page alone, with a navigation of file names.

Pages that are not there yet (other parts of the workbench) are simply not listed.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from workbench_ui.shell import render_sidebar

PAGES_DIR = Path(__file__).resolve().parent / "app_pages"
# (file, title, icon); the first existing one is the default page.
PAGE_SPECS = [
    ("decide.py", "Decide", ":material/psychology:"),
    ("schemas.py", "Schemas", ":material/schema:"),
    ("cases.py", "Case sets", ":material/dataset:"),
    ("runs.py", "Runs", ":material/speed:"),
    ("review.py", "Review", ":material/fact_check:"),
    ("compare.py", "Compare", ":material/compare_arrows:"),
]

pages = [st.Page(PAGES_DIR / name, title=title, icon=icon, default=(i == 0))
         for i, (name, title, icon) in enumerate(spec for spec in PAGE_SPECS if (PAGES_DIR / spec[0]).is_file())]
navigation = st.navigation(pages)
# the browser tab names the page, so several open tabs of the workbench can be told apart
st.set_page_config(page_title=f"{navigation.title} · Clef Workbench", page_icon=navigation.icon, layout="wide")
render_sidebar()  # before the page, so a page that stops early (st.stop) still has it; its status refreshes itself
navigation.run()
