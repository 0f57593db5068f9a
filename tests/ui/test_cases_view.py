"""The Case sets page's view-model: what a user reads about a case set, an import's columns and its outcome, and
what a delete and its undo say; on a real store, the shipped schemas and a realistic CSV export."""

from __future__ import annotations

import json

from clef_workbench import case_table, casesets, importing, stats
from tests.support import REPO
from workbench_ui import cases_view as view
from workbench_ui import units

TICKETS_CSV = (
    "ticket_id,subject,body,team,tags\n"
    "T-1,Refund,\"I was charged twice for March, please refund.\",billing,vip\n"
    "T-2,Crash,The app closes when I open settings.,tech,\n"
    "T-3,Login,\"Café owner here: the password reset mail never arrives.\",tech,urgent\n"
).encode()


def test_a_case_set_reads_with_its_count_schema_and_dates(store):
    set_id = store.create_case_set("Tickets", schema_name="support-ticket-routing", description="March export")
    store.add_case(set_id, state="I was charged twice.")
    case_set = store.get_case_set(set_id)

    assert view.case_set_label(case_set) == "Tickets (1 cases)"
    caption = view.case_set_caption(case_set)
    assert caption.startswith("Schema: **support-ticket-routing** · 1 cases · created ")
    assert caption.endswith(" · March export") and "T" not in caption.split("created ")[1][:19]

    store.delete_case_set(set_id)
    deleted = store.list_case_sets(deleted=True)[0]
    label = view.deleted_set_label(deleted)
    assert label.startswith("Tickets · 1 cases · deleted ") and label.endswith(" UTC")


def test_the_schema_of_a_set_loads_or_says_why_its_answers_go_unchecked(library):
    schema, warning = view.case_set_schema(library, "support-ticket-routing")
    assert warning is None and schema == library.load("support-ticket-routing").to_dict()
    assert view.case_set_schema(library, None) == (None, None)
    assert view.case_set_schema(library, "not-in-the-library") == (None, None)

    (library.directory / "broken.json").write_text('{"name": "Broken", "questions": 3}', encoding="utf-8")
    schema, warning = view.case_set_schema(library, "broken")
    assert schema is None
    assert warning.startswith("Schema 'broken' does not load, so expected answers are not checked: broken.json: ")

    slugs = library.slugs()
    assert view.schema_pick({"schema_name": "invoice-triage"}, slugs) == "invoice-triage"
    assert view.schema_pick({"schema_name": "gone"}, slugs) == "(none)"
    assert view.schema_pick({"schema_name": None}, slugs) == "(none)"


def test_the_import_mapping_warns_when_an_answer_column_is_in_the_state():
    source = importing.read_source("tickets.csv", TICKETS_CSV)
    columns = source.columns
    assert view.mapped_index(columns, "tags") == 1 + columns.index("tags")
    assert view.mapped_index(["subject", "body"], "tags") == 0
    guessed = importing.guess_expected_columns(columns, ["team"])
    assert [view.NOT_MAPPED, *columns][view.mapped_index(columns, guessed.get("team"))] == "team"

    chosen = view.ImportMapping(columns, ["team"], expected={"team": "team"}, tags_column="tags")
    assert chosen.used == {"team", "tags"}
    kind, text = chosen.state_warning(["subject", "body", "team"])
    assert kind == "warning" and "so the model reads the answer: team." in text
    kind, text = chosen.state_warning(["subject", "body"])
    assert (kind, text) == ("caption", "Left out of the state because they look like answers: `team`")
    assert view.ImportMapping(["subject", "body"], ["team"]).state_warning(["body"]) is None

    mapping = chosen.mapping(state_columns=["subject", "body"])
    cases = importing.parse_cases(source, mapping, None)
    preview = view.preview_rows(cases)
    assert [row["tags"] for row in preview] == ["vip", "", "urgent"]
    assert json.loads(preview[2]["state"]) == {"subject": "Login",
                                               "body": "Café owner here: the password reset mail never arrives."}
    assert preview[0]["expected"] == {"team": "billing"} and preview[0]["images"] == 0
    whole = chosen.mapping(state_text_column="body")
    assert (whole.state_text_column, whole.tags_column, whole.expected_columns) == ("body", "tags", {"team": "team"})
    assert view.ImportMapping(columns, []).mapping(state_columns=["body"]).tags_column is None


def test_an_import_says_what_went_in_what_was_there_and_which_rows_were_left_out():
    assert view.imported_message("Tickets", 3, 3, None) == ("success", "Imported 3 cases into “Tickets”.")
    assert view.imported_message("Tickets", 3, 1, [4, 9]) == ("success", (
        "Imported 1 case into “Tickets”. 2 were already in it and skipped. Rows not imported, as agreed: 4, 9."))
    # a file imported twice: nothing new is information, never a green "Imported 0 cases"
    assert view.imported_message("Tickets", 10, 0, None) == (
        "info", "Nothing new to import: all 10 are already in “Tickets”.")
    many = [f"row {n}: empty state" for n in range(2, 60)]
    listed = view.problems_markdown(many).splitlines()
    assert len(listed) == 51 and listed[-1] == "- … and 8 more"
    assert view.problems_markdown(["a", "b"]) == "- a\n- b"
    assert view.export_stem("Tickets — EU, March 2026!") == "tickets-eu-march-2026"
    assert view.export_stem("—") == "cases"


