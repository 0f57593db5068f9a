"""The Case sets, Runs and Review pages through Streamlit's AppTest, on the real demo model and a real SQLite file.
(File upload and the table editor are not drivable in AppTest; the browser test covers CSV import.)"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df
from streamlit.testing.v1 import AppTest

from clef_workbench import casesets, review
from clef_workbench.review import ReviewRules
from clef_workbench.store import RunSettings, Store
from tests.support.apptest import (
    APP,
    TIMEOUT,
    button,
    case_uploader,
    new_case_set,
    no_exceptions,
    open_page,
    texts,
    wait_for_run,
)
from tests.support.media import mp4_bytes
from workbench_ui import shell, state_input
from workbench_ui.cases_view import NOT_MAPPED

pytestmark = pytest.mark.slow  # the Runs and Review pages run real batch runs: minutes in all

def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_cases_page_creates_loads_examples_renames_and_guards_delete(workbench):
    at = open_page("pages/cases.py")
    assert "No case sets yet" in texts(at)
    at.text_input(key="cases.new_name").input("Escalations")
    at.selectbox(key="cases.new_schema").select("support-ticket-routing")
    button(at, "Create").click()
    at.run()
    no_exceptions(at)
    store = Store(workbench / "workbench.sqlite3")
    created = store.list_case_sets()[0]
    assert (created["name"], created["schema_name"]) == ("Escalations", "support-ticket-routing")
    assert at.selectbox(key="cases.selected").value == created["id"]

    button(at, "Load the example case sets").click()
    at.run()
    no_exceptions(at)
    assert "Example case sets ready: 4." in texts(at)
    names = {s["name"]: s for s in store.list_case_sets()}
    assert names["Example: Support ticket routing"]["case_count"] == 12
    # pick the example set: its export buttons are there and its settings form shows its schema
    example_id = names["Example: Support ticket routing"]["id"]
    at.selectbox(key="cases.selected").select(example_id)
    at.run()
    no_exceptions(at)
    assert "Schema: **support-ticket-routing** · 12 cases" in texts(at)
    assert len(at.get("download_button")) == 2

    # a case set with runs cannot be deleted: the page says why and nothing is lost
    store.create_run(example_id, schema={"name": "x", "questions": {"q": {"type": "noul"}}}, model_id="demo")
    button(at, "Delete this case set").click()
    at.run()
    assert "“Example: Support ticket routing” cannot be deleted: it has 1 run. Delete it on the Runs page first." \
        in texts(at)
    assert store.get_case_set(example_id)["case_count"] == 12


def gate_engine_chunks(monkeypatch) -> threading.Semaphore:
    """Hold each chunk a batch run hands the engine until the test lets one through, so the page is checked while the
    run is surely still going, however fast this machine runs the tiny model."""
    import clef_engine

    let_through = threading.Semaphore(0)
    submit = clef_engine.Engine.submit

    def gated_submit(self, requests, **options):
        if options.get("priority") == "bulk":
            assert let_through.acquire(timeout=TIMEOUT), "the test never let this chunk through"
        return submit(self, requests, **options)

    monkeypatch.setattr(clef_engine.Engine, "submit", gated_submit)
    return let_through


def test_runs_page_runs_cancels_resumes_and_shows_stats(workbench, monkeypatch):
    chunks = gate_engine_chunks(monkeypatch)
    store = Store(workbench / "workbench.sqlite3")
    loaded = casesets.load_example_case_sets(store, workbench / "schemas")
    set_id = loaded["support-ticket-routing"]
    at = open_page("pages/runs.py")
    at.selectbox(key="runs.start.case_set").select(set_id)
    at.run()
    assert at.selectbox(key=f"runs.start.schema.{set_id}").value == "support-ticket-routing"
    at.number_input(key="runs.start.chunk").set_value(2)
    button(at, "Start run").click()
    at.run()
    no_exceptions(at)
    run_id = store.list_runs()[0]["id"]
    runner = shell.get_job_runner()
    assert runner.is_running(run_id)
    assert store.get_run(run_id)["settings"].chunk_size == 2

    # the job belongs to the process, not the page: switch away and back, it is still going
    at.switch_page("pages/review.py")
    at.run()
    at.switch_page("pages/runs.py")
    at.run()
    no_exceptions(at)
    chunks.release(2)  # two chunks of 2 cases (one answered, one queued behind it), then the run waits on the next
    deadline = time.monotonic() + TIMEOUT
    while store.get_run(run_id)["done"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    at.run()
    assert "**Running**" in texts(at) and "ETA" in texts(at)
    done = store.get_run(run_id)["done"]
    assert f"The run is still going: the files hold the {done} case(s) answered so far." in texts(at)  # the export
    button(at, "Cancel").click()
    at.run()
    at.run()  # the button reruns its fragment to redraw itself, which AppTest does not follow: draw the page again
    # the chunk in flight is held: the run cannot have stopped yet, and the page says that it is stopping
    assert runner.is_running(run_id)
    assert button(at, "Cancelling…").disabled and "cancelling after the batch in flight" in texts(at)
    chunks.release(100)  # from here on the engine answers freely: the chunks in flight end, the cancel takes effect
    wait_for_run(run_id)
    at.run()
    no_exceptions(at)
    run = store.get_run(run_id)
    assert run["status"] == "cancelled" and run["done"] < 12
    resume = button(at, "Resume (", startswith=True)
    assert resume.label == f"Resume ({12 - run['done']} cases left)"
    resume.click()
    at.run()
    wait_for_run(run_id)
    at.run()
    no_exceptions(at)
    assert store.get_run(run_id)["status"] == "finished"
    assert at.selectbox(key="runs.selected").format_func(run_id).endswith(" · 12/12 · finished"), "the picker's count"

    assert metric(at, "samples") == "12"
    assert "still going" not in texts(at)
    for label in ("p50 compute per record", "p95 compute per record", "p99 compute per record",
                  "max compute per record", "p50 queue wait"):
        assert metric(at, label).endswith((" ms", " s"))
    assert metric(at, "records/s").endswith("rec/s") and metric(at, "tokens per record") != "–"
    assert "Window " in texts(at) and "linear interpolation" in texts(at)
    frames = [df.value for df in at.dataframe]
    accuracy = next(f for f in frames if "n_expected" in f.columns)
    assert set(accuracy["question_id"]) == {"team", "priority", "customer_mood", "churn_threat", "needs_human_agent"}
    assert (accuracy["n_expected"] == 12).all()
    assert any("ece" in f.columns for f in frames)
    assert len(at.get("vega_lite_chart")) >= 5  # latency, accuracy, confusion ×2, reliability
    assert len(at.get("download_button")) == 2

    # a second run of the same set links to the Compare page with both runs chosen
    button(at, "Start run").click()
    at.run()
    second = store.list_runs()[0]["id"]
    wait_for_run(second)
    at.run()
    no_exceptions(at)
    assert at.selectbox(key="runs.selected").value == second
    assert f"(/compare?runs={run_id},{second})" in texts(at)


def _finished_run(workbench: Path) -> tuple[Store, int]:
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo",
                              settings=RunSettings(chunk_size=6, schema_slug="support-ticket-routing"))
    shell.get_job_runner().start(run_id, shell.get_engine(show_errors=False))
    wait_for_run(run_id)
    return store, run_id


def test_review_page_queue_actions_conflict_undo_and_golden_set(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    store, run_id = _finished_run(workbench)
    at = open_page("pages/review.py")
    assert "The queue of this run is empty" in texts(at)
    # preview before applying: margin only, then only the team question
    at.checkbox(key=f"review.rules.unknown.{run_id}").uncheck()
    at.checkbox(key=f"review.rules.disagree.{run_id}").uncheck()
    at.slider(key=f"review.rules.margin.{run_id}").set_value(1.0)
    at.multiselect(key=f"review.rules.questions.{run_id}").set_value(["team"])
    at.run()
    no_exceptions(at)
    assert "These rules select **12 item(s)** in 12 case(s); **12 new** to the queue." in texts(at)
    assert store.list_review_items(run_id) == []
    button(at, "Add 12 item(s) to the queue").click()
    at.run()
    no_exceptions(at)
    queue = store.list_review_items(run_id)
    assert len(queue) == 12 and [i["margin"] for i in queue] == sorted(i["margin"] for i in queue)

    # no name, no action
    assert button(at, f"Accept “{queue[0]['predicted']}”").disabled
    assert "Enter your name above to review." in texts(at)
    at.text_input(key="review.reviewer").input("ana")
    at.run()
    assert f"### Case {queue[0]['case_id']} · `team` (choice)" in texts(at)  # worst first
    assert f"**Why queued:** {queue[0]['reason']}" in texts(at)
    # accepting an answer that contradicts the gold label asks first; Accept is then not the highlighted default
    gold = store.get_case(queue[0]["case_id"])["expected"]["team"]
    accept = button(at, f"Accept “{queue[0]['predicted']}”")
    assert (accept.proto.type == "primary") == (gold == queue[0]["predicted"])
    at.text_input(key=f"review.comment.{queue[0]['id']}").input("checked the body twice")
    accept.click()
    at.run()
    no_exceptions(at)
    if gold != queue[0]["predicted"]:
        assert f"The case set's expected answer is “{gold}”" in texts(at)
        assert store.get_review_item(queue[0]["id"])["status"] == "open", "nothing written before the confirmation"
        button(at, f"Yes, label it “{queue[0]['predicted']}”").click()
        at.run()
        no_exceptions(at)
    assert store.get_review_item(queue[0]["id"])["status"] == "accepted"
    assert store.list_review_actions(item_id=queue[0]["id"])[0]["comment"] == "checked the body twice"
    assert f"### Case {queue[1]['case_id']}" in texts(at)  # advanced to the next worst

    # correct to an option that is not the model's answer (confirming if it is not the gold label either)
    other = next(o for o in queue[1]["distribution"] if o != queue[1]["predicted"])
    button(at, other).click()
    at.run()
    if store.get_case(queue[1]["case_id"])["expected"]["team"] != other:
        button(at, f"Yes, label it “{other}”").click()
        at.run()
    assert store.get_review_item(queue[1]["id"])["label"] == other

    # another session acts on the item this one shows: our click is refused, not applied twice
    shown = store.get_review_item(queue[2]["id"])
    store.apply_review_action(shown["id"], reviewer="ben", action="skip", expected_version=shown["version"])
    button(at, "Mark unknown").click()
    at.run()
    no_exceptions(at)
    assert "was changed by ben" in texts(at)
    assert [a["reviewer"] for a in store.list_review_actions(item_id=shown["id"])] == ["ben"]

    # undo my last action (the correction): appended to the log, the item is open again
    at.run()
    button(at, "Undo my last action").click()
    at.run()
    no_exceptions(at)
    assert store.get_review_item(queue[1]["id"])["status"] == "open"
    assert [a["action"] for a in store.list_review_actions(run_id=run_id)] == ["accept", "correct", "skip", "undo"]
    progress = store.review_progress(run_id)
    assert (progress["reviewed"], progress["skipped"], progress["open"]) == (1, 1, 10)

    at.text_input(key=f"review.golden_name.{run_id}").input("Tickets golden")
    button(at, "Export as a new case set").click()
    at.run()
    no_exceptions(at)
    golden = next(s for s in store.list_case_sets() if s["name"] == "Tickets golden")
    assert golden["case_count"] == 1
    assert store.list_cases(golden["id"])[0]["expected"]["team"] == queue[0]["predicted"]


# --- Case sets: import, label columns, delete + undo (issue 13) --------------------------------------------------

TICKETS_CSV = ("subject,body,expected_team,priority\n"
               + "".join(f"Ticket {i},My invoice {i} is wrong,billing,{i % 4}\n" for i in range(10))).encode()

TAGGED_CSV = ("subject,body,expected_team,priority,tags\n"
              + "".join(f"Ticket {i},My invoice {i} is wrong,billing,{i % 4},urgent\n" for i in range(10))).encode()


def upload_csv(at: AppTest, content: bytes) -> AppTest:
    case_uploader(at).set_value(("tickets.csv", content, "text/csv"))
    at.run()
    no_exceptions(at)
    return at


def expected_column(at: AppTest, question_id: str):
    """The Import tab's picker of the column holding `question_id`'s expected answers (one per file)."""
    (picker,) = [s for s in at.selectbox if (s.key or "").startswith("cases.map.expected.")
                 and s.key.endswith(f".{question_id}")]
    return picker


def test_a_file_replacing_another_gets_its_own_mapping(workbench):
    """A wrong file first (no answer or tags columns), then the right one in its place: the right one's answer and
    tags columns are mapped as if it had come first, not left "(not mapped)" from the wrong one, which imported
    every case without its expected answers and with its tags in the state."""
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Replaced")
    upload_csv(at, b"subject,body\nHello,My invoice is wrong\n")
    assert expected_column(at, "team").value == NOT_MAPPED
    upload_csv(at, TAGGED_CSV)
    assert expected_column(at, "team").value == "expected_team"
    assert next(s for s in at.selectbox if s.key.startswith("cases.map.tags")).value == "tags"
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    button(at, "Import 10 cases").click()
    at.run()
    no_exceptions(at)
    case = store.list_cases(set_id)[0]
    assert case["state"] == {"subject": "Ticket 0", "body": "My invoice 0 is wrong"}
    assert case["expected"] == {"team": "billing", "priority": 0} and case["tags"] == ["urgent"]


def test_csv_import_uses_only_chosen_columns_refreshes_and_is_idempotent(workbench):
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Tickets")
    upload_csv(at, TICKETS_CSV)
    # the label column is mapped to its question by name, and never offered as state
    assert expected_column(at, "team").value == "expected_team"
    state_pick = next(m for m in at.multiselect if m.key.startswith("cases.map.state"))
    assert state_pick.value == [], "no column goes into the state unless chosen"
    assert "Choose the columns the model reads in “Columns that become state fields” above" in texts(at)
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    assert next(m for m in at.multiselect if m.key.startswith("cases.map.state")).value == ["subject", "body"]
    button(at, "Import 10 cases").click()
    at.run()
    no_exceptions(at)
    assert "Imported 10 cases into “Tickets”." in texts(at)
    assert "Tickets (10 cases)" in at.selectbox(key="cases.selected").options, "the picker shows the new count"
    assert not [b for b in at.button if b.label.startswith("Import ")], "no live Import button after importing"
    assert case_uploader(at).value is None, "the next file goes into an empty uploader"
    cases = store.list_cases(set_id)
    assert cases[0]["state"] == {"subject": "Ticket 0", "body": "My invoice 0 is wrong"}
    assert cases[0]["expected"] == {"team": "billing", "priority": 0}

    # the same file again: nothing is added twice
    upload_csv(at, TICKETS_CSV)
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    button(at, "Import 10 cases").click()
    at.run()
    no_exceptions(at)
    assert "Nothing new to import: all 10 are already in “Tickets”." in [i.value for i in at.info]
    assert store.get_case_set(set_id)["case_count"] == 10

    # a label-like column put into the state on purpose is named in a warning
    upload_csv(at, TICKETS_CSV)
    next(m for m in at.multiselect if m.key.startswith("cases.map.state")).set_value(["body", "expected_team"])
    at.run()
    assert "look like expected answers and are in the state" in texts(at) and "expected_team" in texts(at)


def test_saving_an_unchanged_table_says_there_was_nothing_to_save(workbench):
    """A row selected but not deleted (or a click the table missed) leaves the table as it was: Save says so, and
    does not report a save of nothing as "Saved: 0 added, 0 updated, 0 deleted"."""
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Unchanged")
    store.add_cases(set_id, [{"state": "Row 0"}])
    at.run()
    button(at, "Save changes").click()
    at.run()
    no_exceptions(at)
    assert "Nothing to save: the table has no changes." in texts(at)
    assert "Saved:" not in texts(at)
    assert [c["state"] for c in store.list_cases(set_id)] == ["Row 0"]


def test_delete_a_case_set_asks_first_and_can_be_undone(workbench):
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Doomed")
    store.add_cases(set_id, [{"state": "a"}, {"state": "b"}])
    at.run()
    button(at, "Delete this case set").click()
    at.run()
    no_exceptions(at)
    assert "Delete “Doomed” and its 2 case(s)? You can undo this." in texts(at)
    assert store.get_case_set(set_id)["case_count"] == 2, "nothing deleted before the confirmation"
    button(at, "Cancel").click()
    at.run()
    assert [s["id"] for s in store.list_case_sets()] == [set_id]
    button(at, "Delete this case set").click()
    at.run()
    button(at, "Yes, delete it").click()
    at.run()
    no_exceptions(at)
    assert "Deleted case set “Doomed”." in texts(at)
    assert store.list_case_sets() == []
    assert [(c["action"], c["kind"], c["label"]) for c in store.list_changes()] == [("delete", "case_set", "Doomed")]
    button(at, "Undo").click()
    at.run()
    no_exceptions(at)
    assert store.get_case_set(set_id)["case_count"] == 2
    assert at.selectbox(key="cases.selected").value == set_id
    assert [c["action"] for c in store.list_changes()] == ["restore", "delete"]


def test_deleting_one_of_two_case_sets_opens_the_other(workbench):
    """Not a "Not found" for the page's own link (?set=) to the set just deleted."""
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    kept = new_case_set(at, "Kept")
    doomed = new_case_set(at, "Doomed")
    assert at.query_params["set"] == str(doomed)
    button(at, "Delete this case set").click()
    at.run()
    button(at, "Yes, delete it").click()
    at.run()
    no_exceptions(at)
    assert "Deleted case set “Doomed”." in texts(at) and not [e.value for e in at.error]
    assert at.selectbox(key="cases.selected").value == kept and [s["id"] for s in store.list_case_sets()] == [kept]


