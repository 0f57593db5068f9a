"""Clef Workbench: `streamlit run app.py`. Each `pages/NAME.py` is a page at /NAME; the root opens Decide."""

from __future__ import annotations

import streamlit as st

# keeps the link's parameters (/?run=3&case=9 opens that case in Decide)
st.switch_page("pages/decide.py", query_params=st.query_params.to_dict())
