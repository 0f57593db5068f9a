"""A schema sweep in a real browser (`streamlit run app.py` on the demo model, Debian's headless Chromium through
Playwright): import a labelled case set through the Case sets page, start a sweep with automatic variants on the
Sweeps page, watch its progress, read the leaderboard, open a flipped case in Decide and in Review, adopt the best
variant and find it in the Schemas page's history."""

from __future__ import annotations

import contextlib
import csv
import re
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api
import pytest

from clef_workbench import sweeps
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import Store
from tests.support import REPO
from tests.support.browser import workbench_page
from tests.support.browser_steps import go_to, new_case_set_from_csv, pick, settle
from tests.support.sweeps import one_question_schema
from workbench_ui import sweeps_view as sv

expect = playwright_api.expect
expect.set_options(timeout=60_000)  # two CPU cores shared with the model and other work: reruns can take seconds

pytestmark = pytest.mark.browser

LONG = 300_000  # ms, a safety limit: the first page load builds the demo model
SWEEP = 1_200_000  # ms: the sweep of every variant over the cases on a busy CPU
SLUG = "ticket-team"
TEAMS = ["billing", "technical_support", "account_security", "sales", "shipping"]
CASES = 5  # a sweep computes a state and every variant per case: a few keep a busy CPU within minutes


def labelled_csv(path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "body", "team"])
        for i in range(CASES):
            writer.writerow([f"Ticket {i}", f"Order {1000 + 37 * i}: parcel {i} late, invoice {i} charged twice.",
                             TEAMS[i % len(TEAMS)]])


def select_row(page, grid, row: int, shows) -> None:
    """Select a table's `row` (0 = the first below the header) by the selection box at its left, as a person does
    (header and rows are 35 px high), until `shows` is visible. Clicked again only when the first click got no
    answer: a second click on a selection that was merely slow deselects the row."""
    for _ in range(3):
        grid.scroll_into_view_if_needed()
        box = grid.bounding_box()
        page.mouse.click(box["x"] + 16, box["y"] + 35 + row * 35 + 17)
        with contextlib.suppress(AssertionError):
            expect(shows).to_be_visible(timeout=30_000)
        settle(page, timeout=LONG)
        if shows.count():
            return
    expect(shows).to_be_visible()


def test_import_sweep_watch_read_open_a_flip_adopt_and_find_it_in_the_history(tmp_path):
    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    db = tmp_path / "workbench.sqlite3"
    one_question_schema(SchemaLibrary(tmp_path / "schemas", history=Store(db)))
    csv_path = tmp_path / "labelled.csv"
    labelled_csv(csv_path)
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas"), "CLEF_MODEL": "demo"}
    with workbench_page(env, tmp_path, width=1500, height=1100) as (page, url):
        journey(page, url, SchemaLibrary(tmp_path / "schemas", history=Store(db)), csv_path)