def test_review_in_blind_mode_and_keeping_the_gold_label(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store, run_id = _finished_run(workbench)
    rules = ReviewRules(margin_below=1.0, unknown_option=False, disagree_with_expected=False, questions=["team"])
    assert review.apply_rules(store, run_id, rules) == 12
    at = open_page("pages/review.py")
    assert "clef-demo has random weights" in texts(at), "the random-weights notice is on the review page"
    at.text_input(key="review.reviewer").input("ana")
    at.run()
    at.toggle(key="review.blind").set_value(True)
    at.run()
    no_exceptions(at)
    item = store.list_review_items(run_id)[0]
    assert item["reason"] not in texts(at) and "hidden in blind mode" in texts(at)
    assert not at.get("vega_lite_chart"), "no distribution shown in blind mode"
    assert not [b for b in at.button if b.key == "review-accept"], "no Accept in blind mode, not even a disabled one"
    assert "gold label):" not in texts(at) and "A accept" not in texts(at)
    # choosing the model's own answer blind records an accept; the notice then reveals what the model said
    gold = store.get_case(item["case_id"])["expected"]["team"]
    button(at, item["predicted"]).click()
    at.run()
    no_exceptions(at)
    if gold != item["predicted"]:
        assert f"The case set's expected answer is “{gold}”" in texts(at)
        button(at, f"Keep “{gold}”").click()  # the reviewer keeps the gold label: it is recorded as the answer
        at.run()
        no_exceptions(at)
        kept = store.get_review_item(item["id"])
        assert (kept["status"], kept["label"], kept["reviewer"]) == ("corrected", gold, "ana")
    else:
        assert store.get_review_item(item["id"])["status"] == "accepted"
    assert f"The model had answered “{item['predicted']}”" in texts(at)


def param(at: AppTest, name: str) -> str | None:
    value = at.query_params.get(name)
    return value[0] if isinstance(value, list) else value


def test_links_open_the_run_case_set_and_review_item_they_name_and_results_browse(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store, run_id = _finished_run(workbench)
    set_id = store.get_run(run_id)["case_set_id"]
    newer = store.create_run(set_id, schema=store.get_run(run_id)["schema"], model_id="clef-demo")

    runs_page = open_page("pages/runs.py", run=str(run_id))
    assert runs_page.selectbox(key="runs.selected").value == run_id, "the linked run, not the newest"
    assert param(runs_page, "run") == str(run_id)
    assert "clef-demo has random weights" in texts(runs_page)
    assert "n = 12 records in 2 batch(es)" in texts(runs_page)
    table = next(df.value for df in runs_page.dataframe if "probabilities" in df.value.columns)
    assert len(table) == 12 * 5 and set(table["question"]) == {"team", "priority", "customer_mood", "churn_threat",
                                                                "needs_human_agent"}
    runs_page.toggle(key=f"runs.browse.wrong.{run_id}").set_value(True).run()
    wrong = next(df.value for df in runs_page.dataframe if "probabilities" in df.value.columns)
    assert 0 < len(wrong) < len(table) and not wrong["correct"].any()
    assert wrong["review"].iloc[0].startswith(f"/review?run={run_id}&case=")
    assert open_page("pages/runs.py").selectbox(key="runs.selected").value == newer, "no link: the newest run"

    cases_page = open_page("pages/cases.py", set=str(set_id))
    assert cases_page.selectbox(key="cases.selected").value == set_id and param(cases_page, "set") == str(set_id)

    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                  disagree_with_expected=False, questions=["team"]))
    target = store.list_review_items(run_id)[5]
    review_page = open_page("pages/review.py", run=str(run_id), case=str(target["case_id"]), question="team")
    assert f"### Case {target['case_id']} · `team` (choice)" in texts(review_page)
    assert (param(review_page, "case"), param(review_page, "question")) == (str(target["case_id"]), "team")
    assert f"/?run={run_id}&case={target['case_id']}" in [b.proto.url for b in review_page.get("link_button")], \
        "the review card opens its case in Decide"


