"""Importing the files people export (issue 23, point 2): each kind of file read through the import service and
through `python -m clef_workbench import`, the stored states and expected answers equal to the text that was
written; rows that do not fit listed by row number and imported only when skipping them is asked for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clef_workbench import importing
from clef_workbench.__main__ import main
from clef_workbench.casesets import CaseImportError, CsvMapping, import_cases
from clef_workbench.store import Store, StoreError
from tests.support import REPO
from tests.support.import_files import KINDS, RAGGED, expected_cases, stored

SCHEMA_FILE = REPO / "schemas" / "support-ticket-routing.json"
SCHEMA = {k: v for k, v in json.loads(SCHEMA_FILE.read_text()).items() if k != "examples"}
MAPPING = CsvMapping(state_columns=["subject", "body"], expected_columns={"expected_team": "team",
                                                                         "priority": "priority"})


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_file_imports_its_text_exactly_through_the_service(kind):
    file = KINDS[kind]
    source = importing.read_source(file.file_name, file.data)
    assert (source.encoding, source.delimiter) == (file.encoding, file.delimiter)
    assert source.bad_rows == []
    cases = importing.parse_cases(source, None if source.kind == "jsonl" else MAPPING, SCHEMA)
    assert [(c["state"], c["expected"]) for c in cases] == expected_cases(file.rows)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_file_imports_its_text_exactly_through_the_command_line(kind, tmp_path, capsys):
    file = KINDS[kind]
    path = tmp_path / file.file_name
    path.write_bytes(file.data)
    db = tmp_path / "w.db"
    code = main(["import", "--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE), str(path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"imported {len(file.rows)} case(s) into 'tickets'" in out.out
    if file.encoding:
        assert importing.ENCODINGS[file.encoding] in out.out, "the encoding it read the file in is printed"
    store = Store(db)
    (case_set,) = store.list_case_sets()
    assert case_set["schema_name"] == "support-ticket-routing"
    assert stored(store, case_set["id"]) == expected_cases(file.rows)


EMPTY_ROWS = ("subject,body,expected_team,priority\r\n"
              "Refund,I was charged twice,billing,2\r\n"
              "\r\n"                                                   # row 3: blank line
              ",,,\r\n"                                                # row 4: every cell empty
              ",,billing,1\r\n"                                        # row 5: a label but no state
              "Invoice,Wrong VAT number on INV-88,billing,0\r\n")
GOOD_OF_BOTH = [({"subject": "Refund", "body": "I was charged twice, please help"}, {"team": "billing", "priority": 2}),
                ({"subject": "Invoice", "body": "Wrong VAT number on INV-88"}, {"team": "billing", "priority": 0})]


@pytest.mark.parametrize(("text", "bad", "good"), [
    (RAGGED, ["row 3: 2 cells where the header has 4 columns", "row 4: 5 cells where the header has 4 columns"],
     GOOD_OF_BOTH),
    (EMPTY_ROWS, ["row 3: empty", "row 4: empty",
                  "row 5: the state is empty (subject, body have no value)"],
     [({"subject": "Refund", "body": "I was charged twice"}, {"team": "billing", "priority": 2}), GOOD_OF_BOTH[1]]),
], ids=["ragged", "empty"])
def test_rows_that_do_not_fit_are_listed_and_imported_only_when_skipping_them_is_asked(text, bad, good, tmp_path,
                                                                                        capsys):
    source = importing.read_source("tickets.csv", text.encode())
    with pytest.raises(importing.BadRowsError) as refused:
        importing.parse_cases(source, MAPPING, SCHEMA)
    assert refused.value.problems == bad
    cases = importing.parse_cases(source, MAPPING, SCHEMA, skip_bad_rows=True)
    assert [(c["state"], c["expected"]) for c in cases] == good

    path = tmp_path / "tickets.csv"
    path.write_text(text, newline="")
    db = tmp_path / "w.db"
    args = ["import", "--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE), str(path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert all(problem in err for problem in bad) and "--skip-bad-rows" in err
    assert not db.exists() or Store(db).list_case_sets() == [], "nothing imported, no case set made"
    assert main([*args, "--skip-bad-rows"]) == 0
    assert f"skipped {len(bad)} bad row(s): " + "; ".join(bad) in capsys.readouterr().out
    assert stored(Store(db), 1) == good


def test_parse_csv_refuses_a_ragged_row_instead_of_importing_a_short_state():
    with pytest.raises(CaseImportError) as refused:
        importing.parse_cases(importing.read_delimited(RAGGED, ","), MAPPING, SCHEMA)
    assert refused.value.problems[0] == "row 3: 2 cells where the header has 4 columns"


def test_a_wrong_encoding_chosen_names_the_line_and_imports_nothing(tmp_path, capsys):
    data = KINDS["latin-1"].data
    with pytest.raises(CaseImportError) as refused:
        importing.read_source("tickets.csv", data, encoding="utf-8")
    assert refused.value.problems == ["line 2: byte 0xe9 is not valid UTF-8; choose the encoding the file was "
                                      "saved in"]
    path = tmp_path / "tickets.csv"
    path.write_bytes(data)
    assert main(["import", "--db", str(tmp_path / "w.db"), "--case-set", "t", "--encoding", "utf-8", str(path)]) == 2
    assert "line 2: byte 0xe9 is not valid UTF-8" in capsys.readouterr().err


def test_the_delimiter_and_encoding_can_be_overridden(tmp_path):
    # a one-column file of sentences with commas: sniffed as comma-separated, read whole when told it is tab
    text = "note\r\nHello, world\r\nHi, there, you\r\n"
    assert importing.read_source("notes.csv", text.encode()).bad_rows != []
    source = importing.read_source("notes.csv", text.encode("cp1252"), encoding="cp1252", delimiter="\t")
    assert [row["note"] for _, row in source.rows] == ["Hello, world", "Hi, there, you"]


def test_a_file_that_is_not_text_or_not_a_workbook_gets_a_message_not_a_traceback(tmp_path, capsys):
    photo = (REPO / "examples" / "casesets" / "media" / "burnt-out.png").read_bytes()
    with pytest.raises(CaseImportError, match="the file is not text in a supported encoding"):
        importing.read_source("tickets.csv", photo)
    with pytest.raises(CaseImportError, match="^.*line 1 holds a NUL character, which UTF-8 text never does"):
        importing.read_source("tickets.txt", "subject\tbody\r\nRefund\tCharged twice\r\n".encode("utf-16-le"),
                              encoding="utf-8")
    with pytest.raises(CaseImportError, match="is not an Excel .xlsx workbook"):
        importing.read_source("tickets.xlsx", b"subject,body\n")
    path = tmp_path / "tickets.xlsx"
    path.write_bytes(b"subject,body\n")
    assert main(["import", "--db", str(tmp_path / "w.db"), "--case-set", "t", str(path)]) == 2
    assert "is not an Excel .xlsx workbook" in capsys.readouterr().err
    pdf = tmp_path / "tickets.pdf"  # not read as comma-separated text because it is no other kind
    pdf.write_bytes(b"%PDF-1.4 subject,body\nRefund,Charged twice\n")
    assert main(["import", "--db", str(tmp_path / "w.db"), "--case-set", "t", str(pdf)]) == 2
    assert "tickets.pdf: not a file import reads; use .csv, .tsv" in capsys.readouterr().err
    assert not (tmp_path / "w.db").exists()


def readme_batch_example() -> list[str]:
    """The commands of docs/operations.md's "Batch runs from the command line" block, joined across continuation
    lines."""
    page = (REPO / "docs" / "operations.md").read_text()
    section = page.split("## Batch runs from the command line", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readmes_batch_run_example_runs_as_written_on_a_fresh_database(tmp_path):
    commands = readme_batch_example()
    assert [c.split()[:2] for c in commands] == [[".venv/bin/clef-workbench", "import"],
                                                 [".venv/bin/clef-workbench", "run"]]
    db = tmp_path / "data" / "workbench.sqlite3"
    for command in commands:
        args = command.split()
        assert "data/workbench.sqlite3" in args  # the installed command is this package's main, run by this Python
        args = [sys.executable, "-m", "clef_workbench"] + [str(db) if a == "data/workbench.sqlite3" else a
                                                           for a in args[1:]]
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    store = Store(db)
    (case_set,) = store.list_case_sets()
    run = store.get_run(1)
    assert (run["status"], run["done"], run["errors"]) == ("finished", case_set["case_count"], 0)
    assert case_set["case_count"] == len((REPO / "examples" / "tickets.csv").read_text().splitlines()) - 1


# -- hostile files (issue 40) and the suggested mapping (issue 36, point 6) ------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def test_a_lone_surrogate_in_jsonl_is_refused_naming_its_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "cases.jsonl"
    path.write_text('{"state": "fine"}\n{"state": {"note": "broken \\ud800 text"}}\n')
    source = importing.read_source(path.name, path.read_bytes())
    with pytest.raises(CaseImportError, match=r"line 2: holds a lone surrogate \(\\ud800\)"):
        importing.parse_cases(source, None, None)
    db = tmp_path / "w.db"
    assert main(["import", "--db", str(db), "--case-set", "s", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2: holds a lone surrogate" in err and "Traceback" not in err
    assert Store(db).list_case_sets() == []  # nothing imported


def test_nan_and_infinity_states_are_refused_at_import_naming_the_row():
    jsonl = importing.read_source("cases.jsonl", b'{"state": "ok"}\n{"state": {"amount": NaN}}\n'
                                                 b'{"state": "ok", "expected": {"priority": -Infinity}}\n')
    with pytest.raises(CaseImportError) as error:
        importing.parse_cases(jsonl, None, None)
    assert error.value.problems == ["line 2: NaN is not a JSON number (write a number, or null)",
                                    "line 3: -Infinity is not a JSON number (write a number, or null)"]
    table = importing.read_source("cases.csv", b'state\n"{""amount"": Infinity}"\n')
    with pytest.raises(CaseImportError, match="row 2, column 'state': looks like JSON but Infinity is not a JSON"):
        importing.parse_cases(table, CsvMapping(state_text_column="state"), None)


def test_an_uploaded_file_never_makes_the_server_read_its_own_files(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    uploaded = json.dumps({"state": "x", "images": [str(secret)]}) + "\n"
    source = importing.read_source("cases.jsonl", uploaded.encode())
    with pytest.raises(CaseImportError, match="line 1, images\\[0\\]: image .* is a file path, which an uploaded "
                                              "file cannot name: embed the image as a data URL"):
        importing.parse_cases(source, None, None)  # the Case sets page: an upload has no folder
    relative = importing.read_source("cases.csv", b"state,photo\nx,secret.png\n")
    with pytest.raises(CaseImportError, match="row 2, column 'photo': image 'secret.png' is a file path"):
        importing.parse_cases(relative, CsvMapping(state_columns=["state"], image_columns=["photo"]), None)

    folder = tmp_path / "upload"  # a file on disk names paths inside its own folder only
    folder.mkdir()
    (folder / "inside.png").write_bytes(PNG)
    for ref in (str(secret), "../secret.png"):
        outside = importing.read_source("cases.jsonl", json.dumps({"state": "x", "images": [ref]}).encode())
        with pytest.raises(CaseImportError, match="is outside the file's folder"):
            importing.parse_cases(outside, None, None, base_dir=folder)
    inside = importing.read_source("cases.jsonl", b'{"state": "x", "images": ["inside.png"]}')
    assert importing.parse_cases(inside, None, None, base_dir=folder)[0]["images"] == [PNG]


class CountedName(str):
    """A column name that counts the comparisons made with it: an import's work per column, without a clock."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountedName.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_csv_with_thousands_of_columns_imports_in_work_linear_in_its_columns():
    width = 5_000
    header = [CountedName(f"field_{n}") for n in range(width)]
    records = [header, [f"value {n}" for n in range(width)], [f"other {n}" for n in range(width)]]
    CountedName.comparisons = 0
    source = importing._split_rows(importing.SourceFile("wide.csv", "delimited"), records)
    mapping = importing.suggest_mapping(source.columns)
    cases = importing.parse_cases(source, mapping, None)
    assert len(cases) == 2 and len(cases[0]["state"]) == width
    assert CountedName.comparisons <= 10 * width  # was width² (25 million): a list's count and `in` per column