def journey(page, url: str, library: SchemaLibrary, csv_path: Path) -> None:
    store = library.history
    # -- a labelled case set, imported as a person does
    page.goto(url)
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    go_to(page, "Case sets")
    new_case_set_from_csv(page, "Sweep tickets", SLUG, csv_path, CASES)

    # -- a sweep with two kinds of automatic variants (order diagnostics: tests/test_sweeps.py)
    go_to(page, "Sweeps", timeout=LONG)
    expect(page.get_by_role("heading", name="Schema sweeps")).to_be_visible()
    expect(page.get_by_role("combobox", name="Labelled case set")).to_have_value(f"Sweep tickets ({CASES} cases)")
    expect(page.get_by_role("combobox", name="Schema")).to_have_value(SLUG)
    for kind in ("no_instructions", "no_descriptions"):
        page.get_by_text(sv.AUTO_KIND_LABELS[kind], exact=True).click()
        settle(page)
    planned = sv.planned_variants(sv.library_schema(library, SLUG)[0], ["no_descriptions", "no_instructions"], [])[0]
    expect(page.get_by_text(f"{len(planned)} variants, the base included, on every labelled case.")).to_be_visible()
    page.get_by_role("button", name="Start the sweep").click()
    settle(page)
    expect(page.get_by_text(f"Started sweep #1: {len(planned)} variants.")).to_be_visible(timeout=LONG)

    # -- its progress, followed until it ends: the cases done only grow, and the page draws the leaderboard then
    progress = page.get_by_test_id("stProgress").first  # the fragment's bar, and for a moment its redraw
    seen: list[int] = []
    while True:
        expect(progress).to_be_visible(timeout=LONG)
        with contextlib.suppress(playwright_api.Error):
            text = progress.inner_text(timeout=5_000)
            seen.append(int(re.search(rf"(\d+) / {CASES} cases", text).group(1)))
            if "finished" in text:
                break
        page.wait_for_timeout(500)
    assert seen == sorted(seen) and seen[-1] == CASES, seen
    result = sweeps.load_sweep(store, 1, threshold=0.1)
    assert (result.status, result.done, result.state_prefills) == ("finished", CASES, CASES)

    # -- the leaderboard: the chart and every variant's row with its accuracy and interval (the page redraws itself
    # when the sweep ends: for a moment the leaderboard of the cases done before is still there)
    settle(page, timeout=LONG)
    expect(page.get_by_role("heading", name="Leaderboard")).to_have_count(1, timeout=LONG)
    expect(page.locator('[data-testid="stVegaLiteChart"]')).to_have_count(1)
    board = page.locator('[class*="st-key-sweeps-board"] [data-testid="stDataFrame"]')
    table = sv.leaderboard_table(result)
    for _, row in table.iterrows():
        expect(board).to_contain_text(row["variant"])
        expect(board).to_contain_text(row["accuracy"])

    # -- a click on the variant that flips most lists its flipped cases; one opens in Decide
    flipper = max(result.variants, key=lambda s: len(s.flips_vs_base))
    assert flipper.flips_vs_base, "no variant flips a case: the journey has nothing to open"
    heading = page.get_by_role("heading", name=f"Cases “{flipper.variant.name}” flips")
    select_row(page, board, list(table["variant"]).index(flipper.variant.name), heading)
    flips = sv.flipped_cases(store, result, flipper.variant.name)
    grid = page.locator('[class*="st-key-sweeps-flips"] [data-testid="stDataFrame"]')
    expect(grid).to_contain_text(str(flips.iloc[0]["case"]))
    case_id = int(flips.iloc[0]["case"])
    opener = page.get_by_role("link", name=f"Open case {case_id} in Decide")
    select_row(page, grid, 0, opener)
    with page.expect_popup(timeout=LONG) as opened:
        opener.click(timeout=LONG)
    decide = opened.value
    expect(decide).to_have_title("Decide · Clef Workbench", timeout=LONG)
    expect(decide.get_by_text(f"Case #{case_id} of sweep #1 (Sweep tickets) with the questions of its variant "
                              f"“{flipper.variant.name}”")).to_be_visible(timeout=LONG)
    subject = store.get_case(case_id)["state"]["subject"]
    expect(decide.get_by_role("textbox", name="State", exact=True)).to_have_value(re.compile(re.escape(subject)))
    decide.close()

    # ... and in Review, with the variant's answer: its answers made a run once, which Review opens at this case
    question = str(flips.iloc[0]["question"])
    page.get_by_role("button", name=f"Open case {case_id} in Review").click()
    expect(page).to_have_title("Review · Clef Workbench", timeout=LONG)
    expect(page.get_by_role("heading", name=f"Case {case_id} · {question}")).to_be_visible(timeout=LONG)
    review_run = sweeps.variant_run(store, 1, flipper.variant.name)  # the run the button made, not a second one
    assert [r["id"] for r in store.list_runs()] == [review_run]
    answered = next(r for r in store.list_results(review_run) if r["case_id"] == case_id)
    predicted = answered["response"]["answers"][question]["choice"]
    expect(page.get_by_text(re.compile(rf"Answer {re.escape(predicted)} · confidence"))).to_be_visible()
    go_to(page, "Sweeps", timeout=LONG)
    expect(page.get_by_role("heading", name="Leaderboard")).to_have_count(1, timeout=LONG)

    # -- adopt the best variant: asked first, then the new version is in the library's history
    choices = sv.adoption_choices(result)
    best_variant = next(name for name in choices if name != sv.BEST)
    pick(page, "Version to adopt", choices[best_variant], exact=True)
    page.get_by_role("button", name="Adopt…").click()
    settle(page)
    expect(page.get_by_text(sv.adopt_question(library, result, best_variant))).to_be_visible()
    page.get_by_role("button", name="Yes, adopt it").click()
    settle(page)
    expect(page.get_by_text(f"Adopted as version 2 of {SLUG}.json (Schemas page → History).")).to_be_visible()
    latest = store.list_schema_versions(SLUG)[0]
    assert (latest["number"], latest["action"]) == (2, "adopt")
    assert latest["schema"]["questions"] == sv.adopted_questions(result, best_variant)

    go_to(page, "Schemas", timeout=LONG)
    pick(page, "Schema", f"Ticket team ({SLUG}.json)", exact=True)
    page.get_by_role("tab", name="History").click()
    settle(page)
    history = page.locator('[data-testid="stDataFrame"]', has_text="sweep #1 (Sweep tickets")
    expect(history).to_have_count(1)
    expect(history).to_contain_text("adopt")