def test_delete_a_run_asks_first_and_can_be_undone(workbench):
    store = Store(workbench / "workbench.sqlite3")
    set_id = store.create_case_set("Tickets")
    store.add_cases(set_id, [{"state": "a"}])
    run_id = store.create_run(set_id, schema={"name": "x", "questions": {"q": {"type": "noul"}}}, model_id="demo")
    at = open_page("pages/runs.py")
    button(at, "Delete this run…").click()
    at.run()
    no_exceptions(at)
    assert f"Delete run #{run_id} and its 0 result(s)? You can undo this." in texts(at)
    assert store.get_run(run_id)["id"] == run_id, "nothing deleted before the confirmation"
    button(at, "Yes, delete it").click()
    at.run()
    no_exceptions(at)
    assert f"Deleted run #{run_id}." in texts(at) and "No runs yet." in texts(at)
    assert store.list_runs() == []
    button(at, "Undo").click()
    at.run()
    no_exceptions(at)
    assert [r["id"] for r in store.list_runs()] == [run_id]
    assert at.selectbox(key="runs.selected").value == run_id
    assert [(c["action"], c["kind"]) for c in store.list_changes()] == [("restore", "run"), ("delete", "run")]


def test_a_run_reviewers_acted_on_is_refused_before_the_question(workbench):
    """Deleting is refused once the audit log holds a review of the run: the page says so at the click, instead of
    asking "You can undo this." and refusing after the Yes."""
    store, run_id = _finished_run(workbench)
    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                  disagree_with_expected=False))
    item = store.list_review_items(run_id)[0]
    store.apply_review_action(item["id"], reviewer="ana", action="accept", expected_version=0)
    at = open_page("pages/runs.py")
    button(at, "Delete this run…").click()
    at.run()
    no_exceptions(at)
    assert [e.value for e in at.error] == [
        f"run {run_id} cannot be deleted: reviewers have acted on it (1 review action(s), undone ones included, in "
        "the audit log, which is kept)"]
    assert "You can undo this" not in texts(at) and not [b for b in at.button if b.label == "Yes, delete it"]
    assert store.get_run(run_id)["id"] == run_id


