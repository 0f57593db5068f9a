"""Issue 36's journeys of the Decide, Review and Runs pages in one sitting: one workbench on the demo model
(`streamlit run app.py`), Debian's headless Chromium through Playwright, as a new user works:

(1) a record typed first, then a library schema loaded to ask about it: the record stays; the schema's example is
its own button, and Undo brings the record back; (5) blind review shows no gold label, no model answer, no Accept
and no key for it; (7) a run every case of which is refused within a second reads failed in the run selector, the
sidebar and the page alike, a budget the schema alone exceeds is said before the start, and the retry takes the
setting that caused the failure changed."""

from __future__ import annotations

import re
import shutil

import playwright.sync_api as playwright_api
import pytest

from clef_workbench import review
from clef_workbench.review import ReviewRules
from clef_workbench.store import Store
from tests.support import REPO, browser_steps
from tests.support.browser import workbench_page
from tests.support.browser_steps import pick
from tests.support.compare_runs import GRID_ANSWERS, GRID_CASES, GRID_SCHEMA, grid_response

expect = playwright_api.expect
expect.set_options(timeout=60_000)  # two CPU cores shared with the model and other work: reruns can take seconds

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LONG = 300_000  # ms: a model load, or a run on a busy CPU
TYPED = "My own record: invoice INV-88 was charged twice."


def settle(page) -> None:
    browser_steps.settle(page, timeout=LONG)


def test_typed_state_blind_review_and_one_run_status_in_one_sitting(tmp_path):
    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    db = tmp_path / "workbench.sqlite3"
    store = Store(db)
    reviewed_run = recorded_run_with_a_queue(store)
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas"), "CLEF_MODEL": "demo"}
    with workbench_page(env, tmp_path) as (page, url):
        page.goto(url)
        expect(page.get_by_text("fast kernels:")).to_be_visible(timeout=LONG)  # the sidebar lists the loaded model
        loading_a_schema_keeps_the_typed_state(page)
        blind_review_is_blind(page, reviewed_run)
        a_refused_run_reads_failed_everywhere(page, store)


def state_editor(page):
    return page.locator('textarea[aria-label="State"]')


def loading_a_schema_keeps_the_typed_state(page) -> None:
    settle(page)
    state_editor(page).fill(TYPED)
    state_editor(page).press("Tab")  # a text field sends its value on blur
    settle(page)
    pick(page, "Library", "Invoice triage")
    page.get_by_role("button", name="Load", exact=True).click()
    settle(page)
    expect(page.locator('input[aria-label="Question 1 id"]')).not_to_have_value("team")  # invoice-triage's now
    expect(state_editor(page)).to_have_value(TYPED)

    page.get_by_role("button", name="Use this example").click()
    settle(page)
    expect(state_editor(page)).not_to_have_value(TYPED)
    expect(page.get_by_text("Replaced the state with the example")).to_be_visible()
    page.get_by_role("button", name="Undo").click()
    settle(page)
    expect(state_editor(page)).to_have_value(TYPED)


def recorded_run_with_a_queue(store: Store) -> int:
    """A finished run of three labelled cases (answers recorded, no model run) with every answer queued."""
    set_id = store.create_case_set("Grid tickets")
    case_ids = store.add_cases(set_id, [{"state": state, "expected": expected} for state, expected in GRID_CASES])
    run_id = store.create_run(set_id, schema=GRID_SCHEMA, model_id="model-a")
    store.record_results(run_id, [{"case_id": case_id, "response": grid_response(*answer), "latency_ms": 12,
                                   "input_tokens": 10}
                                  for case_id, answer in zip(case_ids, GRID_ANSWERS["model-a"], strict=True)])
    store.set_run_status(run_id, "finished")
    assert review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                         disagree_with_expected=False)) == 6
    return run_id


def blind_review_is_blind(page, run_id: int) -> None:
    browser_steps.go_to(page, "Review", timeout=LONG)
    pick(page, "Run", f"#{run_id} ")
    name = page.get_by_label("Your name (recorded with every action)")
    name.fill("ana")
    name.press("Tab")
    settle(page)
    card = page.locator(".st-key-review-card")
    expect(card.get_by_text("(gold label):")).to_be_visible()  # every case has one: seen while not blind
    expect(card.get_by_role("button", name=re.compile("^Accept"))).to_be_visible()
    page.get_by_text("Blind review: hide the model's answer until I decide").click()
    settle(page)
    expect(card.get_by_text("hidden in blind mode")).to_be_visible()
    expect(card.get_by_text("(gold label):")).to_have_count(0)
    expect(card.get_by_role("button", name=re.compile("^Accept"))).to_have_count(0)
    expect(card.get_by_text(re.compile(r"^Keys: U unknown"))).to_be_visible()
    expect(card.get_by_text("A accept")).to_have_count(0)
    expect(card.get_by_text(re.compile(r"^Answer \*?\*?\w+ · confidence"))).to_have_count(0)
    expect(card.locator('[data-testid="stVegaLiteChart"]')).to_have_count(0)


def a_refused_run_reads_failed_everywhere(page, store: Store) -> None:
    set_id = store.create_case_set("Too long", schema_name="support-ticket-routing")
    store.add_cases(set_id, [{"state": "A very long complaint. " * 400} for _ in range(2)])  # 5,600 tokens each
    browser_steps.go_to(page, "Runs", timeout=LONG)
    main = page.get_by_test_id("stMain")
    if not page.get_by_role("combobox", name="Case set").is_visible():
        main.get_by_text("Start a run", exact=True).click()
        settle(page)
    pick(page, "Case set", "Too long (2 cases)")
    budget = page.get_by_label("max_length (tokens)", exact=True)
    budget.fill("256")
    budget.press("Tab")
    settle(page)
    expect(page.get_by_text(re.compile(r"^The schema alone takes [\d,]+ tokens"))).to_be_visible()
    expect(page.get_by_role("button", name="Start run")).to_be_disabled()
    budget.fill("2048")  # the schema fits; no state does: every case is refused at once
    budget.press("Tab")
    settle(page)
    page.get_by_role("button", name="Start run").click()
    expect(page.get_by_text(re.compile(r"^The run failed: "))).to_be_visible(timeout=LONG)
    progress = page.get_by_text(re.compile(r"\d+ / \d+ cases · \d+ errors · status ")).first
    expect(progress).to_contain_text("status failed")  # never "finished" when every case failed
    settle(page)
    run_id = store.list_runs(set_id)[0]["id"]
    # the same status everywhere, within one refresh of the progress
    expect(page.get_by_role("combobox", name="Run")).to_have_value(re.compile(rf"^#{run_id} .*· failed$"))
    expect(page.get_by_test_id("stSidebar").get_by_text("batch runs: none running")).to_be_visible()

    retry_budget = page.get_by_label("max_length (tokens) in the retry")
    expect(retry_budget).to_have_value("2048")  # the setting that made the cases fail
    retry_budget.fill("8192")
    retry_budget.press("Tab")
    settle(page)
    page.get_by_role("button", name="Retry failed cases (2)").click()
    expect(page.get_by_text("Finished: all 2 cases have answers.")).to_be_visible(timeout=LONG)
    expect(page.get_by_role("combobox", name="Run")).to_have_value(re.compile(rf"^#{run_id} .*· finished$"))
    run = store.get_run(run_id)
    assert (run["status"], run["errors"], run["settings"].max_length) == ("finished", 0, 8192)
