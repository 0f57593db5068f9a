"""The workbench shell, Decide and Schemas pages through Streamlit's AppTest, on the real demo model and a real
SQLite store and schema folder (temporary)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from streamlit.runtime.scriptrunner_utils.exceptions import StopException
from streamlit.testing.v1 import AppTest

from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import Store
from tests.support.apptest import (
    APP,
    TIMEOUT,
    button,
    case_uploader,
    engine,
    new_case_set,
    no_exceptions,
    open_page,
    start,
)
from workbench_ui import decide_model as vm
from workbench_ui import shell


def charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def code_json(at: AppTest, index: int) -> dict:
    return json.loads(at.code[index].value)


# --- shell -------------------------------------------------------------------------------------------------------


def test_shell_starts_on_the_demo_model_and_a_page_load_runs_nothing(workbench):
    at = start()
    assert [t.value for t in at.title] == ["Decide"]
    assert [w.value for w in at.warning if "random weights" in w.value] == [shell.random_weights_text("clef-demo")]
    # The sidebar is drawn before the page, while the first load may still run; while it does, the status redraws
    # itself every few seconds in a browser. AppTest runs no timers: open the app again, the model now resident.
    assert at.sidebar.markdown or at.sidebar.caption[0].value.startswith(("Loading", "No model"))
    at = start()
    status = at.sidebar.markdown[0].value
    assert "**model:** Demo model (random weights)" in status
    assert "**device:** cpu" in status and "**precision:** float32" in status and "dtype" not in status
    assert "**fast kernels:** off" in status and "**queue depth:** 0" in status
    assert at.sidebar.selectbox(key="sidebar.model_choice").value == "Demo model (random weights)"
    records_before = engine().info()["scheduler"]["records"]
    at.run()
    at.switch_page("pages/schemas.py")
    at.run()
    no_exceptions(at)
    assert engine().info()["scheduler"]["records"] == records_before, "loading pages must not run the model"


def test_shell_lists_only_existing_pages(workbench):
    at = start()
    # The navigation is built from the files in pages/; Decide and Schemas always exist.
    at.switch_page("pages/schemas.py")
    at.run()
    no_exceptions(at)
    assert [t.value for t in at.title] == ["Schema library"]


# --- Decide ------------------------------------------------------------------------------------------------------


def test_decide_runs_the_example_schema_and_shows_one_card_per_question(workbench):
    at = start()
    schema = SchemaLibrary(workbench / "schemas").load("support-ticket-routing")
    assert at.text_area(key="decide.state_text").value == schema.examples[0]["state"]
    assert any(c.value.startswith("Read as plain text") for c in at.caption)
    assert charts(at) == 1, "only the token budget bar before running"
    assert any("tokens used" in s.value for s in at.success)
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    answer_metrics = [m for m in at.metric if m.label == "Answer"]
    assert len(answer_metrics) == len(schema.questions) == 5
    assert charts(at) == 1 + 5
    levels = len(schema.questions["priority"]["criteria"])
    assert f"Score (0 to {levels - 1})" in [m.label for m in at.metric], "the expected score, with its scale"
    # the demo's random weights said once, beside the answers (the first Run showed three banners at once)
    assert len([w for w in at.warning if "random" in w.value]) == 1, [w.value for w in at.warning]
    latency = next(m for m in at.metric if m.label == "Latency")
    assert latency.value.endswith((" ms", " s")), "milliseconds, or seconds above 10,000 ms on a busy machine"
    response, request = code_json(at, 0), code_json(at, 1)
    assert list(response["answers"]) == list(schema.questions)
    assert request["state"] == schema.examples[0]["state"] and request["questions"] == schema.questions
    assert response["model"] == request["model"] == "clef-demo"
    for answer in response["answers"].values():
        if answer["type"] == "choice":
            assert sum(answer["probabilities"].values()) == pytest.approx(1, abs=1e-3)


def test_invalid_json_state_shows_line_and_column_and_blocks_run(workbench):
    at = start()
    at.text_area(key="decide.state_text").input('{\n  "vendor": "ACME",\n  "total": ,\n}').run()
    no_exceptions(at)
    errors = [e.value for e in at.error]
    assert any("The state is not valid JSON: Expecting value. (line 3, column 12)" in e for e in errors), errors
    assert button(at, "Run").disabled
    at.text_area(key="decide.state_text").input('{"vendor": "ACME", "total": 12}').run()
    assert any(c.value == "Read as JSON object · 2 keys" for c in at.caption)
    assert not button(at, "Run").disabled


def test_builder_adds_reorders_removes_and_validates_questions(workbench):
    shutil.rmtree(workbench / "schemas")
    at = start()
    assert any("No questions yet" in i.value for i in at.info)
    assert button(at, "Run").disabled
    for qtype in ("noul", "choice", "score"):
        at.selectbox(key="decide.new_type").select(qtype).run()
        button(at, "Add question").click().run()
    no_exceptions(at)
    ids = [t.value for t in at.text_input if t.key.endswith(".id")]
    assert ids == ["q1", "q2", "q3"]
    types = [s.value for s in at.selectbox if s.key.startswith("decide.q") and s.key.endswith(".type")]
    assert types == ["noul", "choice", "score"]

    # A duplicate id is an error shown on the question, and blocks the run.
    at.text_input(key="decide.q1.id").input("q1").run()
    assert any('question "q1": the id appears more than once' in e.value for e in at.error)
    assert button(at, "Run").disabled
    at.text_input(key="decide.q1.id").input("team").run()
    at.text_input(key="decide.q0.id").input("is_urgent").run()
    at.text_area(key="decide.q0.instructions").input("Is this urgent?").run()
    at.text_area(key="decide.q1.instructions").input("Which team?").run()
    at.text_area(key="decide.q2.instructions").input("How angry is the customer?").run()
    # Only one option is flagged (the hosted service needs 2–255), named with question and field.
    at.text_area(key="decide.q1.options").input("billing: Money").run()
    assert any('question "team", field "criteria"' in m.value and "2–255 options" in m.value
               for m in list(at.error) + list(at.warning))
    at.text_area(key="decide.q1.options").input("billing: Money\ntech: Broken things\nunknown: None of these").run()
    assert [e.value for e in at.error] == ["The state is empty: write the record the model should read (plain text "
                                           "or JSON)."], "only the (still empty) state is wrong now"

    # Move the score question to the top, then remove the noul question.
    at.button(key="decide.q2.up").click().run()
    at.button(key="decide.q2.up").click().run()
    assert [t.value for t in at.text_input if t.key.endswith(".id")] == ["q3", "is_urgent", "team"]
    at.button(key="decide.q0.remove").click().run()
    assert [t.value for t in at.text_input if t.key.endswith(".id")] == ["q3", "team"]

    at.text_area(key="decide.state_text").input('{"body": "My invoice is wrong!"}').run()
    button(at, "Run").click().run()
    no_exceptions(at)
    response = code_json(at, 0)
    assert list(response["answers"]) == ["q3", "team"]
    assert list(response["answers"]["team"]["probabilities"]) == ["billing", "tech", "unknown"]
    assert response["answers"]["q3"]["legend"] == {"0": "Low", "1": "Medium", "2": "High"}


def test_token_budget_refuse_then_truncate(workbench):
    at = start()
    at.text_area(key="decide.state_text").input("word " * 3000).run()
    at.selectbox(key="decide.max_length").select(2048).run()
    no_exceptions(at)
    warnings = [w.value for w in at.warning]
    assert any("so Run will be refused: choose to truncate the state" in w for w in warnings), warnings
    button(at, "Run").click().run()
    no_exceptions(at)
    errors = [e.value for e in at.error]
    assert any("over max_length 2,048" in e and "allow truncation" in e for e in errors), errors
    assert not [m for m in at.metric if m.label == "Answer"], "a refused request has no answers"
    at.radio(key="decide.overflow").set_value("truncate_state").run()
    assert any("tokens of the state will be cut: the model will not read them" in w.value for w in at.warning)
    button(at, "Run").click().run()
    no_exceptions(at)
    truncated = next(m for m in at.metric if m.label == "Truncated state tokens")
    assert int(truncated.value.replace(",", "")) > 0
    assert any("were cut to fit max_length" in w.value for w in at.warning)
    assert code_json(at, 0)["usage"]["input_tokens"] == 2048


def test_save_as_case_with_confirmed_labels(workbench):
    at = start()
    button(at, "Run").click().run()
    response = code_json(at, 0)
    at.checkbox(key="decide.confirm_labels").check().run()
    at.text_input(key="decide.case_tags").input("smoke, demo").run()
    button(at, "Save as case").click().run()
    no_exceptions(at)
    assert any("Saved case #" in s.value and "with expected labels" in s.value for s in at.success)
    store = Store(workbench / "workbench.sqlite3")
    (case_set,) = store.list_case_sets()
    assert case_set["name"] == "Support ticket routing cases" and case_set["case_count"] == 1
    (case,) = store.list_cases(case_set["id"])
    schema = SchemaLibrary(workbench / "schemas").load("support-ticket-routing")
    assert case["state"] == schema.examples[0]["state"]
    assert case["tags"] == ["smoke", "demo"]
    assert case["expected"]["team"] == response["answers"]["team"]["choice"]
    assert case["expected"]["churn_threat"] == (response["answers"]["churn_threat"]["noul"] >= 0.5)


def test_save_builder_schema_to_library(workbench):
    at = start()
    at.text_input(key="decide.schema_name").input("Routing v2").run()
    button(at, "Save as new schema").click().run()
    no_exceptions(at)
    assert "Saved as routing-v2.json in the schema library (Schemas page)." in [s.value for s in at.success]
    assert not [s.value for s in at.success if str(workbench) in s.value], "the server's folders are not the user's"
    library = SchemaLibrary(workbench / "schemas")
    original = library.load("support-ticket-routing")
    assert library.load("routing-v2").questions == original.questions


# --- Schemas page ------------------------------------------------------------------------------------------------


def open_schemas(at: AppTest) -> AppTest:
    at.switch_page("pages/schemas.py")
    at.run()
    no_exceptions(at)
    return at


def test_schemas_page_lists_and_lints_the_library(workbench):
    at = open_schemas(start())
    listing = at.dataframe[0].value
    assert list(listing["file"]) == ["invoice-triage.json", "security-alert-triage.json",
                                     "support-ticket-routing.json", "vehicle-damage-claim-photo.json"]
    assert set(listing["lint"]) == {"ok"}
    assert any(s.value == "Lint: no warnings." for s in at.success)


def test_schemas_page_create_edit_duplicate_delete(workbench):
    library = SchemaLibrary(workbench / "schemas")
    at = open_schemas(start())
    at.text_input(key="schemas.new_name").input("Refund triage").run()
    button(at, "Create").click().run()
    no_exceptions(at)
    assert library.load("refund-triage").version == 1
    assert at.selectbox(key="schemas.selected").value == "refund-triage"

    # A syntax error names line and column; nothing is written.
    editor = at.text_area(key="schemas.json.refund-triage")
    before = (workbench / "schemas" / "refund-triage.json").read_text()
    editor.input(before.replace('"version": 1,', '"version": 1')).run()
    button(at, "Save changes").click().run()
    assert any("not valid JSON: Expecting ',' delimiter at line 4, column 3" in e.value for e in at.error)
    assert (workbench / "schemas" / "refund-triage.json").read_text() == before
    # Discard: the file again, and the error of the discarded text gone with it
    button(at, "Discard changes").click().run()
    assert at.text_area(key="schemas.json.refund-triage").value == before
    assert not [e.value for e in at.error]

    # An unsaved edit survives opening another schema and coming back
    at.text_area(key="schemas.json.refund-triage").input(before.replace("Refund triage", "Refund triage, draft")).run()
    at.selectbox(key="schemas.selected").select("invoice-triage").run()
    at.selectbox(key="schemas.selected").select("refund-triage").run()
    assert "Refund triage, draft" in at.text_area(key="schemas.json.refund-triage").value
    button(at, "Discard changes").click().run()

    # A valid edit that changes the questions bumps the version.
    data = json.loads(before)
    data["questions"]["q1"]["instructions"] = "Is the customer asking for their money back?"
    at.text_area(key="schemas.json.refund-triage").input(json.dumps(data)).run()
    button(at, "Save changes").click().run()
    no_exceptions(at)
    assert library.load("refund-triage").version == 2
    assert library.load("refund-triage").questions["q1"]["instructions"].startswith("Is the customer")
    assert at.text_area(key="schemas.json.refund-triage").value == library.export_json("refund-triage")

    at.text_input(key="schemas.dup_name.refund-triage").input("Refund triage EU").run()
    button(at, "Duplicate").click().run()
    assert library.load("refund-triage-eu").name == "Refund triage EU"
    assert at.selectbox(key="schemas.selected").value == "refund-triage-eu"

    assert button(at, "Delete").disabled, "nothing to click before the box is ticked"
    assert library.exists("refund-triage-eu")
    at.checkbox(key="schemas.confirm_delete.refund-triage-eu").check().run()
    button(at, "Delete").click().run()
    no_exceptions(at)
    assert not library.exists("refund-triage-eu") and library.exists("refund-triage")
    # another schema opens: not a "Not found" for the page's own link to the deleted one
    assert not [e.value for e in at.error] and at.selectbox(key="schemas.selected").value != "refund-triage-eu"
    assert at.query_params.get("schema") != "refund-triage-eu"
    button(at, "Undo").click().run()  # the file comes back from the change log
    no_exceptions(at)
    assert library.load("refund-triage-eu").name == "Refund triage EU"
    assert [(c["action"], c["object_id"]) for c in Store(workbench / "workbench.sqlite3").list_changes(kind="schema")] \
        == [("restore", "refund-triage-eu"), ("delete", "refund-triage-eu")]


def test_open_in_decide_loads_the_schema_into_the_builder(workbench):
    at = open_schemas(start())
    at.selectbox(key="schemas.selected").select("security-alert-triage").run()
    button(at, "Open in Decide").click().run()
    no_exceptions(at)
    assert [t.value for t in at.title] == ["Decide"]
    ids = [t.value for t in at.text_input if t.key.startswith("decide.q") and t.key.endswith(".id")]
    assert ids == ["verdict", "attack_tactic", "severity", "page_oncall", "privileged_account"]
    state = json.loads(at.text_area(key="decide.state_text").value)
    assert state["rule"] == "Credential dumping: LSASS process access"


def test_run_queued_reports_queue_position_then_running():
    """While other jobs hold the GPU, the Decide page shows "Queued, n ahead"; then "Running"."""
    import threading
    from concurrent.futures import Future

    class FakeEngine:
        def __init__(self):
            self.positions = [2, 1, None]
            self.submitted = []

        def queue_position(self, future):
            return self.positions.pop(0) if self.positions else None

        def validate(self, request, **budget):
            return {"request": request, **budget}

        def submit(self, requests, **kwargs):
            self.submitted.append((requests, kwargs))
            future = Future()
            threading.Timer(1.0, future.set_result, args=([{"answers": {}}],)).start()
            return future

        def queue_depth(self):
            return 3

        def info(self):
            return {"device": "cuda:0"}

    fake = FakeEngine()
    seen: list[str] = []
    result = shell.run_queued(fake, [{"state": "x"}], max_length=100, on_wait=seen.append)
    assert result == [{"answers": {}}]
    assert fake.submitted == [([{"request": {"state": "x"}, "max_length": 100, "overflow": "refuse"}],
                               {"priority": "interactive"})]
    assert seen[0].startswith("Queued, 2 ahead (queue depth 3)")
    assert seen[1].startswith("Queued, 1 ahead")
    assert seen[-1].startswith("Running on cuda:0")


def test_a_run_a_widget_change_stops_is_dropped_by_the_engine_and_said_on_the_next_run():
    """Changing the model picker (or any field) while Run waits makes Streamlit stop the script inside run_queued:
    the run used to vanish without a word while the engine computed it anyway."""
    from concurrent.futures import Future

    from streamlit.runtime.scriptrunner_utils.exceptions import RerunException

    class WaitingEngine:
        def __init__(self):
            self.future, self.abandoned = Future(), []

        def validate(self, request, **budget):
            return request

        def submit(self, requests, **kwargs):
            return self.future

        def queue_position(self, future):
            return None

        def queue_depth(self):
            return 1

        def info(self):
            return {"device": "cpu"}

        def abandon(self, future):
            self.abandoned.append(future)

    def widget_changed(text: str) -> None:  # what Streamlit raises at the page's next call while it waits
        raise RerunException(None)

    engine = WaitingEngine()
    with pytest.raises(RerunException):
        shell.run_queued(engine, [{"state": "x"}], on_wait=widget_changed, stopped_key="decide.running")
    assert engine.abandoned == [engine.future]
    assert shell.was_stopped("decide.running") and not shell.was_stopped("decide.running"), "said once"
    done = WaitingEngine()
    done.future.set_result([{"answers": {}}])
    assert shell.run_queued(done, [{"state": "x"}], stopped_key="decide.running") == [{"answers": {}}]
    assert not shell.was_stopped("decide.running") and not done.abandoned


# --- Decide: drafts, identity, confirmations (issue 13) ---------------------------------------------------------


def open_with_draft(token: str) -> AppTest:
    """A new browser session on a URL carrying ?draft=<token>: what a reload of the page is."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["draft"] = token
    at.run()
    no_exceptions(at)
    return at