def test_review_a_whole_record_on_one_screen_with_the_name_kept_in_the_link(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store, run_id = _finished_run(workbench)
    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                  disagree_with_expected=False))
    first = review.next_item(store, run_id)
    record = review.record_items(store, run_id, first["case_id"])
    assert len(record) == 5, "every question of the record is queued"

    # a reload (a new session on the same URL) keeps the reviewer's name
    at = open_page("pages/review.py", reviewer="ana")
    assert at.text_input(key="review.reviewer").value == "ana"
    assert "Enter your name above to review." not in texts(at)
    assert param(at, "reviewer") == "ana"

    # the record's questions are all on the screen with the item being reviewed
    assert f"### Case {first['case_id']} · `{first['question_id']}`" in texts(at)
    assert f"All 5 queued question(s) of case {first['case_id']}" in texts(at)
    for item in record:
        assert at.button(key=f"review-record-open-{item['id']}").disabled == (item["id"] == first["id"])
        assert f"model: **{item['predicted']}**" in texts(at)

    # an action moves on to the same record's next question, not to another record
    button(at, "Mark unknown").click()
    at.run()
    no_exceptions(at)
    following = next(i for i in record if i["id"] != first["id"])
    assert f"### Case {first['case_id']} · `{following['question_id']}`" in texts(at)
    assert "unknown by ana" in texts(at)

    # any question of the record opens from the overview; blind mode hides the model's answers there too
    at.toggle(key="review.blind").set_value(True)
    at.run()
    at.button(key=f"review-record-open-{record[-1]['id']}").click()
    at.run()
    no_exceptions(at)
    assert f"### Case {first['case_id']} · `{record[-1]['question_id']}`" in texts(at)
    assert "model: hidden" in texts(at) and "model: **" not in texts(at)
    at.text_input(key="review.reviewer").input("").run()
    assert param(at, "reviewer") is None, "a cleared name leaves the URL"


