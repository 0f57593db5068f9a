"""`python -m clef_workbench run` as a user runs it (a subprocess): in process and on a real local Ray cluster, the run
left in the store as the Runs page leaves one, the answers of the run done in process; the driver killed mid-run
and the run resumed with no case lost or duplicated; wrong input answered with a message and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from clef_workbench.__main__ import main
from clef_workbench.jobs import JobRunner
from clef_workbench.store import RunSettings, Store, StoreError
from tests.support import REPO
from tests.support.ray_cluster import assert_same_answers, local_cluster

SCHEMA_FILE = REPO / "schemas" / "support-ticket-routing.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text())
TICKETS = [{"state": example["state"]} for example in SCHEMA["examples"]]
# the keys a run started on the Runs page has in its settings
PAGE_SETTINGS = {"chunk_size", "max_length", "overflow", "schema_slug", "device", "dtype", "precision"}


def make_db(tmp_path: Path, copies: int) -> tuple[Path, Store, int]:
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [dict(ticket, tags=[f"copy-{n}"]) for n in range(copies) for ticket in TICKETS])
    return db, store, set_id


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "clef_workbench", "run", *args]


def in_process(store: Store, set_id: int, engine, schema: dict) -> list[dict]:
    run_id = store.create_run(set_id, schema=schema, model_id="demo", settings=RunSettings(chunk_size=8))
    runner = JobRunner(store)
    runner.start(run_id, engine)
    assert runner.wait(run_id, timeout=300)
    return store.list_results(run_id)


@pytest.mark.slow
def test_a_run_from_the_command_line_is_stored_as_a_runs_page_run(tmp_path, tiny_release, tiny_engine):
    db, store, set_id = make_db(tmp_path, 2)
    done = subprocess.run(cli("--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE),
                              "--model", str(tiny_release), "--device", "cpu"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run 1: 10/10 cases · 0 errors" in done.stdout

    run = store.get_run(1)
    assert (run["status"], run["done"], run["total"], run["errors"]) == ("finished", 10, 10, 0)
    assert set(run["settings"].to_json()) == PAGE_SETTINGS and run["settings"].schema_slug == "support-ticket-routing"
    assert run["settings"].device == "cpu" and run["settings"].dtype == "float32"
    assert run["settings"].precision == "bf16"  # which precision answered the run
    page_schema = {k: v for k, v in SCHEMA.items() if k != "examples"}  # what the page stores: the library's dict
    assert run["schema"]["questions"] == page_schema["questions"] and run["schema"]["name"] == page_schema["name"]
    assert run["model_id"] == tiny_release.name and run["started_at"] and run["finished_at"]
    assert store.run_lease_holder(1) is None
    assert_same_answers(in_process(store, set_id, tiny_engine, run["schema"]), store.list_results(1))


def test_wrong_input_is_a_message_naming_the_argument_and_exit_code_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CLEF_RAY_ADDRESS", raising=False)
    db, store, _ = make_db(tmp_path, 1)
    common = ["run", "--db", str(db), "--model", "demo"]

    assert main(["run", "--db", str(tmp_path / "none.db"), "--case-set", "x", "--schema", str(SCHEMA_FILE),
                 "--model", "demo"]) == 2
    assert "--db:" in capsys.readouterr().err and not (tmp_path / "none.db").exists()

    assert main([*common, "--case-set", "nope", "--schema", str(SCHEMA_FILE)]) == 2
    err = capsys.readouterr().err
    assert "no case set named 'nope'" in err and "'tickets'" in err and "Traceback" not in err

    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "questions": {"q": {"type": "maybe"}}}')
    assert main([*common, "--case-set", "tickets", "--schema", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--schema:" in err and "bad.json" in err and "type" in err

    assert main([*common, "--case-set", "tickets", "--schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err

    assert main([*common, "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--replicas", "2"]) == 2
    assert "--ray" in capsys.readouterr().err  # replicas without a cluster: not silently one engine here
    assert main([*common, "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--chunk-size", "0"]) == 2
    assert "--chunk-size must be at least 1" in capsys.readouterr().err

    assert main([*common[:-1], str(tmp_path / "no-release"), "--case-set", "tickets", "--schema",
                 str(SCHEMA_FILE)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "no-release" in err and "Traceback" not in err
    assert main([*common, "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'; use cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main([*common, "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err
    assert main([*common, "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--retry-failed"]) == 2
    assert "--retry-failed goes with --resume" in capsys.readouterr().err
    store.create_case_set("empty")
    assert main([*common, "--case-set", "empty", "--schema", str(SCHEMA_FILE)]) == 2
    assert "'empty' has no cases" in capsys.readouterr().err
    assert store.list_runs() == []  # nothing half-created


SMALL_SCHEMA = {"name": "small", "version": 1, "questions": {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None}},
}}


def small_run(tmp_path: Path, cases: int) -> tuple[Path, Path, Store]:
    """A database with a case set "tickets" of short cases and a small schema file: quick on the CPU."""
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"ticket {i}: my invoice is wrong"} for i in range(cases)])
    schema_file = tmp_path / "small.json"
    schema_file.write_text(json.dumps(SMALL_SCHEMA))
    return db, schema_file, store


def run_cli(*args: str, module: tuple[str, ...] = ("clef_workbench", "run")) -> subprocess.CompletedProcess:
    """The command line without a terminal (stdin closed), as in a script or CI."""
    return subprocess.run([sys.executable, "-m", *module, *args], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.slow
def test_a_run_whose_budget_failed_every_case_is_retried_as_its_message_says(tmp_path, tiny_release):
    """Every case over --max-length fails the run; the command it prints (--resume … --retry-failed, with a larger
    --max-length) computes them again into the same run, which ends with every case answered once."""
    db, schema_file, store = small_run(tmp_path, 6)
    common = ("--db", str(db), "--model", str(tiny_release), "--device", "cpu")
    failed = run_cli(*common, "--case-set", "tickets", "--schema", str(schema_file), "--max-length", "10")
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert f"--resume 1 --model {tiny_release} --retry-failed" in failed.stderr
    assert (store.get_run(1)["done"], store.get_run(1)["errors"]) == (6, 6)

    plain = run_cli(*common, "--resume", "1")  # nothing without a result: it says how to retry
    assert plain.returncode == 0 and "failed case(s) are computed again with --retry-failed" in plain.stdout
    retried = run_cli(*common, "--resume", "1", "--retry-failed", "--max-length", "4096")
    assert retried.returncode == 0, retried.stderr[-2000:]
    run = store.get_run(1)
    assert (run["status"], run["done"], run["errors"], run["settings"].max_length) == ("finished", 6, 0, 4096)
    assert sorted(r["case_id"] for r in store.list_results(1)) == sorted(c["id"] for c in store.list_cases(1))


@pytest.mark.slow
def test_a_database_turning_read_only_mid_run_fails_the_run_cleanly_and_resume_completes_it(tmp_path, tiny_release):
    db, schema_file, store = small_run(tmp_path, 40)
    args = ("--db", str(db), "--model", str(tiny_release), "--device", "cpu")
    # the database turns read-only once the run has written 3 chunks of results (see tests/support/readonly_store.py)
    failed = run_cli("3", "run", *args, "--case-set", "tickets", "--schema", str(schema_file), "--chunk-size", "2",
                     module=("tests.support.readonly_store",))
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(errors) == 1, failed.stderr[-3000:]  # one message, no traceback
    assert errors[0].startswith("run 1 failed: the database") and "attempt to write a readonly database" in errors[0]
    assert f"--resume 1 --model {tiny_release}" in errors[0]

    run = store.get_run(1)
    assert run["done"] == 6  # 3 chunks of 2: nothing written after the database turned read-only
    # its `failed` could not be written either: the lease, never renewed, tells that nobody runs it
    assert run["status"] == "running" and store.run_lease_holder(1) is None
    assert JobRunner(store).progress(1)["interrupted"]
    before = {r["case_id"]: (r["id"], r["finished_at"]) for r in store.list_results(1)}

    again = run_cli(*args, "--case-set", "tickets", "--schema", str(schema_file))  # the same work, no terminal
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "run 1 (running, 6/40 cases done)" in again.stderr and "--resume 1" in again.stderr
    assert "--new" in again.stderr and len(store.list_runs()) == 1  # nothing computed twice

    resumed = run_cli(*args, "--resume", "1")  # the database writable again: a new process, no hook
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming run 1: tickets · small v1" in resumed.stdout and "run 1: 40/40 cases · 0 errors" in resumed.stdout
    run = store.get_run(1)
    assert (run["status"], run["done"], run["errors"]) == ("finished", 40, 0) and len(store.list_runs()) == 1
    results = store.list_results(1)
    assert len({r["case_id"] for r in results}) == len(results) == 40  # none lost, none duplicated
    assert all((r["id"], r["finished_at"]) == before[r["case_id"]] for r in results if r["case_id"] in before)

    finished = run_cli(*args, "--case-set", "tickets", "--schema", str(schema_file))
    assert finished.returncode == 2 and "has a result for every case; pass --new" in finished.stderr
    nothing = run_cli(*args, "--resume", "1")
    assert nothing.returncode == 0 and "nothing to resume" in nothing.stdout
    assert [len(store.list_results(1))] == [40] and len(store.list_runs()) == 1


def test_resume_and_new_are_checked_before_any_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CLEF_RAY_ADDRESS", raising=False)
    db, schema_file, store = small_run(tmp_path, 2)
    common = ["run", "--db", str(db), "--model", "demo"]
    assert main([*common, "--resume", "7"]) == 2
    assert "--resume: there is no run 7" in capsys.readouterr().err
    set_id = store.list_case_sets()[0]["id"]
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="another-model")
    assert main([*common, "--resume", str(run_id)]) == 2
    assert "runs model 'another-model', not 'clef-demo'" in capsys.readouterr().err
    assert main([*common, "--resume", str(run_id), "--schema", str(schema_file)]) == 2
    assert "leave out --case-set, --schema and --new" in capsys.readouterr().err
    assert main(common) == 2
    assert "--case-set and --schema are required (or --resume RUN_ID)" in capsys.readouterr().err


def test_at_a_terminal_the_same_work_asks_whether_to_resume(tmp_path, monkeypatch):
    from clef_workbench.__main__ import UsageError, resume_or_new, same_run

    db, schema_file, store = small_run(tmp_path, 3)
    set_id = store.list_case_sets()[0]["id"]
    settings = RunSettings(chunk_size=8, max_length=8192)
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="clef-demo", settings=settings)
    assert same_run(store, set_id, SMALL_SCHEMA, "another-model", settings) is None
    assert same_run(store, set_id, SMALL_SCHEMA, "clef-demo", replace(settings, max_length=400)) is None
    run = same_run(store, set_id, SMALL_SCHEMA, "clef-demo", settings)
    assert run["id"] == run_id

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    asked: list[str] = []
    for answer, expected in (("", run_id), ("y", run_id), ("n", None)):
        monkeypatch.setattr("builtins.input", lambda prompt, answer=answer: asked.append(prompt) or answer)
        assert resume_or_new(store, run) == expected
    assert f"run {run_id} (pending, 0/3 cases done)" in asked[0] and "Resume it (3 cases left)?" in asked[0]
    monkeypatch.setattr("builtins.input", lambda prompt: "q")
    with pytest.raises(UsageError, match=f"nothing run: choose --resume {run_id} or --new"):
        resume_or_new(store, run)


@pytest.mark.slow
@pytest.mark.kill
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_cancels_it_with_its_results_kept_and_resume_completes_it(tmp_path, tiny_release, signum):
    db, schema_file, store = small_run(tmp_path, 20)
    args = ("--db", str(db), "--model", str(tiny_release), "--device", "cpu")
    gate = tmp_path / "gate"
    # the run pauses once it has written 2 chunks of results, until the gate opens (see tests/support/paused_run.py)
    child = subprocess.Popen([sys.executable, "-m", "tests.support.paused_run", "results", "2", str(gate), "run", *args,
                              "--case-set", "tickets", "--schema", str(schema_file), "--chunk-size", "2"],
                             cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 300
        while not gate.with_name("gate.paused").exists():
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run had not written 2 chunks after 300 s"
            time.sleep(0.05)
        child.send_signal(signum)
        seen = []
        while not any("cancelling after the chunk in flight" in line for line in seen):
            line = child.stderr.readline()
            assert line, "".join(seen)[-3000:]  # the process ended without saying it cancels
            seen.append(line)
        gate.touch()
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = "".join(seen) + err
    assert child.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    assert f"run 1 cancelled (to resume: python -m clef_workbench run --db {db} --resume 1" in err
    run = store.get_run(1)
    # the chunk written at the pause and the one queued behind it: nothing after the signal was started
    assert (run["status"], run["done"], run["errors"]) == ("cancelled", 6, 0)
    assert store.run_lease_holder(1) is None
    before = {r["case_id"]: (r["id"], r["finished_at"]) for r in store.list_results(1)}

    resumed = run_cli(*args, "--resume", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.rstrip().endswith("run 1 finished: 20/20 cases, 0 errors")
    results = store.list_results(1)
    assert len({r["case_id"] for r in results}) == len(results) == 20  # none lost, none computed twice
    assert all((r["id"], r["finished_at"]) == before[r["case_id"]] for r in results if r["case_id"] in before)
    assert store.get_run(1)["status"] == "finished"


NOBODY = 65534


@contextmanager
def as_nobody() -> Iterator[None]:
    """This process as another user than root, for whom file modes count (root writes a read-only file anyway). The
    Python it runs is under /root, so only modules already imported can be used meanwhile."""
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_a_read_only_database_is_read_its_writes_refused_without_side_files_and_works_once_writable(
        capsys, monkeypatch):
    import clef_workbench.distributed  # noqa: F401  # what `run` imports, while this process can still read it

    monkeypatch.delenv("CLEF_RAY_ADDRESS", raising=False)
    folder = Path(tempfile.mkdtemp())  # outside pytest's folder, which only root may enter
    try:
        folder.chmod(0o777)
        db = folder / "w.db"
        store = Store(db)
        store.create_case_set("tickets")
        store.close()
        schema_file = folder / "small.json"
        schema_file.write_text(json.dumps(SMALL_SCHEMA))
        tickets = folder / "tickets.csv"
        tickets.write_text("subject\nmy invoice is wrong\n")
        os.chown(db, NOBODY, NOBODY)
        db.chmod(0o444)
        content = db.read_bytes()
        import_args = ["import", "--db", str(db), "--case-set", "tickets", str(tickets)]
        with as_nobody():
            reader = Store(db)  # what the workbench's pages do: they list and show
            assert [s["name"] for s in reader.list_case_sets()] == ["tickets"] and reader.read_only
            with pytest.raises(StoreError, match=f"the database file {db} is read-only for this user: nothing"):
                reader.create_case_set("more")
            reader.close()
            assert main(["calibrate", "--db", str(db), "--export", str(folder / "calibrations.json")]) == 0
            assert main(["calibrate", "--db", str(db), "--run", "1"]) == 1
            assert main(import_args) == 1
            assert main(["run", "--db", str(db), "--case-set", "tickets", "--schema", str(schema_file), "--model",
                         "demo"]) == 1
            assert sorted(p.name for p in folder.iterdir() if p.name.startswith("w.db")) == ["w.db"]  # no -wal, -shm
            assert db.read_bytes() == content
            db.chmod(0o644)  # permissions restored by the file's owner: the database works
            imported = main(import_args)
        err = capsys.readouterr().err
        assert err.count(f"the database file {db} is read-only") == 3 and "Traceback" not in err, err
        assert json.loads((folder / "calibrations.json").read_text()) == {"calibrations": {}}
        assert imported == 0, err
        assert [s["case_count"] for s in Store(db).list_case_sets()] == [1]
    finally:
        shutil.rmtree(folder)


# Last in the module: the Ray cluster it starts is held, and other workers wait for it, until the module ends.
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.kill
def test_on_ray_the_driver_killed_mid_run_then_resumed_loses_and_duplicates_no_case(tmp_path, tiny_release,
                                                                                       tiny_engine, monkeypatch):
    address = local_cluster()
    db, store, set_id = make_db(tmp_path, 4)
    child = subprocess.Popen(cli("--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE),
                                 "--model", str(tiny_release), "--ray", address, "--replicas", "2",
                                 "--chunk-tokens", "1"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # two replicas load the model while the driver waits: minutes on a busy two-core machine
        deadline = time.monotonic() + 900
        while child.poll() is None:
            runs = store.list_runs()
            if runs and runs[0]["done"] >= 2:
                break
            assert time.monotonic() < deadline, "the run had not answered 2 cases after 900 s"
            time.sleep(0.1)
        assert child.poll() is None, child.stderr.read()[-3000:]
        child.send_signal(signal.SIGKILL)  # the driver dies: its replicas go with it, its lease with its process
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    out = child.stdout.read()
    child.stdout.close()
    child.stderr.close()
    assert "Ray, 2 replicas" in out

    run = store.list_runs()[0]
    killed_at = run["done"]
    assert run["status"] == "running" and 2 <= killed_at < 20
    assert run["settings"].ray["replicas"] == 2 and run["settings"].chunk_tokens == 1
    assert PAGE_SETTINGS - {"precision"} <= set(run["settings"].to_json())  # Ray's replicas name no precision
    before = {r["case_id"]: (r["id"], r["finished_at"]) for r in store.list_results(run["id"])}

    from clef_workbench.distributed import make_job_runner

    monkeypatch.setenv("CLEF_RAY_ADDRESS", address)
    runner = make_job_runner(store)  # as the Runs page gets it
    assert runner.progress(run["id"])["interrupted"]
    runner.start(run["id"], tiny_engine)
    # two replicas load the model again: as long as the first time on a busy machine
    assert runner.wait(run["id"], timeout=900), "the resumed run had not ended after 900 s"
    assert store.get_run(run["id"])["status"] == "finished"
    results = store.list_results(run["id"])
    assert len({r["case_id"] for r in results}) == len(results) == 20  # none lost, none duplicated
    assert all((r["id"], r["finished_at"]) == before[r["case_id"]] for r in results if r["case_id"] in before)
    assert_same_answers(in_process(store, set_id, tiny_engine, run["schema"]), results)