def test_a_delete_is_refused_while_runs_exist_and_an_undo_says_what_came_back(store):
    set_id = store.create_case_set("Tickets")
    case_ids = [store.add_case(set_id, state=f"ticket {n}") for n in range(3)]
    case_set = store.get_case_set(set_id)
    assert view.delete_refusal(case_set, []) is None
    assert view.delete_refusal(case_set, [{"id": 7}]) == (
        "“Tickets” cannot be deleted: it has 1 run. Delete it on the Runs page first.")
    assert view.delete_refusal(case_set, [{"id": 7}, {"id": 8}]) == (
        "“Tickets” cannot be deleted: it has 2 runs. Delete them on the Runs page first.")

    for case_id in case_ids[:2]:
        store.delete_case(case_id)
    assert view.restore_deleted(store, "cases", case_ids[:2]) == ("success", "Restored 2 case(s).")
    assert store.get_case_set(set_id)["case_count"] == 3
    store.delete_case_set(set_id)
    assert view.restore_deleted(store, "case_set", set_id) == ("success", f"Restored case set #{set_id}.")
    kind, text = view.restore_deleted(store, "case_set", set_id)  # restored already: said, nothing breaks
    assert (kind, text) == ("error", f"Not restored: case set {set_id} is not deleted")


def test_an_id_column_is_the_cases_source_id_not_evidence_and_a_row_without_evidence_is_a_bad_row(store):
    """Issue 36, point 6: `ticket_id` was suggested as state, so the model read it and a row with an empty subject
    and body imported as {"ticket_id": "T-4"}."""
    source = importing.read_source("tickets.csv", TICKETS_CSV + b"T-4,,,billing,\n")
    columns = source.columns
    assert importing.id_like_columns(columns)[0] == "ticket_id"
    chosen = view.ImportMapping(columns, ["team"], expected={"team": "team"}, tags_column="tags",
                                id_column="ticket_id")
    suggested = chosen.suggested_state()
    assert suggested == ["subject", "body"]
    mapping = chosen.mapping(state_columns=suggested)
    assert [str(bad) for bad in importing.bad_rows(source, mapping)] == [
        "row 5: the state is empty (subject, body have no value)"]

    cases = importing.parse_cases(source, mapping, None, skip_bad_rows=True)
    assert [c["source_id"] for c in cases] == ["T-1", "T-2", "T-3"]
    assert all("ticket_id" not in c["state"] for c in cases)
    assert view.preview_rows(cases)[0]["source id"] == "T-1"
    set_id = store.create_case_set("Tickets")
    store.add_cases(set_id, cases)
    assert [c["source_id"] for c in store.list_cases(set_id)] == ["T-1", "T-2", "T-3"]
    # kept in the export, and read back from it as the source id again
    exported = casesets.export_csv(store, set_id)
    assert exported.splitlines()[0].startswith("\ufeffid,source_id,state.subject,state.body,")
    again = importing.read_source("export.csv", exported.encode())
    assert view.ImportMapping(again.columns, []).suggested_state() == ["state.subject", "state.body", "tags",
                                                                       "images", "videos"]
    jsonl = casesets.export_jsonl(store, set_id)
    assert [c["source_id"] for c in casesets.parse_jsonl(jsonl)] == ["T-1", "T-2", "T-3"]
    # shown in a run's results and in its exports
    schema = {"name": "t", "questions": {"urgent": {"type": "noul"}}}
    run_id = store.create_run(set_id, schema=schema, model_id="m")
    store.record_results(run_id, [{"case_id": c["id"], "latency_ms": 1, "input_tokens": 3, "response": {
        "model": "m", "answers": {"urgent": {"type": "noul", "noul": 0.7}}, "usage": {"input_tokens": 3}}}
        for c in store.list_cases(set_id)])
    assert stats.browse_table(store.list_results(run_id), schema)["source id"].tolist() == ["T-1", "T-2", "T-3"]
    assert casesets.results_table(store, run_id)["source_id"].tolist() == ["T-1", "T-2", "T-3"]
    assert '"source_id": "T-1"' in casesets.export_results_jsonl(store, run_id).splitlines()[0]
    # two tickets with the same words are two cases; the same ticket imported again is not added twice
    twin = [{**cases[0], "source_id": "T-9"}]
    assert len(store.add_cases(set_id, twin, skip_existing=True)) == 1
    assert store.add_cases(set_id, cases, skip_existing=True) == []


