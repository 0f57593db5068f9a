"""Links into the workbench on a fresh server, in real Chromium: the first request the server ever gets is a deep link
(/runs?run=N, before anyone opened /), and it shows the page as the workbench does when one clicks to it — the Runs
page with that run, the tab titled by the page, the workbench's navigation listing each page once by its title and
linking to it — not Streamlit's navigation of the pages/ folder's file names. /review then opens the Review page with
the navigation and the sidebar status even though that page stops early; / opens Decide."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from clef_workbench.store import Store
from tests.support.browser import chromium_page, running_workbench

pytestmark = pytest.mark.browser

PAGE_TITLES = ["Decide", "Schemas", "Case sets", "Runs", "Review", "Compare", "Sweeps"]
PAGE_PATHS = ["decide", "schemas", "cases", "runs", "review", "compare", "sweeps"]  # pages/NAME.py is at /NAME
# Streamlit's names for pages/*.py
FILE_NAMES = ["app", "decide", "schemas", "cases", "runs", "review", "compare", "sweeps"]
SCHEMA = {"name": "routing", "version": "1", "questions": {
    "team": {"type": "single_select", "question": "Which team?", "options": {"billing": "Billing", "tech": "Tech"}}}}
LONG = 120_000  # first render on a busy machine: imports, the demo model's load


def test_deep_links_on_a_fresh_server_open_their_page_in_the_app_navigation(tmp_path):
    db = tmp_path / "workbench.sqlite3"
    store = Store(db)
    set_id = store.create_case_set("Tickets")
    store.add_cases(set_id, [{"state": "My invoice is wrong"}])
    store.create_run(set_id, schema=SCHEMA, model_id="clef-demo")
    linked = store.create_run(set_id, schema=SCHEMA, model_id="clef-demo")  # not the newest: the link, not the default
    store.create_run(set_id, schema=SCHEMA, model_id="clef-demo")  # the newest: what the page shows without a link
    log = tmp_path / "streamlit.log"
    with running_workbench({"CLEF_DB": str(db), "CLEF_MODEL": "demo"}, log_path=log) as url, \
            chromium_page(width=1280, height=720, screenshot=tmp_path / "last.png") as page:
        page.goto(f"{url}/runs?run={linked}")  # the server's very first session
        main = page.get_by_test_id("stMain")
        expect(main.get_by_role("heading", name="Runs", exact=True)).to_be_visible(timeout=LONG)
        expect(main.get_by_role("combobox", name="Run")).to_have_value(re.compile(rf"^#{linked} "), timeout=LONG)
        expect(page).to_have_url(re.compile(rf"/runs\?run={linked}$"))
        expect(main.get_by_text("Not found")).to_have_count(0)

        expect(page).to_have_title("Runs · Clef Workbench")
        sidebar = page.get_by_test_id("stSidebar")
        expect_workbench_navigation(sidebar)
        expect(page.get_by_test_id("stSidebarNav")).to_have_count(0)  # Streamlit's list of the folder's files
        for name in FILE_NAMES:
            expect(sidebar.get_by_text(name, exact=True)).to_have_count(0)

        page.goto(f"{url}/review")
        expect(main.get_by_role("heading", name="Review", exact=True)).to_be_visible(timeout=LONG)
        # The Review page stops early when no run has results; the sidebar's model status is still there.
        expect(sidebar.get_by_text("queue depth")).to_be_visible(timeout=LONG)
        expect(page).to_have_title("Review · Clef Workbench")
        expect_workbench_navigation(sidebar)

        page.goto(url)
        expect(main.get_by_role("heading", name="Decide", exact=True)).to_be_visible(timeout=LONG)
        expect(page).to_have_title("Decide · Clef Workbench")
        expect_workbench_navigation(sidebar)
    server_log = log.read_text(errors="replace")
    assert "Traceback" not in server_log and "Warning" not in server_log, server_log[-3000:]


def expect_workbench_navigation(sidebar) -> None:
    """The sidebar's navigation: one link per page, named by its title, to the page's address."""
    links = sidebar.get_by_test_id("stPageLink-NavLink")
    expect(links).to_have_count(len(PAGE_TITLES), timeout=LONG)
    for index, (title, path) in enumerate(zip(PAGE_TITLES, PAGE_PATHS, strict=True)):
        expect(sidebar.get_by_text(title, exact=True)).to_have_count(1)
        expect(links.nth(index)).to_contain_text(title)
        expect(links.nth(index)).to_have_attribute("href", re.compile(rf"(^|/){path}$"))
