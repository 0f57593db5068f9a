"""Case set import (CSV with column mapping, JSONL), export, results export and request building."""

from __future__ import annotations

import base64
import codecs
import csv
import io
import json

import pytest

from clef_workbench import case_table, casesets, importing
from clef_workbench.casesets import CaseImportError, CsvMapping
from clef_workbench.store import Store
from tests.support import REPO

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
SCHEMA = {"name": "tickets", "version": "2", "questions": {
    "team": {"type": "choice", "instructions": "Team?", "criteria": {"billing": "Money", "tech": None}},
    "urgent": {"type": "noul", "instructions": "Urgent?"},
    "priority": {"type": "score", "instructions": "Priority?", "criteria": ["low", "mid", "high"]},
}}

CSV_TEXT = """subject,body,customer.tier,seats,team_label,urgent_label,prio,labels
Refund,I was charged twice,gold,12,billing,yes,2,money; angry
Login,App shows error 500,,3,tech,no,1,
"""


def parse_csv(text, mapping, schema, **options):
    """Comma-separated text read as the import reads a file, every row required to fit."""
    return importing.parse_cases(importing.read_delimited(text, ","), mapping, schema, **options)


def test_csv_import_maps_columns_to_state_and_expected(tmp_path):
    mapping = CsvMapping(state_columns=["subject", "body", "customer.tier", "seats"],
                         expected_columns={"team_label": "team", "urgent_label": "urgent", "prio": "priority"},
                         tags_column="labels")
    cases = parse_csv(CSV_TEXT, mapping, SCHEMA)
    assert cases[0]["state"] == {"subject": "Refund", "body": "I was charged twice", "customer": {"tier": "gold"},
                                 "seats": 12}
    assert cases[0]["expected"] == {"team": "billing", "urgent": True, "priority": 2}
    assert cases[0]["tags"] == ["money", "angry"]
    assert "customer" not in cases[1]["state"]  # empty cell left out
    assert cases[1]["expected"] == {"team": "tech", "urgent": False, "priority": 1}

    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets", schema_name="tickets")
    casesets.import_cases(store, set_id, cases)
    table = casesets.cases_table(store, set_id)
    assert list(table["state.subject"]) == ["Refund", "Login"]
    assert list(table["expected.team"]) == ["billing", "tech"]
    exported = list(csv.DictReader(io.StringIO(casesets.export_csv(store, set_id).encode().decode("utf-8-sig"))))
    assert exported[0]["tags"] == "money; angry" and exported[0]["expected.urgent"] == "True"


def test_csv_import_names_every_bad_cell_and_imports_nothing():
    bad = CSV_TEXT + "Spam,buy now,,1,sales,maybe,7,\n"
    mapping = CsvMapping(state_columns=["subject"], expected_columns={"team_label": "team", "urgent_label": "urgent",
                                                                      "prio": "priority"})
    with pytest.raises(CaseImportError) as error:
        parse_csv(bad, mapping, SCHEMA)
    problems = error.value.problems
    assert len(problems) == 3
    assert problems[0].startswith("row 4, column 'team_label': 'sales' is not an option of question 'team'")
    assert "row 4, column 'urgent_label'" in problems[1] and "yes/no" in problems[1]
    assert "row 4, column 'prio': level 7 is out of range" in problems[2]


def test_csv_mapping_errors_name_the_column():
    with pytest.raises(CaseImportError, match="column 'nope' is not in the CSV"):
        parse_csv(CSV_TEXT, CsvMapping(state_columns=["nope"]), SCHEMA)
    with pytest.raises(CaseImportError, match="mapped to question 'sla', which the schema 'tickets' does not have"):
        parse_csv(CSV_TEXT, CsvMapping(state_columns=["body"], expected_columns={"prio": "sla"}), SCHEMA)


