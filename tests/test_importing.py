"""Importing the files people export (issue 23, point 2): each kind of file read through the import service and
through `python -m clef_workbench import`, the stored states and expected answers equal to the text that was
written; rows that do not fit listed by row number and imported only when skipping them is asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clef_workbench import casesets, importing
from clef_workbench.__main__ import main
from clef_workbench.casesets import CaseImportError, CsvMapping
from clef_workbench.store import Store
from tests.import_files import KINDS, RAGGED, expected_cases, stored

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "schemas" / "support-ticket-routing.json"
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
        casesets.parse_csv(RAGGED, MAPPING, SCHEMA)
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
    photo = (ROOT / "examples" / "casesets" / "media" / "burnt-out.png").read_bytes()
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


def readme_batch_example() -> list[str]:
    """The commands of the README's "Batch runs from the command line" block, joined across continuation lines."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Batch runs from the command line", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readmes_batch_run_example_runs_as_written_on_a_fresh_database(tmp_path):
    commands = readme_batch_example()
    assert [c.split()[2:4] for c in commands] == [["clef_workbench", "import"], ["clef_workbench", "run"]]
    db = tmp_path / "data" / "workbench.sqlite3"
    for command in commands:
        args = command.split()
        assert args[0] == ".venv/bin/python" and "data/workbench.sqlite3" in args
        args = [sys.executable] + [str(db) if a == "data/workbench.sqlite3" else a for a in args[1:]]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
    store = Store(db)
    (case_set,) = store.list_case_sets()
    run = store.get_run(1)
    assert (run["status"], run["done"], run["errors"]) == ("finished", case_set["case_count"], 0)
    assert case_set["case_count"] == len((ROOT / "examples" / "tickets.csv").read_text().splitlines()) - 1
