"""The Runs page tells the truth about a run that failed (AppTest, the real demo model, a real SQLite file): the
outcome and the errors at the top, statistics and exports that say what they leave out instead of crashing, a
retry of only the failed cases into the same run, a compare that never offers a run without answers as its
baseline, and a run picker whose label cannot contradict the progress bar."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from clef_workbench import casesets
from clef_workbench.store import Store
from tests.test_pages_runs_review import APP, TIMEOUT, button, ok, open_link, texts, wait_for_run
from tests.test_run_outcome import FailingEngine
from workbench_ui import run_view, shell


def start_run(store: Store, set_id: int, engine) -> int:
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo",
                              settings={"chunk_size": 6, "schema_slug": "support-ticket-routing"})
    shell.get_job_runner().start(run_id, engine)
    wait_for_run(run_id)
    return run_id


def test_a_failed_run_reads_failed_at_the_top_exports_and_retries_only_its_failed_cases(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    demo = shell.get_engine(show_errors=False)
    failed = start_run(store, set_id, FailingEngine(demo, {""}))  # every case fails

    at = open_link("pages/runs.py", run=str(failed))
    assert "The run failed: every case failed (12 of 12); the first error: ClefError: engine fault" in texts(at)
    errors = next(df.value for df in at.dataframe if "error" in df.value.columns)
    assert len(errors) == 12
    assert "No case has an answer: all 12 failed" in texts(at)
    assert len(at.get("download_button")) == 2  # the exports of a run without answers (was a KeyError)
    assert at.selectbox(key="runs.selected").format_func(failed).endswith("12/12 · failed")

    button(at, "Retry failed cases (12)").click()
    at.run()
    wait_for_run(failed)
    at.run()
    ok(at)
    run = store.get_run(failed)
    assert (run["id"], run["status"], run["done"], run["errors"]) == (failed, "finished", 12, 0)
    assert "Finished: all 12 cases have answers." in texts(at)


def test_the_runs_page_compares_with_a_run_that_has_answers_never_an_all_error_one(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    demo = shell.get_engine(show_errors=False)
    answered = start_run(store, set_id, demo)
    start_run(store, set_id, FailingEngine(demo, {""}))  # newer, every case failed
    newest = start_run(store, set_id, demo)

    at = open_link("pages/runs.py", run=str(newest))
    baseline = at.selectbox(key=f"runs.compare.{newest}")
    assert baseline.options == [run_view.run_label(store.get_run(answered))] and baseline.value == answered
    assert "1 other run(s) of this case set have no answers" in texts(at)
    assert "pairs answered in both runs" in texts(at)


def run_row(**counts) -> dict:
    return {"id": 7, "case_set_name": "tickets", "schema_name": "routing", "schema_version": "2", "model_id": "clef",
            "case_set_id": 1, **counts}


def test_a_running_runs_label_names_no_count_that_the_progress_bar_would_contradict():
    running = run_view.run_label(run_row(status="running", done=8, total=50, errors=0))
    assert "8/50" not in running and running.endswith("· running")
    assert run_view.run_label(run_row(status="finished", done=50, total=50, errors=3)).endswith(
        "50/50 · finished with errors")
    assert run_view.run_label(run_row(status="finished", done=50, total=50, errors=50)).endswith("50/50 · failed")


def test_durations_read_in_seconds_from_ten_thousand_milliseconds():
    assert run_view.fmt_duration_ms(9_999.0) == "9,999.0 ms"
    assert run_view.fmt_duration_ms(150_762.4) == "150.8 s"
    assert run_view.fmt_duration_ms(None) == "–"
