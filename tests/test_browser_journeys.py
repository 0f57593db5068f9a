"""The journeys where data could be lost or a gold label overwritten, in a real browser (`streamlit run app.py`,
Debian's headless Chromium through Playwright): reload a Decide draft, import a CSV twice, delete a case set and
undo, and open a shared link to a review item whose model answer contradicts the gold label."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api  # noqa: E402
import pytest

from clef_workbench import review
from clef_workbench.store import Store
from tests.browser_harness import launch_chromium, running_workbench

expect = playwright_api.expect
expect.set_options(timeout=30_000)  # two CPU cores shared with the model: reruns can take seconds

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
LONG = 180_000  # ms: the first page load builds/loads the demo model


def settle(page) -> None:
    page.wait_for_timeout(300)
    page.wait_for_function("document.querySelectorAll('[data-stale=\"true\"]').length === 0")


@pytest.fixture(scope="module")
def workbench(tmp_path_factory):
    root = tmp_path_factory.mktemp("journeys")
    shutil.copytree(REPO / "schemas", root / "schemas")
    db = root / "workbench.sqlite3"
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(root / "schemas"), "CLEF_MODEL": "demo"}
    with running_workbench(env, log_path=root / "streamlit.log") as url:
        yield url, db, root


@pytest.fixture
def page(workbench, request):
    _, _, root = workbench
    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(60_000)
        yield page
        page.screenshot(path=str(root / f"{request.node.name}.png"), full_page=True)  # kept for a failure
        browser.close()


def test_reloading_decide_brings_the_draft_back(page, workbench):
    url, _, _ = workbench
    page.goto(url)
    state = page.get_by_role("textbox", name="State", exact=True)
    expect(page.get_by_role("button", name="Run")).to_be_enabled(timeout=LONG)
    expect(page).to_have_title("Decide · Clef Workbench")
    state.fill('{"body": "A draft I must not lose"}')
    state.press("Tab")
    settle(page)
    page.get_by_role("textbox", name="Question 1 id").fill("must_keep")
    page.get_by_role("textbox", name="Question 1 id").press("Tab")
    settle(page)
    expect(page).to_have_url(re.compile(r"[?&]draft="))
    page.reload()
    expect(page.get_by_role("textbox", name="State", exact=True)).to_have_value('{"body": "A draft I must not lose"}',
                                                                  timeout=LONG)
    expect(page.get_by_role("textbox", name="Question 1 id")).to_have_value("must_keep")

    # Ctrl+Enter runs what is on screen
    page.locator("h1", has_text="Decide").click()
    page.keyboard.press("Control+Enter")
    expect(page.locator('[data-testid="stMetricLabel"]', has_text="Answer").first).to_be_visible(timeout=LONG)
    settle(page)
    # every answer is shown whole: no metric value is cut off with an ellipsis
    cut = page.evaluate("""() => [...document.querySelectorAll('[data-testid="stMetric"]')]
        .filter(m => m.querySelector('[data-testid="stMetricLabel"]').innerText.trim() === 'Answer')
        .flatMap(m => [...m.querySelectorAll('[data-testid="stMetricValue"], [data-testid="stMetricValue"] *')])
        .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)""")
    assert cut == [], cut


def test_import_twice_adds_once_and_a_deleted_case_set_comes_back(page, workbench):
    url, db, root = workbench
    csv_path = root / "tickets.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "body", "team"])
        writer.writerows([(f"Ticket {i}", f"My invoice {i} is wrong", "billing") for i in range(4)])
    page.goto(f"{url}/cases")
    expect(page.get_by_role("heading", name="Case sets")).to_be_visible(timeout=LONG)
    expect(page).to_have_title("Case sets · Clef Workbench")
    page.get_by_role("button", name="New case set").click()
    page.get_by_label("Name").fill("Twice")
    page.get_by_role("button", name="Create").click()
    settle(page)
    store = Store(db)
    set_id = next(s["id"] for s in store.list_case_sets() if s["name"] == "Twice")
    for attempt in range(2):
        page.get_by_role("tab", name="Import").click()
        if attempt == 1:  # the same rows again, as from a second export of the same sheet
            expect(page.get_by_text("tickets.csv is imported.", exact=False)).to_be_visible()
            csv_path = csv_path.with_name("tickets-again.csv")
            csv_path.write_bytes((root / "tickets.csv").read_bytes())
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(csv_path))
        settle(page)
        expect(page.get_by_text("map at least one column to the state")).to_be_visible()
        page.get_by_role("button", name=re.compile(r"^Use the 3 column\(s\)")).click()
        settle(page)
        expect(page.get_by_text("Preview — 4 case(s)")).to_be_visible()
        page.get_by_role("button", name="Import 4 cases").click()
        settle(page)
        if attempt == 0:
            expect(page.get_by_text("Imported 4 cases into “Twice”.")).to_be_visible()
            expect(page.get_by_role("combobox", name="Case set")).to_have_value("Twice (4 cases)")
            expect(page.get_by_role("button", name="Import 4 cases")).to_have_count(0)
        else:
            expect(page.get_by_text("Imported 0 cases into “Twice”. 4 were already in it and were skipped.")) \
                .to_be_visible()
    assert store.get_case_set(set_id)["case_count"] == 4

    page.get_by_role("tab", name="Settings").click()
    page.get_by_role("button", name="Delete this case set").click()
    settle(page)
    expect(page.get_by_text("Delete “Twice” and its 4 case(s)? You can undo this.")).to_be_visible()
    assert store.get_case_set(set_id)["case_count"] == 4
    page.get_by_role("button", name="Yes, delete it").click()
    settle(page)
    expect(page.get_by_text("Deleted case set “Twice”.")).to_be_visible()
    assert all(s["id"] != set_id for s in store.list_case_sets())
    page.get_by_role("button", name="Undo").click()
    settle(page)
    expect(page.get_by_text(f"Restored case set #{set_id}.")).to_be_visible()
    expect(page.get_by_role("combobox", name="Case set")).to_have_value("Twice (4 cases)")
    assert store.get_case_set(set_id)["case_count"] == 4


def test_a_shared_link_opens_a_review_item_and_the_gold_label_needs_a_confirmation(page, workbench):
    url, db, _ = workbench
    store = Store(db)
    set_id = store.create_case_set("Gold", schema_name="support-ticket-routing")
    case_ids = store.add_cases(set_id, [{"state": f"Ticket {i}: refund please", "expected": {"team": "billing"}}
                                        for i in range(3)])
    schema = {"name": "routing", "version": "1", "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "sales": None}}}}
    run_id = store.create_run(set_id, schema=schema, model_id="clef")
    store.record_results(run_id, [
        {"case_id": case_id, "latency_ms": 5, "input_tokens": 10,
         "response": {"answers": {"team": {"type": "choice", "choice": "sales",
                                           "probabilities": {"billing": 0.45, "sales": 0.55}}}}}
        for case_id in case_ids])
    store.set_run_status(run_id, "finished")
    review.apply_rules(store, run_id, review.ReviewRules())
    target = case_ids[2]
    item = next(i for i in store.list_review_items(run_id) if i["case_id"] == target)

    page.goto(f"{url}/review?run={run_id}&case={target}&question=team")
    expect(page.locator("h3", has_text=f"Case {target} · team")).to_be_visible(timeout=LONG)
    expect(page).to_have_title("Review · Clef Workbench")
    name = page.get_by_label("Your name (recorded with every action)")
    name.fill("ana")
    name.press("Tab")
    settle(page)
    expect(page.get_by_role("button", name="Accept “sales”")).to_be_enabled()  # the name has reached the server
    page.locator("h1", has_text="Review").click()  # focus outside any input, as a reviewer would
    page.keyboard.press("a")
    settle(page)
    expect(page.get_by_text("The case set's expected answer is “billing”.", exact=False)).to_be_visible()
    assert store.get_review_item(item["id"])["status"] == "open", "one key press never replaces the gold label"
    page.get_by_role("button", name="Keep “billing”").click()
    settle(page)
    assert store.get_review_item(item["id"])["status"] == "open"
    page.get_by_role("button", name="Accept “sales”").click()
    settle(page)
    page.get_by_role("button", name="Yes, label it “sales”").click()
    settle(page)
    expect(page.get_by_text(re.compile(rf"^Accept saved for case {target}"))).to_be_visible()
    saved = store.get_review_item(item["id"])
    assert (saved["status"], saved["label"], saved["reviewer"]) == ("accepted", "sales", "ana")
