"""Schema history and Compare in a real browser (`streamlit run app.py`, Debian's headless Chromium through
Playwright): edit a schema twice (three versions, the diff shown), run it on a case set with the demo model at two
versions in one action each, see agreement, flips and intervals on the Compare page, and click a cell of the matrix
to open its case."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api
import pytest

from clef_workbench import casesets
from clef_workbench.store import Store
from tests.browser_harness import launch_chromium, running_workbench

expect = playwright_api.expect
expect.set_options(timeout=60_000)  # two CPU cores shared with the model and other work: reruns can take seconds

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
LONG = 300_000  # ms, a safety limit: the first page load builds/loads the demo model
SLUG = "support-ticket-routing"


def settle(page) -> None:
    page.wait_for_timeout(300)
    page.wait_for_function("document.querySelectorAll('[data-stale=\"true\"]').length === 0")


def choose(page, label: str, option: str) -> None:
    page.get_by_role("combobox", name=label).click()
    page.get_by_role("option", name=option, exact=True).click()
    settle(page)


def test_edit_twice_run_two_versions_compare_and_open_a_case(tmp_path):
    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    db = tmp_path / "workbench.sqlite3"
    store = Store(db)
    set_id = casesets.load_example_case_sets(store, tmp_path / "schemas")[SLUG]
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas"), "CLEF_MODEL": "demo"}
    with running_workbench(env, log_path=tmp_path / "streamlit.log") as url, \
            playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(60_000)
        try:
            journey(page, url, store, set_id)
        finally:
            page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)  # kept for a failure
            browser.close()


def journey(page, url: str, store: Store, set_id: int) -> None:
    # -- edit the schema twice: three versions, the diff between the last two shown
    page.goto(f"{url}/schemas")
    expect(page.get_by_role("heading", name="Schema library")).to_be_visible(timeout=LONG)
    choose(page, "Schema", f"Support ticket routing ({SLUG}.json)")
    for wording in ("Which team should own this ticket?", "Which single team should own this ticket?"):
        page.get_by_role("tab", name="Edit JSON").click()
        editor = page.get_by_label("Schema file")
        expect(editor).to_have_count(1)  # the editor of the schema shown before is gone
        expect(editor).not_to_have_value("")  # a text area can mount blank for a moment
        data = json.loads(editor.input_value())
        data["questions"]["team"]["instructions"] = wording
        editor.fill(json.dumps(data, indent=2))
        editor.press("Tab")  # the text area sends its value when it loses focus
        settle(page)
        page.get_by_role("button", name="Save changes").click()
        settle(page)
    expect(page.get_by_text(f"Saved {SLUG}.json (version 3).")).to_be_visible()
    page.get_by_role("tab", name="History").click()
    expect(page.get_by_text("Changes from version 2 to version 3")).to_be_visible()
    expect(page.get_by_text('~ question "team", instructions: Which {+single+} team should own this ticket?')) \
        .to_be_visible()
    assert [v["number"] for v in store.list_schema_versions(SLUG)] == [3, 2, 1]

    # -- one action per version: run it on the example cases with the demo model
    page.goto(f"{url}/compare")
    expect(page.get_by_role("heading", name="Compare runs")).to_be_visible(timeout=LONG)
    expect(page.get_by_text("Comparing needs two runs of one case set")).to_be_visible()
    choose(page, "Case set", "Example: Support ticket routing (12 cases)")
    choose(page, "Schema", SLUG)
    for version in ("v2", "v3 (current)"):
        choose(page, "Version", version)
        page.get_by_role("button", name="Run this schema on this case set with these models").click()
        settle(page)
        expect(page.get_by_text("Started run(s)")).to_be_visible()
    runs = store.list_runs(set_id)
    assert [r["schema_version"] for r in runs] == ["3", "2"]
    v2_run, v3_run = runs[1]["id"], runs[0]["id"]

    # -- the comparison: it redraws itself when the runs end
    expect(page.get_by_role("heading", name="Agreement per question")).to_be_visible(timeout=LONG)
    page.wait_for_function("() => !/Run #\\d+: (pending|running)/.test(document.body.innerText)", timeout=LONG)
    settle(page)
    assert all(r["status"] == "finished" and r["done"] == 12 for r in store.list_runs(set_id))
    expect(page.get_by_text("Demo model.", exact=False).first).to_be_visible()
    page.get_by_text("The runs' schemas differ").click()
    expect(page.get_by_text('~ question "team", instructions: Which {+single+} team should own this ticket?')) \
        .to_be_visible()
    page_text = page.inner_text("body")
    assert "Agreement per question" in page_text and "Accuracy, calibration and latency" in page_text
    tables = page.locator('[data-testid="stDataFrame"]')
    # the grids draw on a canvas; their accessible table (text content) holds the cells drawn
    expect(tables.first).to_contain_text("team")  # agreement per question, with its interval
    expect(tables.first).to_contain_text("[")
    metrics = tables.nth(tables.count() - 2)  # the last table is the matrix, the one before the metrics
    expect(metrics).to_contain_text("accuracy")
    expect(metrics).to_contain_text("n=12")

    # -- a click on a cell of the matrix opens its case
    matrix = page.locator('[data-testid="stDataFrame"]').last
    matrix.scroll_into_view_if_needed()
    case_heading = page.get_by_role("heading", name=re.compile(r"^Case \d+$"))
    for row in (2, 3, 4):  # a click while the grid still redraws (after scrolling) can be lost: try the next row
        page.wait_for_timeout(1000)
        box = matrix.bounding_box()
        page.mouse.click(box["x"] + 300, box["y"] + 35 * row + 17)  # a run's answer to the first question
        settle(page)
        try:
            expect(case_heading).to_be_visible(timeout=10_000)
            break
        except AssertionError:
            continue
    expect(case_heading).to_be_visible()
    case_id = int(case_heading.inner_text().split()[-1])
    assert case_id in [c["id"] for c in store.list_cases(set_id)]
    assert f"case={case_id}" in page.url and f"runs={v2_run},{v3_run}" in page.url.replace("%2C", ",")
    # the case as each run answered it: one answer to "team" per run, with its confidence
    expect(page.get_by_text(re.compile(r"^team: \S+ \(\d\.\d{3}\)$"))).to_have_count(2)