def test_suggest_mapping_sends_ids_to_the_case_id_answers_to_expected_and_never_labels_to_evidence():
    columns = ["ticket_id", "subject", "body", "team", "expected_priority", "gold_mood", "customer_id", "tags", " "]
    mapping = importing.suggest_mapping(columns, ["team", "priority", "mood"])
    assert mapping.id_column == "ticket_id"
    assert mapping.state_columns == ["subject", "body", "customer_id"]  # only the first id-like column is the id
    assert mapping.expected_columns == {"team": "team", "expected_priority": "priority"}
    assert mapping.tags_column == "tags"
    bare = importing.suggest_mapping(["subject", "label", "answer_team", "team"])
    assert bare.state_columns == ["subject", "team"] and bare.id_column is None and bare.expected_columns == {}


def test_import_without_schema_leaves_answers_out_of_the_evidence_and_says_what_it_took(tmp_path, capsys):
    db = tmp_path / "w.db"
    assert main(["import", "--db", str(db), "--case-set", "tickets", str(REPO / "examples" / "tickets.csv")]) == 0
    out = capsys.readouterr().out
    assert "columns: evidence (the state): from, subject, plan, body · tags: tags · left out: team, priority, " \
           "customer_mood, churn_threat, needs_human_agent (named like answers" in out
    store = Store(db)
    (case_set,) = store.list_case_sets()
    states = [store.get_case(c["id"])["state"] for c in store.list_cases(case_set["id"])]
    assert len(states) == 12 and all(set(state) == {"from", "subject", "plan", "body"} for state in states)

    assert main(["import", "--db", str(db), "--case-set", "asked", "--state-column", "subject", "--state-column",
                 "team", str(REPO / "examples" / "tickets.csv")]) == 0  # what the user asks for, they get
    asked = next(s for s in store.list_case_sets() if s["name"] == "asked")
    assert all(set(store.get_case(c["id"])["state"]) == {"subject", "team"} for c in store.list_cases(asked["id"]))
    out = capsys.readouterr().out
    assert "left out: from, plan, body, priority, customer_mood, churn_threat, needs_human_agent (not chosen as state" \
        in out

    assert main(["import", "--db", str(db), "--case-set", "both", "--state-column", "subject", "--state-text-column",
                 "body", str(REPO / "examples" / "tickets.csv")]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert "both" not in [s["name"] for s in store.list_case_sets()]


def test_an_id_column_is_the_case_id_and_a_row_without_evidence_is_a_bad_row(tmp_path, capsys):
    path = tmp_path / "tickets.csv"
    path.write_text("ticket_id,subject,body,expected_team\nT-1,Refund,Charged twice,billing\nT-4,,,tech\n")
    db = tmp_path / "w.db"
    assert main(["import", "--db", str(db), "--case-set", "t", "--schema", str(SCHEMA_FILE), str(path)]) == 2
    captured = capsys.readouterr()
    assert "columns: case id: ticket_id · evidence (the state): subject, body · expected answers: expected_team → " \
           "team" in captured.out
    assert "row 3: the state is empty (subject, body have no value)" in captured.err
    assert main(["import", "--db", str(db), "--case-set", "t", "--schema", str(SCHEMA_FILE), "--skip-bad-rows",
                 str(path)]) == 0
    store = Store(db)
    (case,) = store.list_cases(store.list_case_sets()[0]["id"])
    stored_case = store.get_case(case["id"])
    assert (stored_case["source_id"], stored_case["state"]) == ("T-1", {"subject": "Refund", "body": "Charged twice"})
    jsonl = importing.read_source("cases.jsonl", b'{"state": {}}\n{"state": "  "}\n')
    with pytest.raises(CaseImportError) as error:
        importing.parse_cases(jsonl, None, None)
    assert [p.split(":")[0] for p in error.value.problems] == ["line 1", "line 2"]


def test_a_case_id_repeated_in_a_file_is_a_bad_row_naming_both_rows_or_lines(tmp_path, capsys):
    text = "ticket_id,subject\nT-1,Refund please\nT-2,Where is my parcel\nT-1,My invoice is wrong\n"
    source = importing.read_source("tickets.csv", text.encode())
    mapping = CsvMapping(state_columns=["subject"], id_column="ticket_id")
    with pytest.raises(importing.BadRowsError) as refused:
        importing.parse_cases(source, mapping, None)
    assert refused.value.problems == ["row 4: its id 'T-1' is row 2's too (an id names one case)"]
    kept = importing.parse_cases(source, mapping, None, skip_bad_rows=True)
    assert [(c["source_id"], c["state"]) for c in kept] == [("T-1", {"subject": "Refund please"}),
                                                          ("T-2", {"subject": "Where is my parcel"})]
    path = tmp_path / "tickets.csv"
    path.write_text(text)
    assert main(["import", "--db", str(tmp_path / "w.db"), "--case-set", "t", str(path)]) == 2
    assert "row 4: its id 'T-1' is row 2's too (an id names one case)" in capsys.readouterr().err

    jsonl = importing.read_source("cases.jsonl", b'{"id": 7, "state": "a"}\n{"id": "8", "state": "b"}\n'
                                                 b'{"id": "7", "state": "c"}\n')
    with pytest.raises(CaseImportError) as refused:
        importing.parse_cases(jsonl, None, None)
    assert refused.value.problems == ["line 3, id: '7' is line 1's too (an id names one case)"]


def test_a_case_whose_id_the_case_set_already_has_is_refused_naming_the_case_and_nothing_lands(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    (first,) = import_cases(store, set_id, [{"state": "Refund please", "source_id": "T-1"}])
    assert import_cases(store, set_id, [{"state": "Refund please", "source_id": "T-1"}]) == []  # the same: skipped
    with pytest.raises(StoreError) as refused:
        import_cases(store, set_id, [{"state": "Where is my parcel", "source_id": "T-2"},
                                     {"state": "Refund, edited", "source_id": "T-1"}])
    assert str(refused.value).startswith(f"the id 'T-1' is already case {first}'s in this case set (an id names "
                                         "one case)")
    assert [c["id"] for c in store.list_cases(set_id)] == [first]
