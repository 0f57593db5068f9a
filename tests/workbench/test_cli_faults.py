"""`python -m clef_workbench import` and `calibrate` as a failing machine runs them (issue 40, point 3): a full disk
(a real file-size limit on the process, which SQLite and Python meet as the disk meets them), a process killed inside
an import's transaction. Each ends with one clear message and a non-zero exit, nothing half-written, nothing lost."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clef_workbench.store import Store
from tests.support import REPO

pytestmark = pytest.mark.slow  # each test runs the command line in child processes, several times

ROWS = 300


def tickets_file(folder: Path) -> Path:
    path = folder / "tickets.csv"
    path.write_text("subject,body\n" + "".join(f"ticket {n},{'my invoice is wrong ' * 50}{n}\n" for n in range(ROWS)))
    return path


def cli(*args: str, file_size_limit: int | None = None, module: str = "clef_workbench") -> subprocess.Popen:
    def limit() -> None:  # in the child: writes past this many bytes of any file fail (EFBIG), as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit if file_size_limit is not None else None)


def finished(child: subprocess.Popen) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=300)
    return child.returncode, out, err


def case_counts(db: Path) -> dict[str, int]:
    return {s["name"]: s["case_count"] for s in Store(db).list_case_sets()}


def test_an_import_into_a_full_database_says_so_writes_nothing_and_imports_whole_once_there_is_room(tmp_path):
    db = tmp_path / "w.db"
    store = Store(db)
    store.create_case_set("tickets")
    path = tickets_file(tmp_path)
    args = ("import", "--db", str(db), "--case-set", "tickets", str(path))

    code, _, err = finished(cli(*args, file_size_limit=db.stat().st_size + 16_384))
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert f"the database {db} cannot be used" in err and len(err.strip().splitlines()) == 1
    assert case_counts(db) == {"tickets": 0}  # the import's one transaction rolled back whole

    code, out, err = finished(cli(*args))
    assert code == 0, err[-3000:]
    assert f"imported {ROWS} case(s)" in out and case_counts(db) == {"tickets": ROWS}


@pytest.mark.kill
def test_an_import_killed_inside_its_transaction_leaves_nothing_and_the_same_import_then_lands_once(tmp_path):
    db = tmp_path / "w.db"
    Store(db)
    path = tickets_file(tmp_path)
    gate = tmp_path / "gate"
    # pauses after its 51st row time: the case set's and 50 case rows, inside the import's transaction
    child = cli("case-row", "51", str(gate), "import", "--db", str(db), "--case-set", "tickets", str(path),
                module="tests.support.paused_run")
    try:
        deadline = time.monotonic() + 300
        while not gate.with_name("gate.paused").exists():
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
    assert case_counts(db) == {"tickets": 0}  # created before the import's transaction; none of its 50 rows

    code, out, err = finished(cli("import", "--db", str(db), "--case-set", "tickets", str(path)))
    assert code == 0, err[-3000:]
    assert case_counts(db) == {"tickets": ROWS}
    code, out, _ = finished(cli("import", "--db", str(db), "--case-set", "tickets", str(path)))
    assert code == 0 and "imported 0 case(s)" in out and case_counts(db) == {"tickets": ROWS}  # none twice


def test_a_calibration_export_that_does_not_fit_on_the_disk_leaves_the_earlier_file_whole(tmp_path):
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": "ticket"}])
    schema = {"name": "t", "version": 1, "questions": {"urgent": {"type": "noul"}}}
    run = store.get_run(store.create_run(set_id, schema=schema, model_id="tiny"))
    payload = {"questions": {"urgent": {"question_type": "noul", "method": "platt", "a": 1.0, "b": 0.0,
                                        "temperature": None}}, "report": []}
    store.save_calibration("first", run, payload)
    export = tmp_path / "calibrations.json"
    code, _, err = finished(cli("calibrate", "--db", str(db), "--export", str(export)))
    assert code == 0, err
    earlier = export.read_text()
    for n in range(200):  # the next export is far larger than the earlier one
        store.save_calibration(f"calibration number {n} " + "x" * 100, run, payload)

    code, _, err = finished(cli("calibrate", "--db", str(db), "--export", str(export),
                                file_size_limit=len(earlier) * 4))
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert f"--export {export}: cannot write it (File too large); the file was left as it was" in err
    assert export.read_text() == earlier and json.loads(earlier)["calibrations"].keys() == {"first"}
    assert sorted(p.name for p in tmp_path.iterdir() if "calibrations" in p.name) == ["calibrations.json"]
