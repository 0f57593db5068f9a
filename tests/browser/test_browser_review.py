"""Case sets, runs and review in a real browser: `streamlit run app.py` as a subprocess with a temporary database,
Debian's headless Chromium through Playwright. Imports a CSV case set with a column mapping, runs it on the demo
model, sees the latency stats, reviews two items with the keyboard, and exports results and reviewed labels."""

from __future__ import annotations

import csv
import io
import re
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api  # noqa: E402
import pytest

from clef_workbench import review
from clef_workbench.store import Store
from tests.support import REPO
from tests.support.browser import chromium_page, running_workbench
from tests.support.browser_steps import go_to, new_case_set_from_csv, press_shortcut, settle

expect = playwright_api.expect

# No skip when chromium is missing: launch_chromium fails with how to install it (scripts/setup.sh --test does).
pytestmark = pytest.mark.browser

LONG = 300_000  # ms, a safety limit: first load builds the demo model; a CPU run of 6 tickets takes a while

TICKETS = [
    # subject, body, team, priority, mood, churn, human
    ("Charged twice", "You billed my card twice this month. Refund one now or we leave.", "billing", 2, "angry",
     "yes", "yes"),
    ("API down", "All API calls return 503 since 09:40, our warehouse is stopped.", "technical_support", 3,
     "neutral", "no", "yes"),
    ("CSV export", "Hi! How can I export my orders to CSV? Thanks!", "technical_support", 0, "positive", "no", "no"),
    ("Hacked?", "Someone in another country logged into my account and I am locked out.", "account_security", 3,
     "frustrated", "no", "yes"),
    ("More seats", "Please send pricing for 200 more seats on an annual contract.", "sales", 1, "neutral", "no",
     "yes"),
    ("Out of office", "I am away until Monday with limited access to e-mail.", "none_of_these", 0, "unclear", "no",
     "no"),
]


def card_title(page) -> str:
    return page.locator("h3", has_text=re.compile(r"^Case \d+ · ")).first.inner_text()


@pytest.fixture
def workbench(tmp_path: Path):
    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    db = tmp_path / "workbench.sqlite3"
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas"), "CLEF_MODEL": "demo"}
    with running_workbench(env, log_path=tmp_path / "streamlit.log") as url:
        yield url, db


@pytest.fixture
def page(workbench):
    with chromium_page(width=1500, height=1100, accept_downloads=True) as page:
        yield page