def test_before_a_state_is_chosen_the_advice_names_the_controls_that_fix_it():
    columns = importing.read_source("tickets.csv", TICKETS_CSV).columns
    candidates = view.ImportMapping(columns, ["team"], expected={"team": "team"}).suggested_state()
    advice = view.state_choice_advice(candidates)
    assert "“Columns that become state fields” above" in advice
    assert f"“{view.suggest_button_label(candidates)}”" in advice
    assert "file" not in advice, "nothing in the file needs fixing"
    assert view.problems_heading(2, stage="cells").startswith(
        "These rows cannot be imported with this mapping: 2 problems. Change the mapping above")
    assert view.problems_heading(1, stage="read") == "This file cannot be read as it is: 1 problem."
    assert view.problems_heading(2, stage="file").startswith("This file cannot be imported as it is: 2 problems.")
    assert view.problems_heading(3, stage="save") == "Nothing was changed: 3 problems."


def test_without_a_schema_columns_named_after_the_librarys_questions_are_answers_not_evidence(library):
    """examples/tickets.csv carries its gold labels (team, priority, customer_mood…) beside the ticket: imported
    into a case set without a schema, they were offered as the state, so the model read what it is scored on."""
    columns = importing.read_source("tickets.csv", (REPO / "examples" / "tickets.csv").read_bytes()).columns
    answers = view.library_question_ids(library)
    assert {"team", "priority", "customer_mood", "churn_threat", "needs_human_agent"} <= set(answers)
    chosen = view.ImportMapping(columns, [], tags_column="tags", answer_names=answers)
    assert chosen.suggested_state() == ["from", "subject", "plan", "body"]
    assert chosen.state_warning(["subject", "body"])[0] == "caption"
    kind, text = chosen.state_warning(["subject", "body", "team"])  # asked for on purpose: allowed, and said
    assert kind == "warning" and "the model reads the answer: team." in text


def test_an_action_the_store_refuses_gives_its_reason_never_a_traceback(store, library):
    new_id, refused = units.refusal(store.create_case_set, "Tickets", schema_name="support-ticket-routing")
    assert refused is None and store.get_case_set(new_id)["name"] == "Tickets"
    assert units.refusal(store.create_case_set, "Tickets") == (
        None, "a case set named 'Tickets' already exists; choose another name")
    assert units.refusal(store.delete_case_set, 999) == (None, "case set 999 does not exist")
    assert view.load_examples(store, library) == f"Example case sets ready: {len(library.slugs())}."


def test_a_file_is_read_parsed_and_imported_or_says_what_is_wrong(store):
    set_id = store.create_case_set("Tickets")
    source, problems = view.read_file("tickets.csv", TICKETS_CSV, None, None)
    assert problems == [] and view.read_caption(source).startswith("Read as **")
    assert view.read_file("empty.csv", b"", None, None) == (None, ["empty.csv is empty"])
    mapping = view.ImportMapping(source.columns, [], tags_column="tags", id_column="ticket_id").mapping(
        state_columns=["subject", "body"])
    parsed, problems = view.parse_file(source, mapping, None, skip_bad_rows=False)
    assert problems == [] and [c["source_id"] for c in parsed] == ["T-1", "T-2", "T-3"]
    added, refused = view.import_parsed(store, set_id, parsed)
    assert len(added) == 3 and refused is None
    assert view.import_parsed(store, set_id, parsed) == ([], None)  # already there: skipped
    ragged, _ = view.read_file("tickets.csv", TICKETS_CSV + b"T-4,,\n", None, None)
    assert view.parse_file(ragged, mapping, None, skip_bad_rows=False) == ([], [])  # listed apart, with the skip box
    assert len(view.parse_file(ragged, mapping, None, skip_bad_rows=True)[0]) == 3
    files = view.export_files(store, store.get_case_set(set_id))
    assert files.stem == "tickets" and len(files.jsonl.splitlines()) == 3 and "T-2" in files.csv


def test_a_table_save_refused_keeps_the_rows_of_cases_with_runs_and_says_why(store):
    set_id = store.create_case_set("Tickets")
    kept, gone = store.add_case(set_id, state="ticket 1"), store.add_case(set_id, state="ticket 2")
    store.create_run(set_id, schema={"name": "t", "questions": {"urgent": {"type": "noul"}}}, model_id="m")
    frame = case_table.editor_frame(store, set_id)
    refused = view.save_edits(store, set_id, frame[frame["id"] != gone], None)
    assert isinstance(refused, view.SaveRefused) and refused.kept_case_ids == [gone]
    assert view.kept_rows_message(refused).endswith("Delete its runs first. The rows are back in the table; your "
                                                    "other edits are still there, not saved.")
    bad = frame.assign(expected=['{"team": ', ""])
    refused = view.save_edits(store, set_id, bad, None)
    assert isinstance(refused, view.SaveRefused) and refused.kept_case_ids is None and len(refused.problems) == 1
    saved = view.save_edits(store, set_id, frame.assign(tags=["vip", ""]), None)
    assert saved.summary() == "Saved: 0 added, 1 updated, 0 deleted."
    assert store.get_case(kept)["tags"] == ["vip"]
