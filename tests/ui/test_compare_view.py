"""The Compare page's view-model: the one action (started for real on the tiny release, or refused with a message),
the selectors' labels and defaults, a link to runs that are gone, and one case as every run answered it."""

from __future__ import annotations

import json

import pandas as pd

from clef_workbench import compare
from clef_workbench.compare import CompareView, ModelChoice
from clef_workbench.jobs import JobRunner
from tests.support.compare_runs import RUN_A, RUN_C
from workbench_ui import compare_view as cv

SLUG = "support-ticket-routing"


def test_the_one_action_says_what_it_still_needs():
    assert cv.missing_for_start([], [], []) == (
        "Needs a case set (Case sets page) and a schema (Schemas page) and a loaded model (sidebar).")
    assert cv.missing_for_start([{"id": 1}], ["triage"], []) == "Needs a loaded model (sidebar)."
    assert cv.missing_for_start([{"id": 1}], ["triage"], ["m"]) is None


def test_the_one_action_starts_a_run_per_model_of_the_saved_version(store, library, tiny_engine):
    library.load(SLUG)  # recorded as version 1
    set_id = store.create_case_set("Tickets", schema_name=SLUG)
    for text in ("I was charged twice for March.", "The app crashes when I open settings."):
        store.add_case(set_id, state=text)
    runner = JobRunner(store)
    tiny = ModelChoice("tiny", "Tiny demo", tiny_engine, True)

    assert cv.start_comparison(store, runner, [tiny], set_id, SLUG, 1, ["not-loaded"]) == (
        [], "Pick at least one loaded model.")
    assert cv.start_comparison(store, runner, [tiny], set_id, SLUG, 9, ["tiny"]) == (
        [], f'Not started: schema "{SLUG}" has no version 9')
    assert store.list_runs() == []

    run_ids, message = cv.start_comparison(store, runner, [tiny], set_id, SLUG, 1, ["tiny"])
    assert message == f"Started run(s) #{run_ids[0]}." and len(run_ids) == 1
    assert runner.wait(run_ids[0], timeout=600)
    run = store.get_run(run_ids[0])
    assert run["settings"].schema_slug == SLUG and run["settings"].overflow == "refuse"
    assert "examples" not in run["schema"]
    assert not cv.is_unfinished(run)
    assert cv.started_run_line(run) == (f"Run [#{run['id']}](/runs?run={run['id']}) · tiny · finished · 2/2 cases")


def test_runs_are_labelled_and_the_newest_two_open_unless_a_link_names_others():
    run = {"id": 12, "model_id": "clef-27b", "schema_name": "Ticket routing", "schema_version": 3,
           "schema_version_id": 5, "status": "finished", "case_set_name": "Tickets", "done": 4, "errors": 0}
    assert cv.run_label(run) == "#12 clef-27b · Ticket routing v3 · finished"
    # the status as every other page says it: a run whose every case failed reads failed (issue 36 point 7)
    assert cv.run_label({**run, "errors": 4}) == "#12 clef-27b · Ticket routing v3 · failed"
    assert cv.run_label({**run, "schema_version_id": None}) == "#12 clef-27b · Ticket routing v3 (unsaved) · finished"
    assert cv.case_set_label([run, run, run]) == "Tickets (3 runs)"
    assert cv.default_runs([], [4, 9, 7]) == [7, 9]
    assert cv.default_runs([9, 4], [4, 9, 7]) == [9, 4]
    assert cv.default_runs([40], [4, 9, 7]) == [7, 9]  # a linked run of another set opens the newest two here


def test_a_link_to_runs_that_are_gone_names_them_and_lists_the_runs_there_are():
    all_runs = {3: {"case_set_name": "Tickets", "model_id": "clef-27b"},
                5: {"case_set_name": "Claims", "model_id": "remote"}}
    assert cv.missing_runs([3, 5], all_runs) is None
    missing = cv.missing_runs([3, 8, 9], all_runs)
    assert missing.message.startswith("Not found: the link asks for run(s) #8, #9, which does not exist here")
    assert "There are 2: pick one below." in missing.message
    assert missing.links == [("#3 Tickets · clef-27b", "?runs=3"), ("#5 Claims · remote", "?runs=5")]


def test_an_opened_case_shows_each_runs_answers_charts_latency_or_error():
    view = CompareView([RUN_A, RUN_C], *(pd.DataFrame(),) * 5, {}, [])

    shown = cv.case_shown(view, 104)
    assert shown.state == "case 104" and shown.expected == "Expected: spam = true, tone = b"
    run_a, run_c = shown.runs
    assert (run_a.title, run_a.error, run_a.latency) == (RUN_A.label, None, "compute 40.0 ms")
    assert [a.text for a in run_a.answers] == ["`spam`: **false** (0.600)", "`tone`: **b** (0.900)"]
    tone = run_a.answers[1].chart
    assert tone[["option", "probability", "chosen"]].to_dict("records") == [
        {"option": "a", "probability": 0.1, "chosen": False}, {"option": "b", "probability": 0.9, "chosen": True}]
    assert (run_c.error, run_c.answers, run_c.latency) == ("TokenBudgetError: too long", [], None)

    assert cv.case_shown(view, 999) is None
    assert cv.no_result_message(999) == "Case 999 has no result in these runs."
    assert json.dumps(cv.START_SETTINGS.to_json())  # the settings a run records are plain JSON
    assert compare.case_detail(view, 101) is not None


def test_the_one_action_proposes_the_case_sets_own_schema():
    """Issue 36 point 9: the schema the set was made for, not the library's first."""
    slugs = ["invoice-triage", "support-ticket-routing"]
    assert cv.proposed_schema({"schema_name": "support-ticket-routing"}, slugs) == "support-ticket-routing"
    assert cv.proposed_schema({"schema_name": None}, slugs) == "invoice-triage"
    assert cv.proposed_schema({"schema_name": "deleted-since"}, slugs) == "invoice-triage"


def test_the_matrix_summarises_each_case_and_its_cells_are_wide_enough_for_their_answers():
    """Issue 36 point 9: the state column shows the case (not its first key, nor its id), every answer column is
    as wide as its longest "answer (confidence)", and the filtered grid is a widget of its own."""
    record = {"ticket_id": "T-4", "body": "I was charged twice for the same order and want one refunded. " * 4,
              "subject": "Double charge", "plan": "Business"}
    summary = compare.state_summary(record)
    assert "T-4" not in summary and "Double charge" in summary and "Business" in summary
    assert summary.startswith("I was charged twice") and len(summary) <= compare.STATE_LINE_CHARS
    assert compare.state_summary("\n  First line\nsecond") == "First line"
    assert compare.state_summary(["a", 1]) == '["a", 1]'

    matrix = pd.DataFrame({"team · #12": ["shipping (0.83)", None], "team · expected": ["billing", "shipping"]})
    widths = cv.matrix_widths(matrix, {"team · #12": "run 12", "team · expected": "expected"})
    assert widths["team · #12"] >= cv.CELL_PADDING_PX + cv.CELL_CHAR_PX * len("shipping (0.83)")
    assert widths["team · expected"] >= cv.CELL_PADDING_PX + cv.CELL_CHAR_PX * len("team · expected")
    assert cv.matrix_key(True) != cv.matrix_key(False)