def test_a_reload_restores_the_decide_draft_of_this_browser_session(workbench):
    at = start()
    token = at.query_params["draft"][0] if isinstance(at.query_params["draft"], list) else at.query_params["draft"]
    assert token, "the session's draft is named in the URL"
    at.text_area(key="decide.state_text").input('{"body": "my own ticket"}').run()
    at.text_input(key="decide.q0.id").input("is_it_urgent").run()
    at.selectbox(key="decide.max_length").select(2048).run()

    reloaded = open_with_draft(token)
    assert reloaded.text_area(key="decide.state_text").value == '{"body": "my own ticket"}'
    assert [t.value for t in reloaded.text_input if t.key.endswith(".id")][0] == "is_it_urgent"
    assert reloaded.selectbox(key="decide.max_length").value == 2048
    other = open_with_draft("someone-else")  # another session's token has no draft: the example schema
    assert other.text_area(key="decide.state_text").value != '{"body": "my own ticket"}'


def test_an_edit_is_in_the_draft_even_when_the_run_it_started_is_stopped_midway(workbench, monkeypatch):
    """A reload or a closed tab stops the page's run where it is. The edit that run carried is saved first: saved as
    the run's last step, a question id typed just before a reload came back as the schema's own (a browser journey
    under CPU load)."""
    at = start()
    token = at.query_params["draft"][0] if isinstance(at.query_params["draft"], list) else at.query_params["draft"]

    def stopped_here(*args, **kwargs):
        raise StopException()  # what Streamlit raises in a run whose session went away

    monkeypatch.setattr(vm.BudgetCache, "counts", stopped_here)  # midway: after the editors, before the answers
    at.text_input(key="decide.q0.id").input("is_it_urgent").run()
    monkeypatch.undo()
    reloaded = open_with_draft(token)
    assert [t.value for t in reloaded.text_input if t.key.endswith(".id")][0] == "is_it_urgent"


