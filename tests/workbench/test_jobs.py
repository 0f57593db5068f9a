"""Background batch runs on the real tiny engine and a real SQLite file: results as they arrive, per-case errors,
cancel and resume, and resuming after the process running the job is killed (SIGKILL) mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from clef_workbench.casesets import build_request
from clef_workbench.jobs import JobAlreadyRunningError, JobRunner
from clef_workbench.store import RunSettings, Store
from tests.support import REPO, wait_for

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
SMALL_SCHEMA = {"name": "small", "version": "1", "questions": {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None}},
}}
# The shipped support-ticket schema makes each record ~1,500 tokens: slow enough on the CPU to kill mid-run.
TICKET_SCHEMA = json.loads((REPO / "schemas" / "support-ticket-routing.json").read_text())


def test_run_writes_every_result_and_records_bad_cases_as_errors(tmp_path, tiny_engine):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("mixed")
    good = store.add_cases(set_id, [{"state": f"ticket {i}: my invoice is wrong"} for i in range(5)])
    too_many_images = store.add_case(set_id, state="five photos", images=[PNG] * 5)
    too_long = store.add_case(set_id, state="word " * 400)  # over max_length=400 with overflow refuse
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="demo",
                              settings=RunSettings(chunk_size=4, max_length=400))
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)

    run = store.get_run(run_id)
    assert (run["status"], run["total"], run["done"], run["errors"]) == ("finished", 7, 7, 2)
    results = {r["case_id"]: r for r in store.list_results(run_id)}
    assert "images" in results[too_many_images]["error"] and "RequestError" in results[too_many_images]["error"]
    assert results[too_long]["error"].startswith("TokenBudgetError")
    for case_id in good:
        response = results[case_id]["response"]
        assert set(response["answers"]) == {"urgent", "team"}
        assert results[case_id]["latency_ms"] > 0 and results[case_id]["input_tokens"] > 0
        assert results[case_id]["token_counts"]["total"] == results[case_id]["input_tokens"]
    assert runner.progress(run_id)["remaining"] == 0


def test_cancel_then_resume_finishes_without_redoing_cases(tmp_path, tiny_engine):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": example["state"]} for example in TICKET_SCHEMA["examples"]] * 2)
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    with pytest.raises(JobAlreadyRunningError):
        runner.start(run_id, tiny_engine)
    progress = wait_for(lambda: (p := runner.progress(run_id))["done"] >= 2 and p, 120, "the first chunk")
    assert progress["live"] and progress["rate_per_s"] > 0 and progress["eta_s"] > 0
    assert runner.cancel(run_id)
    assert runner.wait(run_id, timeout=120)
    run = store.get_run(run_id)
    assert run["status"] == "cancelled" and 2 <= run["done"] < run["total"]
    first_results = {r["case_id"]: r["finished_at"] for r in store.list_results(run_id)}

    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    run = store.get_run(run_id)
    assert run["status"] == "finished" and run["done"] == run["total"] == 10
    after = {r["case_id"]: r["finished_at"] for r in store.list_results(run_id)}
    assert all(after[case_id] == stamp for case_id, stamp in first_results.items())  # not redone


CHILD = """
import sys, clef_engine
from clef_workbench.store import Store
from clef_workbench.jobs import JobRunner
store = Store(sys.argv[1])
runner = JobRunner(store)
runner.start(int(sys.argv[2]), clef_engine.load(sys.argv[3], device="cpu", dtype="float32"))
runner.wait(int(sys.argv[2]))
"""


@pytest.mark.kill
def test_resume_after_the_running_process_is_killed(tmp_path, tiny_release, tiny_engine):
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    case_ids = store.add_cases(set_id, [{"state": example["state"]} for example in TICKET_SCHEMA["examples"]] * 3)
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db), str(run_id), str(tiny_release)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: store.get_run(run_id)["done"] >= 2 or child.poll() is not None, 180, "first results")
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        child.send_signal(signal.SIGKILL)  # no clean-up code runs: like a crash or a power cut
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    child.stderr.close()

    run = store.get_run(run_id)
    killed_at = run["done"]
    assert run["status"] == "running" and 2 <= killed_at < len(case_ids)
    before = {r["case_id"]: (r["id"], r["finished_at"], json.dumps(r["response"])) for r in store.list_results(run_id)}

    runner = JobRunner(store)  # a fresh process-wide runner, as after a restart
    assert runner.progress(run_id)["interrupted"]
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=180)

    results = store.list_results(run_id)
    assert store.get_run(run_id)["status"] == "finished"
    assert sorted(r["case_id"] for r in results) == sorted(case_ids)  # none lost, none duplicated
    assert all(r["response"] and not r["error"] for r in results)
    for r in results:
        if r["case_id"] in before:  # finished before the kill: kept exactly as written, not redone
            assert (r["id"], r["finished_at"], json.dumps(r["response"])) == before[r["case_id"]]
    assert len(results) - len(before) == len(case_ids) - killed_at


def test_a_second_runner_on_the_same_run_is_refused_then_resumes_once_the_first_is_gone(tmp_path, tiny_engine):
    """Two processes asked to run one run (two runners, each with its own connection to the file): the second is
    refused while the first works, so no case is computed twice; a lease whose holder died is taken over at once."""
    import socket

    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": example["state"]} for example in TICKET_SCHEMA["examples"]] * 2)
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))
    first, second = JobRunner(Store(db)), JobRunner(Store(db))
    first.start(run_id, tiny_engine)
    with pytest.raises(JobAlreadyRunningError, match="being run by another process"):
        second.start(run_id, tiny_engine)
    progress = second.progress(run_id)
    assert progress["elsewhere"] and not progress["interrupted"] and not progress["live"]
    assert first.wait(run_id, timeout=180)
    assert store.get_run(run_id)["status"] == "finished" and store.run_lease_holder(run_id) is None

    # a holder whose process is gone (killed: no release ran) does not block the next runner
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ghost = f"{socket.gethostname()}:{int(dead.stdout)}:ghost"
    assert store.acquire_run_lease(run_id, ghost, ttl_s=3600) is None
    assert store.run_lease_holder(run_id) is None
    # a live holder on another host blocks until its lease expires
    assert store.acquire_run_lease(run_id, "other-host:1:x", ttl_s=3600) is None
    with pytest.raises(JobAlreadyRunningError):
        second.start(run_id, tiny_engine)
    assert store.acquire_run_lease(run_id, "other-host:1:x", ttl_s=-1) is None  # it stopped renewing
    second.start(run_id, tiny_engine)
    assert second.wait(run_id, timeout=60)
    assert store.run_lease_holder(run_id) is None


def test_chunks_are_sized_by_tokens_and_the_next_one_is_queued_before_the_last_is_written(tmp_path, tiny_engine):
    """The GPU never waits for the store: chunk n+1 is on the engine's queue before chunk n's results are written;
    after the first chunks, a chunk holds about `chunk_tokens` tokens of cases."""
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("sized")
    states = [f"ticket {i}: " + "my invoice is wrong " * (1 + i % 5) for i in range(24)]
    store.add_cases(set_id, [{"state": s} for s in states])
    first_tokens = sum(tiny_engine.count_tokens(build_request({"state": s}, SMALL_SCHEMA))["total"]
                       for s in states[:8])
    chunk_tokens = 3 * first_tokens // 8
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="demo",
                              settings=RunSettings(chunk_tokens=chunk_tokens))
    events: list[tuple[str, int]] = []

    class Recording:
        def validate(self, request, **budget):
            return tiny_engine.validate(request, **budget)

        def decide_many(self, requests, **options):
            return tiny_engine.decide_many(requests, **options)

        def submit(self, requests, **options):
            events.append(("submit", len(requests)))
            return tiny_engine.submit(requests, **options)

    record_results = store.record_results

    def recording_results(run, results):
        events.append(("write", len(results)))
        return record_results(run, results)

    store.record_results = recording_results
    runner = JobRunner(store)
    runner.start(run_id, Recording())
    assert runner.wait(run_id, timeout=120)
    assert store.get_run(run_id)["status"] == "finished" and store.get_run(run_id)["done"] == 24
    sizes = [n for kind, n in events if kind == "submit"]
    assert sizes[:3] == [8, 8, chunk_tokens * 8 // first_tokens] and sum(sizes) == 24
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["submit", "submit", "write"]  # the second chunk was queued before the first was written


def test_one_case_over_the_token_budget_costs_its_chunk_nothing(tmp_path, tiny_engine, monkeypatch):
    """A chunk of 64 cases, one of them over the run's token budget: the other 63 go to the GPU in one batch (not
    one by one, as when the over-budget case refused the whole chunk), the bad one gets its own error result."""
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("one too long")
    states = [f"ticket {i}: my invoice is wrong" for i in range(64)]
    states[30] = "word " * 400  # over max_length=400 with overflow refuse
    case_ids = store.add_cases(set_id, [{"state": state} for state in states])
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="demo",
                              settings=RunSettings(chunk_size=64, max_length=400))
    batches: list[int] = []
    run_batch = tiny_engine.scheduler.run_batch

    def counting(records, steps):
        batches.append(len(records))
        return run_batch(records, steps)

    monkeypatch.setattr(tiny_engine.scheduler, "run_batch", counting)
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)

    assert batches == [63]  # one GPU pass for the 63 good cases
    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["errors"]) == ("finished", 64, 1)
    results = {r["case_id"]: r for r in store.list_results(run_id)}
    assert results[case_ids[30]]["error"].startswith("TokenBudgetError") and results[case_ids[30]]["response"] is None
    assert all(set(results[c]["response"]["answers"]) == {"urgent", "team"} for c in case_ids if c != case_ids[30])


def test_decide_chunk_on_a_replica_answers_the_good_cases_in_one_batch(tiny_engine, monkeypatch):
    """The Ray replica's chunk (clef_workbench.distributed.decide_chunk) uses the same per-record outcomes."""
    from clef_workbench.distributed import decide_chunk

    requests = [build_request({"state": f"ticket {i}: refund please"}, SMALL_SCHEMA) for i in range(12)]
    requests[5] = build_request({"state": "word " * 400}, SMALL_SCHEMA)
    batches: list[int] = []
    run_batch = tiny_engine.scheduler.run_batch
    monkeypatch.setattr(tiny_engine.scheduler, "run_batch", lambda records, steps: batches.append(len(records))
                        or run_batch(records, steps))
    results = decide_chunk(tiny_engine, list(enumerate(requests)), RunSettings(max_length=400))
    assert batches == [11]
    assert [r["case_id"] for r in results] == list(range(12))
    assert results[5]["error"].startswith("TokenBudgetError") and "response" not in results[5]
    assert all(r["response"]["answers"] for r in results if r["case_id"] != 5)