def test_review_shows_the_frames_the_model_read_for_a_video_case_large_enough_to_see(workbench, monkeypatch):
    import io

    from PIL import Image
    from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
    from streamlit.testing.v1 import app_test


    storages: list[MemoryMediaFileStorage] = []

    class KeptStorage(MemoryMediaFileStorage):
        """AppTest's media storage, kept so the test can read the images the page served."""

        def __init__(self, endpoint: str) -> None:
            super().__init__(endpoint)
            storages.append(self)

    monkeypatch.setattr(app_test, "MemoryMediaFileStorage", KeptStorage)
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = store.create_case_set("Clips")
    store.add_cases(set_id, [{"state": "a short clip", "videos": [mp4_bytes(frames=30, fps=15, size=32)]}])
    run_id = store.create_run(set_id, schema={"name": "clips", "questions": {"moving": {"type": "noul"}}},
                              model_id="clef-demo")
    shell.get_job_runner().start(run_id, shell.get_engine(show_errors=False))
    wait_for_run(run_id)
    assert review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False)) == 1
    at = open_page("pages/review.py", reviewer="ana")
    frames = [e for e in at.get("image") if [i.caption for i in e.proto.imgs] == [f"frame {n}" for n in range(4)]]
    assert frames, "the frames the model read are shown"
    for shown in frames[0].proto.imgs:
        data = storages[-1].get_file(shown.url.rsplit("/", 1)[-1]).content
        assert Image.open(io.BytesIO(data)).width >= 160, "a frame is not a 32-pixel speck"


