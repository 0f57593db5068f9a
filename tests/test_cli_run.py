"""`python -m clef_workbench run` as a user runs it (a subprocess): in process and on a real local Ray cluster, the run
left in the store as the Runs page leaves one, the answers of the run done in process; the driver killed mid-run
and the run resumed with no case lost or duplicated; wrong input answered with a message and exit code 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clef_workbench.__main__ import main
from clef_workbench.jobs import JobRunner
from clef_workbench.store import Store
from tests.ray_cluster import assert_same_answers, local_cluster

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "schemas" / "support-ticket-routing.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text())
TICKETS = [{"state": example["state"]} for example in SCHEMA["examples"]]
# the keys a run started on the Runs page has in its settings
PAGE_SETTINGS = {"chunk_size", "max_length", "overflow", "schema_slug", "device", "dtype"}


def make_db(tmp_path: Path, copies: int) -> tuple[Path, Store, int]:
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [dict(ticket, tags=[f"copy-{n}"]) for n in range(copies) for ticket in TICKETS])
    return db, store, set_id


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "clef_workbench", "run", *args]


def in_process(store: Store, set_id: int, engine, schema: dict) -> list[dict]:
    run_id = store.create_run(set_id, schema=schema, model_id="demo", settings={"chunk_size": 8})
    runner = JobRunner(store)
    runner.start(run_id, engine)
    assert runner.wait(run_id, timeout=300)
    return store.list_results(run_id)


@pytest.mark.slow
def test_a_run_from_the_command_line_is_stored_as_a_runs_page_run(tmp_path, tiny_release, tiny_engine):
    db, store, set_id = make_db(tmp_path, 2)
    done = subprocess.run(cli("--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE),
                              "--model", str(tiny_release), "--device", "cpu"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run 1: 10/10 cases · 0 errors" in done.stdout

    run = store.get_run(1)
    assert (run["status"], run["done"], run["total"], run["errors"]) == ("finished", 10, 10, 0)
    assert set(run["settings"]) == PAGE_SETTINGS and run["settings"]["schema_slug"] == "support-ticket-routing"
    assert run["settings"]["device"] == "cpu" and run["settings"]["dtype"] == "float32"
    page_schema = {k: v for k, v in SCHEMA.items() if k != "examples"}  # what the page stores: the library's dict
    assert run["schema"]["questions"] == page_schema["questions"] and run["schema"]["name"] == page_schema["name"]
    assert run["model_id"] == tiny_release.name and run["started_at"] and run["finished_at"]
    assert store.run_lease_holder(1) is None
    assert_same_answers(in_process(store, set_id, tiny_engine, run["schema"]), store.list_results(1))


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
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None:
            runs = store.list_runs()
            if runs and runs[0]["done"] >= 2:
                break
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
    assert run["settings"]["ray"]["replicas"] == 2 and run["settings"]["chunk_tokens"] == 1
    assert PAGE_SETTINGS <= set(run["settings"])
    before = {r["case_id"]: (r["id"], r["finished_at"]) for r in store.list_results(run["id"])}

    from clef_workbench.distributed import make_job_runner

    monkeypatch.setenv("CLEF_RAY_ADDRESS", address)
    runner = make_job_runner(store)  # as the Runs page gets it
    assert runner.progress(run["id"])["interrupted"]
    runner.start(run["id"], tiny_engine)
    assert runner.wait(run["id"], timeout=300)
    assert store.get_run(run["id"])["status"] == "finished"
    results = store.list_results(run["id"])
    assert len({r["case_id"] for r in results}) == len(results) == 20  # none lost, none duplicated
    assert all((r["id"], r["finished_at"]) == before[r["case_id"]] for r in results if r["case_id"] in before)
    assert_same_answers(in_process(store, set_id, tiny_engine, run["schema"]), results)


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
                 str(SCHEMA_FILE)]) == 1
    err = capsys.readouterr().err
    assert "ReleaseError" in err and "no-release" in err and "Traceback" not in err
    assert store.list_runs() == []  # nothing half-created
