"""In a real browser (`streamlit run app.py` on the demo model, Debian's headless Chromium through Playwright): a
link to something missing says "not found" and leaves the URL as it was; a run whose every case failed reads as
failed at the top of its page, exports its errors, and its failed cases can be run again into the same run."""

from __future__ import annotations

import csv
import shutil
from concurrent.futures import Future
from pathlib import Path

import playwright.sync_api as playwright_api
import pytest

from clef_engine.errors import ClefError
from clef_workbench.jobs import JobRunner
from clef_workbench.store import RunSettings, Store
from tests.support import REPO
from tests.support.browser import chromium_page, running_workbench
from tests.support.browser_steps import delete_row, settle

expect = playwright_api.expect
expect.set_options(timeout=60_000)  # two CPU cores shared with the model and other work: reruns can take seconds

pytestmark = pytest.mark.browser

LONG = 300_000  # ms, a safety limit: the first page load loads the demo model
SCHEMA = {"name": "routing", "version": "1", "questions": {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "sales": None}}}}


def no_traceback(page) -> None:
    settle(page)
    expect(page.get_by_test_id("stException")).to_have_count(0)


@pytest.fixture(scope="module")
def workbench(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs-truth")
    shutil.copytree(REPO / "schemas", root / "schemas")
    db = root / "workbench.sqlite3"
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(root / "schemas"), "CLEF_MODEL": "demo"}
    with running_workbench(env, log_path=root / "streamlit.log") as url:
        yield url, db, root


@pytest.fixture
def page(workbench, request):
    _, _, root = workbench
    with chromium_page(screenshot=root / f"{request.node.name}.png", accept_downloads=True) as page:
        yield page


class StoppedEndpoint:
    """An engine whose every request fails, as a remote endpoint that stopped mid-run answers."""

    def validate(self, request: dict, **budget) -> dict:
        return request

    def submit(self, requests: list[dict], **options) -> Future:
        raise ClefError("could not reach http://127.0.0.1:9/v1/systemone: connection refused")

    def decide_many(self, requests: list[dict], **options) -> list[dict]:
        raise ClefError("could not reach http://127.0.0.1:9/v1/systemone: connection refused")


def failed_run(db: Path, name: str, cases: int) -> tuple[Store, int]:
    store = Store(db)
    set_id = store.create_case_set(name)
    store.add_cases(set_id, [{"state": f"Ticket {i}: my invoice is wrong", "expected": {"team": "billing"}}
                             for i in range(cases)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="clef-demo", settings=RunSettings(chunk_size=4))
    runner = JobRunner(store)
    runner.start(run_id, StoppedEndpoint())
    assert runner.wait(run_id, timeout=60)
    return store, run_id


def test_links_to_missing_things_say_not_found_list_what_exists_and_keep_the_url(page, workbench):
    url, db, _ = workbench
    store, run_id = failed_run(db, "Links", 2)
    for path, asked in (("/runs?run=999", "run 999"), ("/cases?set=999", "case set 999"),
                        ("/compare?runs=999,1000", "run(s) #999, #1000"),
                        ("/?schema=no-such-schema", "the schema “no-such-schema”")):
        page.goto(url + path)
        expect(page.get_by_text(f"Not found: the link asks for {asked}", exact=False)).to_be_visible(timeout=LONG)
        no_traceback(page)
        # the URL still names what was asked for: Decide adds its draft, and "/" is Decide's address, /decide
        shown = path.replace("/?", "/decide?", 1) if path.startswith("/?") else path
        assert page.url.startswith(url + shown), page.url
    # a link into the review of a run whose every case failed: nothing there can be reviewed, and the page says why
    page.goto(url + f"/review?run={run_id}&case=999&question=team")
    expect(page.get_by_text(f"No run has answers to review: every case failed in run #{run_id}", exact=False)) \
        .to_be_visible(timeout=LONG)
    no_traceback(page)
    page.goto(url + "/runs?run=999")
    expect(page.get_by_text("Not found: the link asks for run 999", exact=False)).to_be_visible(timeout=LONG)
    expect(page.get_by_role("link", name=f"#{run_id} ")).to_be_visible()  # what exists, as links
    page.get_by_role("button", name=f"Open #{run_id}").click()  # the person asks for another: only then
    settle(page)
    expect(page.get_by_text("The run failed: every case failed (2 of 2)", exact=False)).to_be_visible()
    assert page.url.endswith(f"/runs?run={run_id}")


def test_a_failed_run_reads_failed_at_the_top_exports_its_errors_and_retries_its_failed_cases(page, workbench,
                                                                                             tmp_path):
    url, db, _ = workbench
    store, run_id = failed_run(db, "Stopped endpoint", 6)
    page.goto(f"{url}/runs?run={run_id}")
    failed = page.get_by_text("The run failed: every case failed (6 of 6); the first error: ClefError: could not "
                              "reach http://127.0.0.1:9", exact=False)
    expect(failed).to_be_in_viewport(timeout=LONG)  # at the top, not in an expander at the bottom
    expect(page.get_by_text("status failed", exact=False)).to_be_visible()
    expect(page.get_by_text("No case has an answer: all 6 failed", exact=False)).to_be_visible()
    no_traceback(page)

    with page.expect_download() as download:
        page.get_by_role("button", name="Results CSV", exact=False).click()
    saved = tmp_path / "export.csv"
    download.value.save_as(saved)
    with saved.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and all(row["error"].startswith("ClefError: could not reach") for row in rows)

    page.get_by_role("button", name="Retry failed cases (6)").click()
    expect(page.get_by_text("Finished: all 6 cases have answers.")).to_be_visible(timeout=LONG)
    no_traceback(page)
    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["errors"]) == ("finished", 6, 0)


def grid_rows(grid) -> int:
    """Data rows of an editable table as the browser holds it: the grid's accessible row count, less its header and
    the row that adds a row."""
    return int(grid.locator('[role="grid"]').first.get_attribute("aria-rowcount")) - 2


def test_a_refused_case_deletion_puts_the_row_back_in_the_table(page, workbench):
    url, db, _ = workbench
    store = Store(db)
    set_id = store.create_case_set("Rows with a run")
    case_ids = store.add_cases(set_id, [{"state": f"Row {i}"} for i in range(3)])
    store.create_run(set_id, schema=SCHEMA, model_id="clef-demo")
    page.goto(f"{url}/cases?set={set_id}")
    grid = page.locator('[class*="st-key-cases-editor"] [data-testid="stDataFrame"]')
    expect(grid).to_be_visible(timeout=LONG)
    settle(page)
    assert grid_rows(grid) == 3
    delete_row(page, grid, 1)
    assert grid_rows(grid) == 2
    page.get_by_role("button", name="Save changes").click()
    settle(page)
    expect(page.get_by_text(f"Nothing was changed: case {case_ids[1]} cannot be deleted", exact=False)).to_be_visible()
    assert [c["id"] for c in store.list_cases(set_id)] == case_ids
    grid = page.locator('[class*="st-key-cases-editor"] [data-testid="stDataFrame"]')
    # the refused row is back in the table (the message can land a moment before the table is drawn again)
    expect(grid.locator('[role="grid"]').first).to_have_attribute("aria-rowcount", str(3 + 2))
    no_traceback(page)