def chart_specs(at: AppTest) -> list[tuple[dict, list[pd.DataFrame]]]:
    """Every Vega-Lite chart on the page: its spec and its datasets (Streamlit ships those apart, as Arrow)."""
    return [(json.loads(chart.proto.spec),
             [convert_arrow_bytes_to_pandas_df(dataset.data.data) for dataset in chart.proto.datasets])
            for chart in at.get("vega_lite_chart")]


def test_each_case_chart_on_the_runs_page_shows_every_option_label_whole_on_a_row_of_its_own(workbench):
    """Per-case charts were squeezed into a fixed height: noul charts drawn as a line, every other option's label
    dropped, score levels cut ("0: Low: a question, feedback or cosmetic i…")."""
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store, run_id = _finished_run(workbench)
    questions = store.get_run(run_id)["schema"]["questions"]
    at = open_page("pages/runs.py", run=str(run_id))
    titled = [(spec.get("title") or spec.get("layer", [{}])[0].get("title"), spec, datasets)
              for spec, datasets in chart_specs(at)]
    case_charts = {title: (spec, datasets) for title, spec, datasets in titled if title in questions}
    assert set(case_charts) == set(questions), "one chart per question of the case"
    for question_id, (spec, datasets) in case_charts.items():
        question = questions[question_id]
        labels = [label.replace("\n", " ") for label in datasets[0]["label"]]
        if question["type"] == "score":
            assert labels == [f"{i}: {text}" for i, text in enumerate(question["criteria"])], question_id
        elif question["type"] == "choice":
            assert labels == list(question["criteria"]), question_id
        else:
            assert labels == ["true", "false"], question_id
        # The chart is as tall as its options need (a step per option row, enough for the label's lines), not
        # fitted into a fixed element height; no label is hidden to make room for another.
        assert spec["autosize"]["type"] == "fit-x", question_id
        lines = max(label.count("\n") + 1 for label in datasets[0]["label"])
        assert spec["height"]["step"] >= max(24, 13 * lines), question_id
        y_axis = spec["layer"][0]["encoding"]["y"]["axis"]
        assert y_axis["labelOverlap"] is False and "split(datum.label" in y_axis["labelExpr"], question_id
        longest_line = max(len(line) for label in datasets[0]["label"] for line in label.split("\n"))
        assert longest_line * 7 <= y_axis["labelLimit"], f"{question_id}: a label line is cut at the label limit"