def test_decides_fields_declare_the_value_they_hold_as_their_default(workbench):
    """A browser that redraws a field without the value it held falls back to the field's declared default and
    sends it back as typed: the default is what the field holds, so such a fallback changes nothing."""
    at = start()
    at.text_input(key="decide.q1.id").set_value("urgency").run()
    no_exceptions(at)
    fields = {**{t.key: t for t in at.text_input}, **{t.key: t for t in at.text_area}}
    assert fields["decide.q1.id"].proto.default == "urgency"
    assert fields["decide.q0.id"].proto.default == "team"
    assert fields["decide.schema_name"].proto.default == fields["decide.schema_name"].value != ""
    assert fields["decide.state_text"].proto.default == fields["decide.state_text"].value != ""
    at.selectbox(key="decide.max_length").set_value(4096).run()
    at.radio(key="decide.overflow").set_value("truncate_state").run()
    no_exceptions(at)
    budget = at.selectbox(key="decide.max_length")
    assert budget.options[budget.proto.default] == "4,096"
    overflow = at.radio(key="decide.overflow")
    assert overflow.options[overflow.proto.default] == "truncate the end of the state"


def test_load_asks_before_discarding_edited_questions(workbench):
    at = start()
    at.text_area(key="decide.q0.instructions").input("My own wording").run()
    at.selectbox(key="decide.library_pick").select("invoice-triage").run()
    button(at, "Load").click().run()
    no_exceptions(at)
    assert any("unsaved changes" in w.value for w in at.warning)
    assert at.text_area(key="decide.q0.instructions").value == "My own wording", "nothing discarded yet"
    button(at, "Keep my changes").click().run()
    assert at.text_area(key="decide.q0.instructions").value == "My own wording"
    button(at, "Load").click().run()
    button(at, "Discard my changes and load").click().run()
    no_exceptions(at)
    library = SchemaLibrary(workbench / "schemas")
    first = next(iter(library.load("invoice-triage").questions))
    assert [t.value for t in at.text_input if t.key.endswith(".id")][0] == first

    # unchanged questions load at once
    at.selectbox(key="decide.library_pick").select("security-alert-triage").run()
    button(at, "Load").click().run()
    assert [t.value for t in at.text_input if t.key.endswith(".id")][0] == "verdict"