def test_import_run_review_with_keyboard_and_export(page, workbench, tmp_path: Path):
    url, db = workbench
    csv_path = tmp_path / "tickets.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "body", "team", "priority", "customer_mood", "churn_threat", "needs_human_agent"])
        writer.writerows(TICKETS)

    # -- case set: create, import the CSV with expected columns mapped by name -----------------------------------
    page.goto(url)
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    go_to(page, "Case sets")
    expect(page.get_by_text("No case sets yet")).to_be_visible(timeout=LONG)
    # the answer columns map to their questions by name; only the columns chosen there become the state
    new_case_set_from_csv(page, "Browser tickets", "support-ticket-routing", csv_path, 6)
    store = Store(db)
    case_set = store.list_case_sets()[0]
    cases = store.list_cases(case_set["id"])
    assert case_set["name"] == "Browser tickets" and len(cases) == 6
    assert cases[0]["state"] == {"subject": "Charged twice", "body": TICKETS[0][1]}
    assert cases[0]["expected"] == {"team": "billing", "priority": 2, "customer_mood": "angry", "churn_threat": True,
                                    "needs_human_agent": True}

    # -- run it and see the latency stats ---------------------------------------------------------------------
    go_to(page, "Runs")
    expect(page.get_by_role("button", name="Start run")).to_be_visible(timeout=LONG)
    expect(page.get_by_role("combobox", name="Case set")).to_have_value("Browser tickets (6 cases)")
    page.get_by_role("button", name="Start run").click()
    samples = page.locator('[data-testid="stMetric"]', has_text="samples")
    expect(samples).to_contain_text("6", timeout=LONG)
    for label in ("p50 compute per record", "p95 compute per record", "p99 compute per record",
                  "max compute per record", "p50 queue wait"):
        expect(page.locator('[data-testid="stMetric"]', has_text=label)).to_contain_text(re.compile(r"[\d,.]+ m?s"))
    expect(page.get_by_text(re.compile(r"^Window .* UTC"))).to_be_visible()
    expect(page.locator('[data-testid="stMetric"]', has_text="records/s")).to_contain_text("rec/s")
    with page.expect_download() as download_info:
        page.get_by_role("button", name=re.compile("^Results CSV")).click()
    results = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert len(results) == 6 * 5
    assert {"p:billing", "p:true", "p:3"} <= set(results[0])
    run_id = store.list_runs()[0]["id"]
    assert store.get_run(run_id)["status"] == "finished"

    # -- review: queue with the default rules, then two items with the keyboard -------------------------------
    go_to(page, "Review")
    name = page.get_by_label("Your name (recorded with every action)")
    expect(name).to_be_visible(timeout=LONG)
    name.fill("ana")
    name.press("Tab")
    settle(page)
    add = page.get_by_role("button", name=re.compile(r"^Add \d+ item\(s\) to the queue$"))
    queued = int(re.search(r"\d+", add.inner_text()).group())
    assert queued >= 2, "the demo model's random answers disagree with several expected answers"
    add.click()
    settle(page)
    expect(page.locator(".st-key-review-card")).to_be_visible()
    worst = store.list_review_items(run_id)
    settle(page)
    first_title = card_title(page)
    assert first_title.startswith(f"Case {worst[0]['case_id']} · {worst[0]['question_id']}")

    asked = page.get_by_text("The case set's expected answer is", exact=False)
    press_shortcut(page, "a", lambda: bool(store.list_review_actions(run_id=run_id)) or asked.is_visible())
    gold = store.get_case(worst[0]["case_id"])["expected"].get(worst[0]["question_id"])
    if review.gold_conflict(worst[0], gold, "accept") is not None:  # the key press alone never replaces it
        expect(asked).to_be_visible(timeout=LONG)
        page.get_by_role("button", name=f"Yes, label it “{worst[0]['predicted']}”").click()
    expect(page.get_by_text(re.compile(r"^Accept saved for case"))).to_be_visible()
    expect(page.locator("h3", has_text=re.compile(r"^Case \d+ · "))).not_to_have_text(first_title)
    settle(page)
    second_title = card_title(page)
    press_shortcut(page, "u", lambda: len(store.list_review_actions(run_id=run_id)) >= 2)
    expect(page.get_by_text(re.compile(r"^Unknown saved for case"))).to_be_visible(timeout=LONG)
    log = store.list_review_actions(run_id=run_id)
    assert [(a["reviewer"], a["action"]) for a in log] == [("ana", "accept"), ("ana", "unknown")]
    assert log[0]["item_id"] == worst[0]["id"] and log[0]["after"]["label"] == worst[0]["predicted"] or \
        worst[0]["question_type"] != "choice"
    assert second_title != first_title
    expect(page.get_by_text(re.compile(rf"^2 of {queued} reviewed"))).to_be_visible()

    # -- export the reviewed labels and a golden set ----------------------------------------------------------
    settle(page)  # the whole rerun is drawn, including the export button with both labels
    page.get_by_text("Export reviewed labels").click()
    with page.expect_download() as download_info:
        page.get_by_role("button", name="Reviewed labels (CSV)").click()
    labels = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert sorted(row["status"] for row in labels) == ["accepted", "unknown"]
    assert all(row["reviewer"] == "ana" for row in labels)
    page.get_by_role("button", name="Export as a new case set").click()
    expect(page.get_by_text(re.compile(r"^Created case set #\d+ “Golden: Browser tickets"))).to_be_visible()
    page.screenshot(path=str(tmp_path / "review.png"), full_page=True)