def open_decide_link(**params: str) -> AppTest:
    """A new browser session opening a link to Decide, the default page: /?param=…"""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for name, value in params.items():
        at.query_params[name] = value
    at.run()
    no_exceptions(at)
    return at


def test_a_results_row_opens_its_case_in_decide_with_the_runs_questions(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store, run_id = _finished_run(workbench)
    run = store.get_run(run_id)
    runs_page = open_page("pages/runs.py", run=str(run_id))
    table = next(df.value for df in runs_page.dataframe if "probabilities" in df.value.columns)
    row = table.iloc[7]
    assert row["decide"] == f"/?run={run_id}&case={row['case']}"
    assert row["review"] == f"/review?run={run_id}&case={row['case']}&question={row['question']}"

    # the link, opened in a new session: that case's state, the run's schema (still the library's: its identity)
    case = store.get_case(int(row["case"]))
    decide = open_decide_link(run=str(run_id), case=str(row["case"]))
    assert decide.text_area(key="decide.state_text").value == state_input.state_to_text(case["state"])
    assert decide.radio(key="decide.state_mode").value == "text"
    assert [t.value for t in decide.text_input if t.key.endswith(".id")] == list(run["schema"]["questions"])
    assert decide.selectbox(key="decide.library_pick").value == "support-ticket-routing"
    assert f"Case #{row['case']} of run #{run_id}" in "\n".join(i.value for i in decide.info)
    assert param(decide, "case") is None and param(decide, "draft"), "from here on the URL names the draft"
    # with that run's answer to it (issue 36 point 10), not an empty answers column
    answered = next(r["response"] for r in store.list_results(run_id) if r["case_id"] == int(row["case"]))
    shown = decide.session_state["decide.result"]
    assert shown.response == answered and shown.model_label == run["model_id"] and shown.random_weights
    assert "the answers below are the run's" in "\n".join(i.value for i in decide.info)
    assert [h.value for h in decide.subheader].count("Answers") == 1
    assert not [w.value for w in decide.warning if "Outdated" in w.value], "the run's answers to what is on screen"

    # a run made by a model not loaded here (another machine's): Decide says which model its Run uses now, and Why
    # says which model explains the run's answers (it used to explain them with the page's model and say nothing)
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE runs SET model_id = 'clef-flash' WHERE id = ?", (run_id,))
    try:
        decide = open_decide_link(run=str(run_id), case=str(row["case"]))
        assert "clef-flash is not loaded, so this page's runs use clef-demo" in "\n".join(i.value for i in decide.info)
        decide.toggle(key="decide.why").set_value(True).run()
        no_exceptions(decide)
        assert ("Explained by clef-demo: the model that answered, clef-flash, is not loaded here, so these answers "
                "may differ from the answers above.") in [c.value for c in decide.caption]
    finally:
        with sqlite3.connect(store.path) as conn:
            conn.execute("UPDATE runs SET model_id = 'clef-demo' WHERE id = ?", (run_id,))

    # the library schema changed since the run: the run's own questions, without the library's identity
    library = shell.get_library()
    newer = library.load("support-ticket-routing")
    newer.questions.pop("churn_threat")
    library.update("support-ticket-routing", newer)
    decide = open_decide_link(run=str(run_id), case=str(row["case"]))
    assert [t.value for t in decide.text_input if t.key.endswith(".id")] == list(run["schema"]["questions"])
    assert decide.selectbox(key="decide.library_pick").value is None
    assert "not saved in the library as they are" in "\n".join(i.value for i in decide.info)

    # a case the database does not have: said so, and Decide starts as usual
    decide = open_decide_link(run=str(run_id), case="99999")
    assert "The link names case #99999 of run" in "\n".join(w.value for w in decide.warning)
    assert decide.text_area(key="decide.state_text").value