def test_load_keeps_the_state_typed_and_use_this_example_can_be_undone(workbench):
    """Issue 36 point 1, on the page: Load leaves the state editor as typed; the example is its own button, and
    what it replaces comes back with Undo."""
    at = start()
    at.text_area(key="decide.state_text").input("A record I wrote before choosing a schema").run()
    at.selectbox(key="decide.library_pick").select("invoice-triage").run()
    button(at, "Load").click().run()
    no_exceptions(at)
    assert at.text_area(key="decide.state_text").value == "A record I wrote before choosing a schema"
    assert [t.value for t in at.text_input if t.key.endswith(".id")][0] == next(
        iter(SchemaLibrary(workbench / "schemas").load("invoice-triage").questions))
    button(at, "Use this example").click().run()
    assert at.text_area(key="decide.state_text").value != "A record I wrote before choosing a schema"
    assert any("Replaced the state with the example" in i.value for i in at.info)
    button(at, "Undo").click().run()
    no_exceptions(at)
    assert at.text_area(key="decide.state_text").value == "A record I wrote before choosing a schema"


def test_new_schema_drops_the_old_identity(workbench):
    at = start()
    assert button(at, "Update “support-ticket-routing”")
    button(at, "New schema").click().run()
    no_exceptions(at)
    assert not [e.value for e in at.error], "an empty schema is no error (issue 36 point 10): the info says what to do"
    assert any("No questions yet" in i.value for i in at.info)
    assert at.selectbox(key="decide.library_pick").value is None
    assert button(at, "Update").disabled
    assert at.text_input(key="decide.schema_name").value == ""
    assert not [s for s in at.selectbox if s.key == "decide.example_pick"], "the old schema's examples are gone"
    button(at, "Add question").click().run()
    at.text_area(key="decide.q5.instructions").input("Is the customer asking for a refund?").run()
    at.text_input(key="decide.schema_name").input("Refunds").run()
    button(at, "Save as new schema").click().run()
    no_exceptions(at)
    saved = SchemaLibrary(workbench / "schemas").load("refunds")
    assert saved.examples == [] and list(saved.questions) == ["q1"]
    assert at.selectbox(key="decide.library_pick").value == "refunds"
    assert button(at, "Update “refunds”")
    button(at, "Run").click().run()
    assert at.selectbox(key="decide.case_set_pick").value == "New case set…"
    assert at.text_input(key="decide.case_set_new").value == "Refunds cases"


