"""The Case sets page's Import tab through Streamlit's AppTest with files people export (issue 23, point 2): the
encoding it read a file in is shown and can be changed, rows that do not fit are listed by row number and nothing is
imported until skipping them is confirmed."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from clef_engine import protocol
from clef_workbench import review
from clef_workbench.review import ReviewRules
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import Store
from tests.support.apptest import button, case_uploader, new_case_set, no_exceptions, open_page, texts
from tests.support.import_files import KINDS, RAGGED, expected_cases, stored


def upload(at: AppTest, name: str, data: bytes) -> AppTest:
    case_uploader(at).set_value((name, data, "text/csv"))
    at.run()
    no_exceptions(at)
    return at


def import_buttons(at: AppTest) -> list[str]:
    return [b.label for b in at.button if b.label.startswith("Import ")]


def test_a_latin_1_file_shows_its_encoding_and_imports_its_accents_exactly(workbench):
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Tickets")
    file = KINDS["latin-1"]
    upload(at, file.file_name, file.data)
    assert "Read as **Latin-1 (ISO-8859-1), comma-separated, 3 rows** (detected)." in texts(at)

    # told the wrong encoding, the page names the line of the first bad byte and offers no Import
    (encoding,) = [s for s in at.selectbox if (s.key or "").startswith("cases.read.encoding.")]
    encoding.select("utf-8")
    at.run()
    no_exceptions(at)
    assert "line 2: byte 0xe9 is not valid UTF-8; choose the encoding the file was saved in" in texts(at)
    assert import_buttons(at) == []
    [s for s in at.selectbox if (s.key or "").startswith("cases.read.encoding.")][0].select("detected")
    at.run()

    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    button(at, "Import 3 cases").click()
    at.run()
    no_exceptions(at)
    assert "Imported 3 cases into “Tickets”." in texts(at)
    assert stored(store, set_id) == expected_cases(file.rows), "names such as “José Núñez” arrive as written"


def test_a_ragged_file_lists_its_bad_rows_and_imports_nothing_until_skipping_them_is_confirmed(workbench):
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Tickets")
    upload(at, "tickets.csv", RAGGED.encode())
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    no_exceptions(at)
    assert "row 3: 2 cells where the header has 4 columns" in texts(at)
    assert "row 4: 5 cells where the header has 4 columns" in texts(at)
    assert import_buttons(at) == [], "no Import while rows that do not fit are in the file"
    assert store.get_case_set(set_id)["case_count"] == 0

    (skip,) = [c for c in at.checkbox if c.label.startswith("Skip these 2 row(s)")]
    skip.check()
    at.run()
    no_exceptions(at)
    button(at, "Import 2 cases").click()
    at.run()
    no_exceptions(at)
    assert "Imported 2 cases into “Tickets”. Rows not imported, as agreed: 3, 4." in texts(at)
    assert [c["state"] for c in store.list_cases(set_id)] == [
        {"subject": "Refund", "body": "I was charged twice, please help"},
        {"subject": "Invoice", "body": "Wrong VAT number on INV-88"}]


def test_excel_unicode_text_is_read_as_tab_separated_utf_16(workbench):
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Tickets")
    file = KINDS["excel unicode text"]
    upload(at, file.file_name, file.data)
    assert "Read as **UTF-16 with BOM, tab-separated, 5 rows** (detected)." in texts(at)
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    button(at, "Import 5 cases").click()
    at.run()
    no_exceptions(at)
    assert stored(store, set_id) == expected_cases(file.rows)


TICKETS_WITH_IDS = (
    b"ticket_id,subject,body,team\n"
    b"T-1,Refund,I was charged twice,billing\n"
    b"T-2,Crash,The app closes when I open settings,technical_support\n"
    b"T-4,,,billing\n"
)


def test_an_id_column_becomes_the_cases_source_id_and_the_advice_points_at_the_mapping(workbench):
    """Issue 36, point 6, on the page: right after a good file is chosen nothing says to fix the file; `ticket_id`
    is the cases' source id, not evidence, so the row with no subject or body is a bad row; the same file imported
    again says nothing new came in, not a green "Imported 0 cases"."""
    store = Store(workbench / "workbench.sqlite3")
    at = open_page("pages/cases.py")
    set_id = new_case_set(at, "Tickets")
    upload(at, "tickets.csv", TICKETS_WITH_IDS)
    assert "cannot be imported" not in texts(at) and "Fix them in the file" not in texts(at)
    assert "Choose the columns the model reads in “Columns that become state fields” above" in texts(at)
    (source_id,) = [s for s in at.selectbox if s.label == "Source id column"]
    assert source_id.value == "ticket_id"

    button(at, "Use the 2 column(s) that are not mapped or labels: subject, body").click()
    at.run()
    no_exceptions(at)
    assert "row 4: the state is empty (subject, body have no value)" in texts(at)
    (skip,) = [c for c in at.checkbox if c.label.startswith("Skip these 1 row(s)")]
    skip.check()
    at.run()
    button(at, "Import 2 cases").click()
    at.run()
    no_exceptions(at)
    assert "Imported 2 cases into “Tickets”. Rows not imported, as agreed: 4." in [m.value for m in at.success]
    assert [(c["source_id"], c["state"]) for c in store.list_cases(set_id)] == [
        ("T-1", {"subject": "Refund", "body": "I was charged twice"}),
        ("T-2", {"subject": "Crash", "body": "The app closes when I open settings"})]

    upload(at, "tickets.csv", TICKETS_WITH_IDS)
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    [c for c in at.checkbox if c.label.startswith("Skip these 1 row(s)")][0].check()
    at.run()
    button(at, "Import 2 cases").click()
    at.run()
    no_exceptions(at)
    assert not [m.value for m in at.success if "Imported" in m.value]
    assert "Nothing new to import: all 2 are already in “Tickets”. Rows not imported, as agreed: 4." in [
        i.value for i in at.info]
    assert store.get_case_set(set_id)["case_count"] == 2

    # ids repeated in the file are bad rows naming the row they repeat; an id the case set has is refused naming it
    upload(at, "more.csv", b"ticket_id,subject,body\nT-1,Refund,Edited since\nT-3,Login,No code\nT-3,Login,Again\n")
    button(at, "Use the 2 column(s)", startswith=True).click()
    at.run()
    assert "row 4: its id 'T-3' is row 3's too (an id names one case)" in texts(at)
    [c for c in at.checkbox if c.label.startswith("Skip these 1 row(s)")][0].check()
    at.run()
    button(at, "Import 2 cases").click()
    at.run()
    no_exceptions(at)
    first = store.list_cases(set_id)[0]["id"]
    assert [e.value for e in at.error] == [f"Nothing imported: the id 'T-1' is already case {first}'s in this case "
                                           "set (an id names one case); give the new case another id, or edit or "
                                           f"delete case {first} first"]
    assert store.get_case_set(set_id)["case_count"] == 2


def test_the_source_id_follows_the_case_to_its_review_card(workbench):
    store = Store(workbench / "workbench.sqlite3")
    schema = SchemaLibrary(workbench / "schemas").load("support-ticket-routing").to_dict()
    schema.pop("examples", None)
    set_id = store.create_case_set("Tickets", schema_name="support-ticket-routing")
    (case_id,) = store.add_cases(set_id, [{"state": "I was charged twice", "source_id": "T-42"}])
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo")
    answers = {q.id: protocol.format_answer(q, [1 / len(q.option_ids)] * len(q.option_ids))
               for q in protocol.prepare_questions(schema["questions"])}
    store.record_results(run_id, [{"case_id": case_id, "latency_ms": 5, "input_tokens": 9, "response": {
        "model": "clef-demo", "answers": answers, "usage": {"input_tokens": 9, "output_tokens": 0}}}])
    store.set_run_status(run_id, "finished")
    rules = ReviewRules(margin_below=1.0, unknown_option=False, disagree_with_expected=False, questions=["team"])
    assert review.apply_rules(store, run_id, rules) == 1
    at = open_page("pages/review.py")
    assert "Source id: T-42" in texts(at)