def test_csv_text_state_column_and_image_paths(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    text = 'state,photo\n"{""x"": 1}",a.png\nplain words,\n'
    cases = parse_csv(text, CsvMapping(state_text_column="state", image_columns=["photo"]), None,
                               base_dir=tmp_path)
    assert cases[0]["state"] == {"x": 1} and cases[0]["images"] == [PNG]
    assert cases[1]["state"] == "plain words" and cases[1]["images"] == []
    with pytest.raises(CaseImportError, match="row 2, column 'photo': image file .*b.png' not found"):
        parse_csv("state,photo\nx,b.png\n", CsvMapping(state_text_column="state", image_columns=["photo"]),
                           None, base_dir=tmp_path)


def test_jsonl_round_trip_keeps_media_and_expected(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("a")
    store.add_case(set_id, state={"k": "v"}, images=[PNG], expected={"urgent": True, "priority": 0}, tags=["t"])
    store.add_case(set_id, state="text state", expected={"team": "tech"})
    text = casesets.export_jsonl(store, set_id)
    cases = casesets.parse_jsonl(text, SCHEMA)
    assert cases[0]["images"] == [PNG] and cases[0]["expected"] == {"urgent": True, "priority": 0}
    assert cases[1]["state"] == "text state" and cases[1]["tags"] == []
    copy_id = store.create_case_set("b")
    casesets.import_cases(store, copy_id, cases)
    assert casesets.export_jsonl(store, copy_id) == text


def test_jsonl_errors_name_line_and_field():
    good = json.dumps({"state": 1, "images": [{"content_type": "image/png", "base64": base64.b64encode(PNG).decode()}]})
    text = "\n".join([good, "{not json", json.dumps({"nostate": 1}),
                      json.dumps({"state": 1, "expected": {"team": "hr"}})])
    with pytest.raises(CaseImportError) as error:
        casesets.parse_jsonl(text, SCHEMA)
    problems = error.value.problems
    assert problems[0].startswith("line 2: not JSON")
    assert problems[1] == "line 3: each line must be an object with a 'state' field"
    assert problems[2].startswith("line 4, expected.team: 'hr' is not an option")


def test_build_request_keeps_stored_media_as_bytes_which_a_remote_engine_sends_as_data_urls(tmp_path):
    from clef_engine.remote import media_for_wire

    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("a")
    case_id = store.add_case(set_id, state={"k": 1}, images=[PNG])
    request = casesets.build_request(store.get_case(case_id), SCHEMA, model="clef-flash")
    assert request["model"] == "clef-flash" and request["state"] == {"k": 1}
    assert request["questions"] is SCHEMA["questions"]
    assert request["images"] == [PNG]  # in process: no base64 round trip
    assert "videos" not in request
    assert media_for_wire(request)["images"] == ["data:image/png;base64," + base64.b64encode(PNG).decode()]


def test_results_export_has_one_row_per_case_and_question_with_every_probability(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("a")
    ok_case, bad_case = store.add_cases(set_id, [{"state": 1, "expected": {"team": "tech"}}, {"state": 2}])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo")
    response = {"answers": {
        "team": {"type": "choice", "choice": "billing", "confidence": 0.7,
                 "probabilities": {"billing": 0.7, "tech": 0.3}},
        "urgent": {"type": "noul", "noul": 0.25},
        "priority": {"type": "score", "score": 1.1, "confidence": 0.5,
                     "probabilities": {"0": 0.2, "1": 0.5, "2": 0.3}},
    }, "usage": {"input_tokens": 50}}
    store.record_results(run_id, [{"case_id": ok_case, "response": response, "latency_ms": 12, "input_tokens": 50},
                                  {"case_id": bad_case, "error": "RequestError: images: too many"}])
    table = casesets.results_table(store, run_id)
    answered = table[table["error"].isna()].set_index("question_id")
    assert len(answered) == 3
    assert answered.loc["team", "p:billing"] == 0.7 and answered.loc["team", "p:tech"] == 0.3
    assert answered.loc["team", "correct"] == 0.0
    assert answered.loc["urgent", "p:true"] == 0.25 and answered.loc["urgent", "p:false"] == 0.75
    assert answered.loc["priority", "p:2"] == 0.3 and answered.loc["priority", "score"] == 1.1
    assert table[table["error"].notna()]["case_id"].tolist() == [bad_case]
    lines = [json.loads(line) for line in casesets.export_results_jsonl(store, run_id).splitlines()]
    assert lines[0]["probabilities"] == {"billing": 0.7, "tech": 0.3} and lines[0]["correct"] is False
    assert lines[-1] == {"run_id": run_id, "case_id": bad_case, "source_id": None,
                         "error": "RequestError: images: too many"}
    assert "p:billing" in casesets.export_results_csv(store, run_id).splitlines()[0]


def test_shipped_example_case_sets_load_with_expected_answers_for_their_schemas(tmp_path):
    store = Store(tmp_path / "w.db")
    loaded = casesets.load_example_case_sets(store, REPO / "schemas")
    assert set(loaded) == {p.stem for p in (REPO / "examples" / "casesets").glob("*.jsonl")}
    assert len(loaded) == 4
    for slug, set_id in loaded.items():
        schema = json.loads((REPO / "schemas" / f"{slug}.json").read_text())
        cases = store.list_cases(set_id)
        assert 8 <= len(cases) <= 12, slug
        for case in cases:  # parse_jsonl already checked every answer against the schema's options
            assert case["expected"] and set(case["expected"]) <= set(schema["questions"]), slug
        assert store.get_case_set(set_id)["schema_name"] == slug
    photos = store.list_cases(loaded["vehicle-damage-claim-photo"])
    assert all(case["image_count"] == 1 for case in photos)
    assert casesets.load_example_case_sets(store, REPO / "schemas") == loaded  # idempotent


def test_table_edits_update_add_and_delete_and_refuse_bad_rows(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("t", schema_name="tickets")
    first, second = store.add_cases(set_id, [{"state": {"a": 1}}, {"state": "plain"}])
    table = case_table.editor_frame(store, set_id)
    assert list(table["state"]) == ['{"a": 1}', "plain"]
    bad = table.copy()
    bad.loc[0, "state"] = '{"a": '
    bad.loc[1, "expected"] = '{"team": "hr"}'
    with pytest.raises(CaseImportError) as error:
        case_table.apply_case_edits(store, set_id, bad, SCHEMA)
    assert error.value.problems[0].startswith("row 1, state: looks like JSON but does not parse")
    assert error.value.problems[1].startswith("row 2, expected: 'hr' is not an option of question 'team'")
    assert store.get_case(first)["state"] == {"a": 1}  # nothing written
    unchanged = case_table.apply_case_edits(store, set_id, table, SCHEMA)
    assert not unchanged.changed and unchanged.summary() == "Nothing to save: the table has no changes."

    edited = table.copy()
    edited.loc[0, "expected"] = '{"urgent": "yes", "priority": 2}'
    edited.loc[0, "tags"] = "vip, late"
    edited = edited.drop(index=1)
    edited.loc[len(edited) + 5] = {"id": None, "state": "new ticket", "expected": "", "tags": "", "images": 0,
                                   "videos": 0}
    edits = case_table.apply_case_edits(store, set_id, edited, SCHEMA)
    assert (edits.added, edits.updated, edits.deleted) == (1, 1, [second])
    assert edits.summary() == "Saved: 1 added, 1 updated, 1 deleted."
    cases = store.list_cases(set_id)
    assert [c["state"] for c in cases] == [{"a": 1}, "new ticket"]
    assert cases[0]["expected"] == {"urgent": True, "priority": 2} and cases[0]["tags"] == ["vip", "late"]
    assert second not in [c["id"] for c in cases]


def test_results_csv_is_readable_by_a_person(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("a")
    (case_id,) = store.add_cases(set_id, [{"state": "Where is my parcel?", "expected": {"urgent": True,
                                                                                      "team": "tech"}}])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo")
    response = {"answers": {
        "team": {"type": "choice", "choice": "billing", "confidence": 0.7123456,
                 "probabilities": {"billing": 0.7123456, "tech": 0.2876544}},
        "urgent": {"type": "noul", "noul": 0.91234567},
    }, "usage": {"input_tokens": 50}}
    store.record_results(run_id, [{"case_id": case_id, "response": response, "latency_ms": 12, "input_tokens": 50}])
    exported = casesets.export_results_csv(store, run_id).encode()
    assert exported.startswith(codecs.BOM_UTF8)  # Excel reads the file as UTF-8 only with the mark
    rows = {r["question_id"]: r for r in csv.DictReader(io.StringIO(exported.decode("utf-8-sig")))}
    assert rows["team"]["state"] == "Where is my parcel?"
    assert rows["team"]["p:billing"] == "0.7123" and rows["urgent"]["p:true"] == "0.9123"
    assert (rows["team"]["correct"], rows["urgent"]["correct"]) == ("false", "true")
    assert (rows["team"]["expected"], rows["urgent"]["expected"]) == ("tech", "true")