def test_update_refuses_to_undo_a_change_made_to_the_file_since_it_was_loaded(workbench):
    """Decide loaded support-ticket-routing; the Schemas page (another tab) then saved a new version of it. Updating
    from Decide would write the old questions over that version: it is refused, and nothing is written."""
    library = SchemaLibrary(workbench / "schemas")
    at = start()
    button(at, "Update “support-ticket-routing”").click().run()  # nothing moved: the update goes through
    no_exceptions(at)
    loaded = library.load("support-ticket-routing")
    assert any(s.value == f"Updated support-ticket-routing.json (version {loaded.version})." for s in at.success)

    questions = json.loads(json.dumps(loaded.questions))
    first = next(iter(questions))
    questions[first]["instructions"] = "Edited on the Schemas page"
    newer = library.update("support-ticket-routing", dataclasses.replace(loaded, questions=questions))
    assert newer.version == loaded.version + 1
    button(at, "Update “support-ticket-routing”").click().run()
    no_exceptions(at)
    assert any("changed since these questions were loaded from it" in e.value and f"version {newer.version} now"
               in e.value for e in at.error)
    assert library.load("support-ticket-routing").questions[first]["instructions"] == "Edited on the Schemas page"
    assert library.load("support-ticket-routing").version == newer.version


def test_a_run_error_names_the_control_and_goes_when_the_control_changes(workbench):
    at = start()
    at.text_area(key="decide.state_text").input("word " * 3000).run()
    at.selectbox(key="decide.max_length").select(2048).run()
    button(at, "Run").click().run()
    errors = [e.value for e in at.error]
    assert any("truncate the end of the state" in e and "overflow='truncate_state'" not in e for e in errors), errors
    at.selectbox(key="decide.max_length").select(16384).run()
    no_exceptions(at)
    assert not any("over max_length 2,048" in e.value for e in at.error), "the error of another budget is gone"
    button(at, "Run").click().run()
    no_exceptions(at)
    assert [m for m in at.metric if m.label == "Answer"], ([e.value for e in at.error], button(at, "Run").disabled)