def test_a_store_that_stops_taking_results_fails_the_run_with_one_message_and_resume_completes_it(tmp_path,
                                                                                                   tiny_engine):
    import sqlite3

    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"ticket {i}: my invoice is wrong"} for i in range(12)])
    run_id = store.create_run(set_id, schema=SMALL_SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))
    record_results = store.record_results
    writes = [0]

    def full_disk_on_the_third_write(run, results):
        writes[0] += 1
        if writes[0] == 3:
            raise sqlite3.OperationalError("database or disk is full")
        return record_results(run, results)

    store.record_results = full_disk_on_the_third_write
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    run = store.get_run(run_id)
    assert (run["status"], run["done"]) == ("failed", 4)
    assert run["error"] == (f"the database {store.path} stopped taking writes (database or disk is full); the run "
                            "stopped with its finished results kept: resume it once the database is writable")
    assert tiny_engine.scheduler.queue_depth() == 0  # the chunk queued behind the failed one was not left running
    progress = runner.progress(run_id)
    assert not progress["elsewhere"] and not progress["live"] and store.run_lease_holder(run_id) is None

    runner.start(run_id, tiny_engine)  # the disk has room again
    assert runner.wait(run_id, timeout=120)
    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["errors"]) == ("finished", 12, 0)
    results = store.list_results(run_id)
    assert len({r["case_id"] for r in results}) == len(results) == 12
