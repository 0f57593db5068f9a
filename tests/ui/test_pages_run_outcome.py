"""The Runs page tells the truth about a run that failed (AppTest, the real demo model, a real SQLite file): the
outcome and the errors at the top, statistics and exports that say what they leave out instead of crashing, a
retry of only the failed cases into the same run, a compare that never offers a run without answers as its
baseline, and a run picker whose label cannot contradict the progress bar."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from clef_workbench import casesets, review
from clef_workbench.review import ReviewRules
from clef_workbench.store import RunSettings, Store
from tests.support.apptest import APP, TIMEOUT, button, no_exceptions, open_page, texts, wait_for_run
from tests.support.endpoints import FailingEngine, RefusingEndpoint, serve
from workbench_ui import run_view, shell, units


def start_run(store: Store, set_id: int, engine, **settings) -> int:
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo",
                              settings=RunSettings(chunk_size=6, schema_slug="support-ticket-routing", **settings))
    shell.get_job_runner().start(run_id, engine)
    wait_for_run(run_id)
    return run_id


def retried_to_the_end(at: AppTest, store: Store, run_id: int) -> dict:
    """Press "Retry failed cases (12)", wait for the retry to end and draw the page again: the run as it is then."""
    button(at, "Retry failed cases (12)").click()
    at.run()
    wait_for_run(run_id)
    at.run()
    no_exceptions(at)
    assert "Finished: all 12 cases have answers." in texts(at)
    return store.get_run(run_id)


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_a_failed_run_reads_failed_at_the_top_exports_and_retries_only_its_failed_cases(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    demo = shell.get_engine(show_errors=False)
    failed = start_run(store, set_id, FailingEngine(demo, {""}))  # every case fails

    at = open_page("pages/runs.py", run=str(failed))
    assert "The run failed: every case failed (12 of 12); the first error: ClefError: engine fault" in texts(at)
    errors = next(df.value for df in at.dataframe if "error" in df.value.columns)
    assert len(errors) == 12
    assert "No case has an answer: all 12 failed" in texts(at)
    assert len(at.get("download_button")) == 2  # the exports of a run without answers (was a KeyError)
    assert at.selectbox(key="runs.selected").format_func(failed).endswith("12/12 · failed")

    run = retried_to_the_end(at, store, failed)
    assert (run["id"], run["status"], run["done"], run["errors"]) == (failed, "finished", 12, 0)


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_a_run_that_ends_while_the_page_draws_reads_the_same_in_the_selector_the_sidebar_and_the_page(workbench,
                                                                                                   monkeypatch):
    """Issue 36 point 7: a run that fails within a second ended between the drawing of the sidebar and run selector
    (which read it running) and the progress check (which reads it failed). Every surface must say failed."""
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    failed = start_run(store, set_id, FailingEngine(shell.get_engine(show_errors=False), {""}))

    # The database as it was a moment before the run ended, for the reads before the page's first look at the
    # run itself (the sidebar's and the selector's); from then on, as it is.
    ending = {"read": False}
    list_runs, lease_holder, get_run = Store.list_runs, Store.run_lease_holder, Store.get_run

    def runs_as_they_were(self, *args, **kwargs):
        runs = list_runs(self, *args, **kwargs)
        return runs if ending["read"] else [dict(r, status="running") if r["id"] == failed else r for r in runs]

    def holder_as_it_was(self, run_id):
        return lease_holder(self, run_id) if ending["read"] or run_id != failed else "another-process"

    def run_as_it_is(self, run_id):
        ending["read"] = True
        return get_run(self, run_id)

    monkeypatch.setattr(Store, "list_runs", runs_as_they_were)
    monkeypatch.setattr(Store, "run_lease_holder", holder_as_it_was)
    monkeypatch.setattr(Store, "get_run", run_as_it_is)
    at = open_page("pages/runs.py", run=str(failed))
    assert "The run failed" in texts(at)
    assert at.selectbox(key="runs.selected").format_func(failed).endswith("12/12 · failed")
    sidebar = "\n".join(m.value for m in at.sidebar.markdown)
    assert "**batch runs:** none running" in sidebar, sidebar


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_a_schema_over_max_length_is_said_before_the_start_and_a_retry_takes_other_settings(workbench):
    """Issue 36 point 7: a max_length the schema alone exceeds is said before the run starts (Start is off), and
    "Retry failed cases" lets the setting that made every case fail be changed first."""
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    at = open_page("pages/runs.py")
    at.number_input(key="runs.start.max_length").set_value(256).run()
    no_exceptions(at)
    assert "The schema alone takes" in errors(at) and "more than max_length 256" in errors(at)
    assert button(at, "Start run").disabled
    at.number_input(key="runs.start.max_length").set_value(8192).run()
    assert "The schema alone takes" not in errors(at) and not button(at, "Start run").disabled

    # a run recorded with that budget anyway (the command line does not ask): every case is refused
    refused = start_run(store, set_id, shell.get_engine(show_errors=False), max_length=256, overflow="refuse")
    at = open_page("pages/runs.py", run=str(refused))
    assert "The run failed" in texts(at)
    assert at.number_input(key=f"runs.retry.{refused}.max_length").value == 256, "the setting that failed, shown"
    at.number_input(key=f"runs.retry.{refused}.max_length").set_value(8192).run()
    run = retried_to_the_end(at, store, refused)
    assert (run["status"], run["done"], run["errors"], run["settings"].max_length) == ("finished", 12, 0, 8192)


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_the_runs_page_links_to_compare_with_a_run_that_has_answers_never_an_all_error_one(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    demo = shell.get_engine(show_errors=False)
    answered = start_run(store, set_id, demo)
    start_run(store, set_id, FailingEngine(demo, {""}))  # newer, every case failed
    newest = start_run(store, set_id, demo)

    at = open_page("pages/runs.py", run=str(newest))
    assert f"- [{run_view.run_label(store.get_run(answered))}](/compare?runs={answered},{newest})" in texts(at)
    assert texts(at).count("/compare?runs=") == 1, "no link to the run whose every case failed"
    assert "1 other run(s) of this case set have no answers" in texts(at)


def run_row(**counts) -> dict:
    return {"id": 7, "case_set_name": "tickets", "schema_name": "routing", "schema_version": "2", "model_id": "clef",
            "case_set_id": 1, **counts}


def test_a_running_runs_label_names_no_count_that_the_progress_bar_would_contradict():
    running = run_view.run_label(run_row(status="running", done=8, total=50, errors=0))
    assert "8/50" not in running and running.endswith("· running")
    assert run_view.run_label(run_row(status="finished", done=50, total=50, errors=3)).endswith(
        "50/50 · finished with errors")
    assert run_view.run_label(run_row(status="finished", done=50, total=50, errors=50)).endswith("50/50 · failed")


def test_durations_read_in_seconds_above_ten_thousand_milliseconds():
    assert units.duration(9_999.0) == "9,999 ms"
    assert units.duration(10_001) == "10.0 s"
    assert units.duration(150_762.4) == "2 min 31 s"  # never a six-digit millisecond count
    assert units.duration(None) == "–"


# -- links to what is not there ------------------------------------------------------------------------------------


def param(at: AppTest, name: str) -> str | None:
    value = at.query_params.get(name)
    return value[0] if isinstance(value, list) else value


def errors(at: AppTest) -> str:
    return "\n".join(e.value for e in at.error)


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_a_link_to_a_missing_run_case_set_review_item_or_schema_says_not_found_and_opens_nothing_else(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    run_id = start_run(store, set_id, shell.get_engine(show_errors=False))

    runs_page = open_page("pages/runs.py", run="999")
    assert "Not found: the link asks for run 999" in errors(runs_page)
    assert f"[{run_view.run_label(store.get_run(run_id))}](?run={run_id})" in texts(runs_page)  # what exists
    assert not [s for s in runs_page.selectbox if s.key == "runs.selected"], "no other run opened in its place"
    assert param(runs_page, "run") == "999", "the URL still names what was asked for"

    cases_page = open_page("pages/cases.py", set="999")
    assert "Not found: the link asks for case set 999" in errors(cases_page) and param(cases_page, "set") == "999"
    assert not [s for s in cases_page.selectbox if s.key == "cases.selected"]

    compare_page = open_page("pages/compare.py", runs=f"{run_id},999")
    assert "Not found: the link asks for run(s) #999" in errors(compare_page)
    assert param(compare_page, "runs") == f"{run_id},999"

    review_page = open_page("pages/review.py", run=str(run_id), case="999", question="team")
    assert f"Not found: the link asks for case 999 · question team of run #{run_id}" in errors(review_page)
    assert not [c for c in review_page.markdown if c.value.startswith("### Case ")], "no other item in its place"
    assert (param(review_page, "case"), param(review_page, "question")) == ("999", "team")
    assert "Not found: the link asks for run 999" in errors(open_page("pages/review.py", run="999"))

    decide = AppTest.from_file(APP, default_timeout=TIMEOUT)  # Decide is the root page: the link is the first run
    decide.query_params["schema"] = "no-such-schema"
    decide.run()
    no_exceptions(decide)
    assert "Not found: the link asks for the schema “no-such-schema”" in errors(decide)
    assert param(decide, "schema") == "no-such-schema"
    loaded = decide.session_state["decide.loaded_slug"] if "decide.loaded_slug" in decide.session_state else None
    assert loaded is None, "no other schema opened in its place"


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_open_in_review_from_a_results_row_opens_that_answer_queuing_it_when_the_queue_is_empty(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    run_id = start_run(store, set_id, shell.get_engine(show_errors=False))
    case_id = store.list_results(run_id)[3]["case_id"]
    assert store.list_review_items(run_id) == []  # no rules applied: the queue is empty

    at = open_page("pages/review.py", run=str(run_id), case=str(case_id), question="priority")
    assert f"### Case {case_id} · `priority` (score)" in texts(at)
    item = store.list_review_items(run_id)
    assert [(i["case_id"], i["question_id"], i["reason"]) for i in item] == [
        (case_id, "priority", "opened from a link")]


# -- review: the gold-label confirmation ------------------------------------------------------------------------------


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_an_answer_against_the_gold_label_asks_in_a_dialog_and_keep_records_the_gold_label(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    run_id = start_run(store, set_id, shell.get_engine(show_errors=False))
    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                  disagree_with_expected=False, questions=["team"]))
    item = review.next_item(store, run_id)
    gold = next(option for option in item["distribution"] if option != item["predicted"])
    case = store.get_case(item["case_id"], with_media=False)
    store.update_case(item["case_id"], expected={**case["expected"], "team": gold})  # the model disagrees with it

    at = open_page("pages/review.py", reviewer="ana")
    button(at, f"Accept “{item['predicted']}”").click()  # what the A key does
    at.run()
    no_exceptions(at)
    dialogs = at.get("dialog")
    assert len(dialogs) == 1, "the confirmation is a modal in front of the page, not a box below the fold"
    dialog_text = "\n".join(w.value for w in dialogs[0].warning)
    assert f"The case set's expected answer is “{gold}”" in dialog_text
    assert store.get_review_item(item["id"])["status"] == "open", "nothing recorded before the answer"

    button(at, f"Keep “{gold}”").click()
    at.run()
    no_exceptions(at)
    kept = store.get_review_item(item["id"])
    assert (kept["status"], kept["label"], kept["reviewer"]) == ("corrected", gold, "ana"), "Keep records the gold"
    assert not at.get("dialog")


@pytest.mark.slow  # the pages on the demo model, with its runs: tens of seconds each on a busy machine
def test_the_compare_pages_one_action_shows_the_run_it_started_and_follows_it_to_its_end(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    at = open_page("pages/compare.py")
    at.selectbox(key="compare.start.set").select(set_id).run()
    at.selectbox(key=f"compare.start.schema.{set_id}").select("support-ticket-routing").run()
    button(at, "Run this schema on this case set with these models").click().run()
    no_exceptions(at)
    run_id = store.list_runs()[0]["id"]
    # one run of the set cannot be compared yet, but the page shows it and links to it
    assert f"Run [#{run_id}](/runs?run={run_id}) · clef-demo · " in texts(at)
    wait_for_run(run_id)
    at.run()
    assert f"Run [#{run_id}](/runs?run={run_id}) · clef-demo · finished · 12/12 cases" in texts(at)


def test_the_compare_pages_one_action_on_a_stopped_endpoint_says_why_and_leaves_no_run(workbench):
    """Point 12: the one action with a remote model whose server has stopped (added while it was up) refuses with the
    reason, next to the action, and no run is recorded, pending or otherwise."""

    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")["support-ticket-routing"]
    server = serve(RefusingEndpoint)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    manager = shell.model_manager()
    manager.add(url)
    manager.wait(TIMEOUT)
    remote = next(m.name for m in manager.loaded() if m.source == url)
    server.shutdown()
    server.server_close()
    try:
        at = open_page("pages/compare.py")
        at.selectbox(key="compare.start.set").select(set_id).run()
        at.selectbox(key=f"compare.start.schema.{set_id}").select("support-ticket-routing").run()
        at.multiselect(key="compare.start.models").select(remote).run()
        button(at, "Run this schema on this case set with these models").click().run()
        no_exceptions(at)
        refusal = [e.value for e in at.error if "No run was started" in e.value]
        assert refusal and f"the endpoint of {remote} did not answer" in refusal[0], texts(at)
        assert f"could not reach {url}" in refusal[0]
        assert store.list_runs() == [], "no run left pending"
        assert not [s for s in at.success if "Started run" in s.value]
    finally:
        manager.remove(remote)


def test_run_this_case_set_opens_start_a_run_with_the_set_and_its_schema(workbench):
    """Issue 36 point 10: "Run this case set" on the Case sets page leads to the Runs page's Start a run, that set
    and its own schema chosen."""
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    sets = casesets.load_example_case_sets(store, workbench / "schemas")
    set_id = sets["security-alert-triage"]
    at = open_page("pages/cases.py", set=str(set_id))
    button(at, "Run this case set").click()
    at.run()
    no_exceptions(at)
    assert [t.value for t in at.title] == ["Runs"]
    assert at.selectbox(key="runs.start.case_set").value == set_id
    assert at.selectbox(key=f"runs.start.schema.{set_id}").value == "security-alert-triage"


class SlowEndpoint:
    """An endpoint whose load waits for the test: the model manager is busy loading it until then."""

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_while_a_model_loads_start_waits_without_holding_the_page_and_is_offered_when_it_is_loaded(workbench,
                                                                                                   monkeypatch):
    """Review leftover b: Resume and Retry held the page's script run for up to 600 s under a spinner while a model
    loaded. The buttons that run on a model say "Model loading…" and wait instead; the page is drawn at once."""
    import threading

    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    casesets.load_example_case_sets(Store(workbench / "workbench.sqlite3"), workbench / "schemas")
    manager = shell.model_manager()
    loaded = threading.Event()
    monkeypatch.setattr(manager, "_loader", lambda source, **options: loaded.wait(TIMEOUT) and SlowEndpoint())
    manager.add("http://127.0.0.1:9")
    try:
        at = open_page("pages/runs.py")
        start = next(b for b in at.button if b.key == "runs.start.go")
        assert (start.label, start.disabled) == ("Model loading…", True)
    finally:
        loaded.set()
        manager.wait(TIMEOUT)
    at.run()
    no_exceptions(at)
    start = next(b for b in at.button if b.key == "runs.start.go")
    assert (start.label, start.disabled) == ("Start run", False)
    manager.remove(next(m.name for m in manager.loaded() if m.source == "http://127.0.0.1:9"))