def test_a_link_opens_the_schema_it_names_in_decide(workbench):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params["schema"] = "invoice-triage"
    at.run()
    no_exceptions(at)
    library = SchemaLibrary(workbench / "schemas")
    assert [t.value for t in at.text_input if t.key.endswith(".id")] == list(library.load("invoice-triage").questions)
    assert at.selectbox(key="decide.library_pick").value == "invoice-triage"
    value = at.query_params["schema"]
    assert (value[0] if isinstance(value, list) else value) == "invoice-triage"


def test_the_uploaders_state_the_same_size_limits_as_the_caption(workbench):
    from workbench_ui import state_input

    at = start()
    uploaders = {u.key: u.proto.max_upload_size_mb for u in at.get("file_uploader")}
    # images over their limit reach the page's own check, which says why in words (the browser's refusal of a
    # file over an uploader's limit shows only a red icon): the uploaders take what the server does
    assert uploaders == {"decide.images": 64, "decide.videos": 64}
    caption = state_input.media_limits_text()
    assert "20 MB" in caption and f"{uploaders['decide.videos']} MB" in caption


def _in_order(node) -> list:
    """Every element under an AppTest node, in page order."""
    found = [node]
    for child in getattr(node, "children", {}).values():
        found += _in_order(child)
    return found


def _names(node) -> list[str]:
    return [(e.type, getattr(e, "label", None) or getattr(e, "value", None)) for e in _in_order(node)
            if e.type in ("button", "subheader")]


def test_decide_shows_run_and_the_answers_above_the_budget_next_to_the_inputs(workbench):
    at = start()
    button(at, "Run").click().run()
    no_exceptions(at)
    outputs = [c for c in at.columns if ("subheader", "Answers") in _names(c)]
    assert outputs, "the answers are in a column next to the inputs"
    names = _names(outputs[0])
    assert ("subheader", "State") not in names and ("subheader", "Schema") not in names
    run, answers, budget = (names.index(("button", "Run")), names.index(("subheader", "Answers")),
                            names.index(("subheader", "Token budget")))
    assert run < answers < budget, "Run first, then the answers, then the token budget"
    inputs = next(c for c in at.columns if ("subheader", "State") in _names(c))
    assert ("subheader", "Schema") in _names(inputs), "state and schema are both on the input side"


# --- issue 23: answers that say what they are, and Save as case in the right place ----------------------------------


def test_stale_answers_are_marked_with_what_changed(workbench):
    """Point 6: a warning over the answers names the cause (the state, the schema), not a grey caption blaming "the
    editors"; it goes when the inputs are back to what was run."""
    at = start()
    button(at, "Run").click().run()
    no_exceptions(at)
    assert not [w for w in at.warning if "Outdated" in w.value], "fresh answers are not marked"
    original = at.text_area(key="decide.state_text").value
    at.text_area(key="decide.state_text").input(original + " And my order is late.").run()
    outdated = [w.value for w in at.warning if "Outdated" in w.value]
    assert outdated and "the state has changed" in outdated[0] and "schema" not in outdated[0]
    at.text_area(key="decide.q0.instructions").input("Another wording").run()
    assert any("the schema and the state have changed" in w.value for w in at.warning)
    at.text_area(key="decide.state_text").input(original).run()
    outdated = [w.value for w in at.warning if "Outdated" in w.value]
    assert outdated and "the schema has changed" in outdated[0] and "state" not in outdated[0]


def test_save_as_case_uses_the_run_schemas_identity_and_set(workbench):
    """Point 7: the set is created with the library schema's slug (the Case sets page's Settings show it), and after
    another schema is run, Save as case proposes that schema's set, not the previous one's."""
    at = start()
    button(at, "Run").click().run()
    button(at, "Save as case").click().run()
    no_exceptions(at)
    store = Store(workbench / "workbench.sqlite3")
    (case_set,) = store.list_case_sets()
    assert case_set["name"] == "Support ticket routing cases"
    assert case_set["schema_name"] == "support-ticket-routing", "the library identity, not the display name"

    at.selectbox(key="decide.library_pick").select("invoice-triage").run()
    button(at, "Load").click().run()
    button(at, "Run").click().run()
    no_exceptions(at)
    invoice = SchemaLibrary(workbench / "schemas").load("invoice-triage")
    assert at.selectbox(key="decide.case_set_pick").value == "New case set…"
    assert at.text_input(key="decide.case_set_new").value == f"{invoice.name} cases"
    button(at, "Save as case").click().run()
    saved = {s["name"]: s["schema_name"] for s in store.list_case_sets()}
    assert saved[f"{invoice.name} cases"] == "invoice-triage"


def drawn(at: AppTest) -> list[tuple[str, str, str]]:
    """Every element of the page as (kind, key, text), in the order the page draws them."""
    def walk(node):
        children = getattr(node, "children", None)
        if children is None:
            return [(type(node).__name__, str(getattr(node, "key", "") or ""),
                     str(getattr(node, "value", "") or getattr(node, "label", "") or ""))]
        return [item for index in sorted(children) for item in walk(children[index])]
    return walk(at.main)


def test_removing_a_question_can_be_undone_and_unsaved_edits_are_marked(workbench):
    """Point 10: Remove says what went, where it was, with Undo; the schema shows it has unsaved changes."""
    at = start()
    ids = [t.value for t in at.text_input if t.key.endswith(".id")]
    assert not [m for m in at.markdown if "Unsaved changes" in m.value]
    at.button(key="decide.q1.remove").click().run()
    no_exceptions(at)
    assert [t.value for t in at.text_input if t.key.endswith(".id")] == ids[:1] + ids[2:]
    assert any(f"Removed question “{ids[1]}”" in i.value for i in at.info)
    assert any("Unsaved changes" in m.value and "support-ticket-routing" in m.value for m in at.markdown)
    button(at, "Undo").click().run()
    no_exceptions(at)
    assert [t.value for t in at.text_input if t.key.endswith(".id")] == ids
    assert not [m for m in at.markdown if "Unsaved changes" in m.value]


def test_a_duplicate_id_error_is_on_the_card_that_repeats_it(workbench):
    """Point 14: the error sits on the later card (the one just given a used id), not on the first."""
    at = start()
    first = at.text_input(key="decide.q0.id").value
    at.text_input(key="decide.q2.id").input(first).run()
    elements = drawn(at)
    where = [i for i, (kind, _, text) in enumerate(elements) if kind == "Error" and "more than once" in text]
    card = {key: i for i, (_, key, _) in enumerate(elements) if key.endswith(".id")}
    assert len(where) == 1 and card["decide.q2.id"] < where[0] < card["decide.q3.id"], (where, card)


def test_media_come_back_with_the_draft_after_a_reload(workbench):
    """Point 10: an uploaded image is stored with the draft; a reload shows it and the run sends it."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    image = vm.state_input.check_image("red.png", buffer.getvalue())
    state: dict = {}
    vm.Builder(state).set_rows([{"id": "red", "type": "noul", "instructions": "Is the picture red?"}])
    vm.set_kept(state, vm.key("state_text"), "A photo")
    vm.set_media(state, [image])
    saved: list[dict] = []
    vm.save_draft_if_changed(state, saved.append)
    Store(workbench / "workbench.sqlite3").save_draft("decide:tab", saved[-1])

    at = open_with_draft("tab")
    assert any("red.png" in m.value for m in at.markdown), "the kept image is listed with the media"
    button(at, "Run").click().run()
    no_exceptions(at)
    result = at.session_state["decide.result"]
    assert [m.data for m in result.images] == [image.data]
    assert result.request["images"] == [image.data_url()]


def test_the_last_answers_come_back_after_a_reload_and_say_what_changed_since(workbench):
    """Point 10: the answers on screen are kept with the draft: a reload shows them again with the random-weights
    warning; an edit made before the reload marks them outdated, naming the state."""
    at = start()
    token = at.query_params["draft"][0] if isinstance(at.query_params["draft"], list) else at.query_params["draft"]
    button(at, "Run").click().run()
    no_exceptions(at)
    answered = code_json(at, 0)

    reloaded = open_with_draft(token)
    assert [m for m in reloaded.metric if m.label == "Answer"], "the answers are on screen again"
    assert code_json(reloaded, 0) == answered
    assert any("has random weights" in w.value for w in reloaded.warning)
    assert not [w for w in reloaded.warning if "Outdated" in w.value], "nothing changed: not marked outdated"

    reloaded.text_area(key="decide.state_text").input("Another ticket altogether").run()
    again = open_with_draft(reloaded.query_params["draft"][0] if isinstance(reloaded.query_params["draft"], list)
                            else reloaded.query_params["draft"])
    assert code_json(again, 0) == answered
    assert [w.value for w in again.warning if "Outdated" in w.value] == [vm.stale_message(["the state"])]


def test_schemas_feedback_sits_next_to_its_action_and_the_selection_is_kept(workbench):
    """Points 13 and 14: a message appears by the control that caused it (not at the top of the page), and the
    selected schema is still selected after a visit to another page."""
    at = open_schemas(start())
    button(at, "Create").click().run()
    create = next(e for e in at.expander if e.label == "Create a new schema")
    assert [e.value for e in create.error] == ["Give the new schema a name."]
    assert [e.value for e in at.error] == ["Give the new schema a name."], "said once, in the Create section"
    button(at, "Import").click().run()
    imports = next(e for e in at.expander if e.label == "Import a schema file")
    assert [e.value for e in imports.error] == ["Choose a JSON file to import first."]

    at.selectbox(key="schemas.selected").set_value("security-alert-triage").run()
    at.switch_page("pages/decide.py").run()
    no_exceptions(at)
    at.switch_page("pages/schemas.py").run()
    no_exceptions(at)
    assert at.selectbox(key="schemas.selected").value == "security-alert-triage"


def test_a_file_chosen_for_import_with_problems_is_not_reported_as_a_failed_change(workbench):
    """Point 13: before Import is pressed nothing was tried, so the file's problems are a warning saying what to do,
    not a red "Nothing was changed"."""

    at = open_page("pages/cases.py")
    new_case_set(at, "Bad files")
    case_uploader(at).set_value(("broken.jsonl", b'{"state": "fine"}\nthis line is not JSON\n', "application/json"))
    at.run()
    no_exceptions(at)
    assert not [e.value for e in at.error if "Nothing was changed" in e.value]
    assert "This file cannot be imported as it is: 1 problem. Fix it in the file and choose it again." in [
        w.value for w in at.warning]


def test_decide_shows_calibrated_probabilities_labelled_as_such_when_a_calibration_is_chosen(workbench):
    """Issue 26: a calibration fitted for this schema is offered next to the answers; choosing it shows the
    calibrated probabilities on the cards it maps, labelled, and raw stays one choice away."""
    from dataclasses import asdict

    from clef_workbench.calibration import QuestionCalibration

    schema = SchemaLibrary(workbench / "schemas").load("support-ticket-routing").to_dict()
    schema.pop("examples", None)
    store = Store(workbench / "workbench.sqlite3")
    set_id = store.create_case_set("labelled")
    store.add_cases(set_id, [{"state": "a ticket"}])
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo")
    flatten = QuestionCalibration("churn_threat", "noul", "platt", a=0.0, b=0.0)  # every answer becomes 0.5
    store.save_calibration("flat churn", store.get_run(run_id),
                           {"questions": {"churn_threat": asdict(flatten)}, "report": []})

    at = start()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    raw_help = [m.help for m in at.metric if m.label == "Answer"]
    at.selectbox(key="decide.calibration").select("flat churn").run()
    no_exceptions(at)
    assert any("Calibrated with “flat churn”" in c.value for c in at.caption)
    labelled = [m.value for m in at.markdown if "· **calibrated**" in m.value]
    assert labelled == [next(m.value for m in at.markdown if m.value.startswith("**churn_threat**"))]
    helps = [m.help for m in at.metric if m.label == "Answer"]
    changed = [(a, b) for a, b in zip(raw_help, helps, strict=True) if a != b]
    assert changed and all(b == "P(true) = 0.5000" for _, b in changed)
    at.selectbox(key="decide.calibration").select("raw (as the model answered)").run()
    assert [m.help for m in at.metric if m.label == "Answer"] == raw_help
    assert not any("· **calibrated**" in m.value for m in at.markdown)


def test_the_schemas_page_opens_the_linked_or_the_last_edited_schema(workbench):
    """Issue 36 point 10: ?schema= opens that schema (a link to a missing one says so and opens none); without a
    link, the last edited one; a save on the Decide page makes it the one the Schemas page shows."""
    library = SchemaLibrary(workbench / "schemas")
    edited = library.load("security-alert-triage")
    edited.description = "Edited last."
    library.update("security-alert-triage", edited)
    at = start()
    at.query_params.clear()  # as the sidebar's link opens the page (Decide's URL names its own schema)
    open_schemas(at)
    assert at.selectbox(key="schemas.selected").value == "security-alert-triage", "the last edited"
    assert at.query_params["schema"] in ("security-alert-triage", ["security-alert-triage"])

    linked = AppTest.from_file(APP, default_timeout=TIMEOUT)
    linked.run()
    linked.query_params["schema"] = "invoice-triage"
    assert open_schemas(linked).selectbox(key="schemas.selected").value == "invoice-triage"
    missing = AppTest.from_file(APP, default_timeout=TIMEOUT)
    missing.run()
    missing.query_params["schema"] = "no-such-schema"
    open_schemas(missing)
    assert any("Not found: the link asks for the schema “no-such-schema”" in e.value for e in missing.error)
    assert not [s for s in missing.selectbox if s.key == "schemas.selected"], "no other schema in its place"
    button(missing, "Open the library").click().run()  # not a dead end: the page's own choice opens
    no_exceptions(missing)
    assert missing.selectbox(key="schemas.selected").value in library.slugs() and not missing.error

    at.switch_page("pages/decide.py")
    at.run()
    at.text_input(key="decide.schema_name").input("Refund triage").run()
    button(at, "Save as new schema").click().run()
    no_exceptions(at)
    assert open_schemas(at).selectbox(key="schemas.selected").value == "refund-triage"


def test_every_page_reads_a_read_only_database_and_decide_runs_without_saving(workbench, monkeypatch):
    """The store opens a file this user cannot write read-only (SQLite's mode=ro, which refuses writes to root too,
    so the test runs as root with the file reported unwritable): no page may write just by being opened or run."""
    store = Store(workbench / "workbench.sqlite3")
    store.add_cases(store.create_case_set("tickets"), [{"state": "my invoice is wrong", "source_id": "T-1"}])
    store.close()
    monkeypatch.setattr("clef_workbench.store.base._writable", lambda path: False)
    at = start()
    assert [w.value for w in at.sidebar.warning] == [
        "The database workbench.sqlite3 is read-only for this user: you can look at everything, nothing is saved."]
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    assert [m for m in at.metric if m.label == "Answer"]
    for page in ("cases", "runs", "review", "compare", "schemas"):
        at.switch_page(f"pages/{page}.py")
        at.run()
        assert not at.exception, (page, [(e.message, e.stack_trace[-4:]) for e in at.exception])
    assert shell.get_store().read_only
