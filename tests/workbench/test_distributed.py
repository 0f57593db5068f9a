"""Batch runs on a real local Ray cluster (two CPU replicas of the tiny release): the same answers as the run done in
process, a replica killed mid-run costs no case and duplicates none, cancel and resume through a runner configured
by CLEF_RAY_ADDRESS (the Runs page's path), and a release missing on a node names the node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from clef_workbench.jobs import JobRunner
from clef_workbench.store import RunSettings, Store
from tests.support import REPO, wait_for
from tests.support.ray_cluster import assert_same_answers, local_cluster

ray = pytest.importorskip("ray")  # in requirements.txt; the module below imports it where it is used

from clef_workbench import distributed  # noqa: E402
from clef_workbench.distributed import (  # noqa: E402
    RayJobRunner,
    ReplicaError,
    ReplicaPool,
    TokenEstimate,
    estimate_tokens,
    make_job_runner,
    token_chunks,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
# ~1,500 tokens a record: slow enough on the CPU that a replica can be killed with chunks in flight
TICKET_SCHEMA = json.loads((REPO / "schemas" / "support-ticket-routing.json").read_text())
TICKET_SCHEMA.pop("examples")
TICKETS = [{"state": example["state"]} for example in json.loads(
    (REPO / "schemas" / "support-ticket-routing.json").read_text())["examples"]]
SETTINGS = RunSettings(chunk_size=4, max_length=3_000)


def ticket_set(store: Store, copies: int, *, bad_cases: bool = False) -> int:
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [dict(ticket, tags=[f"copy-{n}"]) for n in range(copies) for ticket in TICKETS])
    if bad_cases:
        store.add_case(set_id, state="five photos", images=[PNG] * 5)  # invalid: at most 4 images
        store.add_case(set_id, state="word " * 3_000)  # over max_length 3,000 with overflow refuse
    return set_id


def in_process_results(store: Store, set_id: int, engine) -> list[dict]:
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=SETTINGS)
    runner = JobRunner(store)
    runner.start(run_id, engine)
    assert runner.wait(run_id, timeout=300)
    assert store.get_run(run_id)["status"] == "finished"
    return store.list_results(run_id)


def test_chunks_follow_the_token_estimate_and_keep_every_case_once(tmp_path, monkeypatch):
    store = Store(tmp_path / "w.db")
    set_id = ticket_set(store, 4)
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo")
    case_ids = store.unfinished_case_ids(run_id)
    one = estimate_tokens({"state": TICKETS[0]["state"], "questions": TICKET_SCHEMA["questions"]})
    assert 400 < one < 1_000  # the schema's ~2,000 characters and a short ticket, at ~4 characters a token
    chunks = list(token_chunks(store, store.get_run(run_id), case_ids, chunk_tokens=3 * one))
    assert [case_id for chunk in chunks for case_id, _ in chunk] == case_ids
    assert all(1 <= len(chunk) <= 3 for chunk in chunks) and len(chunks) >= len(case_ids) // 3
    assert [len(chunk) for chunk in token_chunks(store, store.get_run(run_id), case_ids, chunk_tokens=1)] == [1] * 20
    assert chunks[0][0][1]["questions"] == TICKET_SCHEMA["questions"]

    # the replicas counted 3x the estimate: the chunks cut after that hold a third as many cases
    tokens = TokenEstimate()
    lazy = token_chunks(store, store.get_run(run_id), case_ids, chunk_tokens=6 * one, tokens=tokens)
    first = next(lazy)
    assert len(first) >= 5
    tokens.observe(first, [{"case_id": case_id, "input_tokens": 3 * estimate_tokens(request)}
                           for case_id, request in first])
    assert 1 <= len(next(lazy)) <= 2

    monkeypatch.setattr(distributed, "MAX_CASES_PER_CHUNK", 3)  # many short cases: the engine queue's limit cuts
    assert [len(c) for c in token_chunks(store, store.get_run(run_id), case_ids, chunk_tokens=10**9)] == [3] * 6 + [2]


def test_the_configuration_picks_where_runs_execute(tmp_path, monkeypatch):
    store = Store(tmp_path / "w.db")
    monkeypatch.delenv("CLEF_RAY_ADDRESS", raising=False)
    assert type(make_job_runner(store)) is JobRunner
    monkeypatch.setenv("CLEF_RAY_ADDRESS", "  ")
    assert type(make_job_runner(store)) is JobRunner
    monkeypatch.setenv("CLEF_RAY_ADDRESS", "auto")
    runner = make_job_runner(store)
    assert isinstance(runner, RayJobRunner) and runner.address == "auto"
    assert make_job_runner(store, address="10.0.0.1:6379").address == "10.0.0.1:6379"


NO_CLUSTER_HERE = """
import functools
from ray._private import services
services.find_gcs_addresses = functools.cache(lambda: [])  # whatever other clusters run on this machine
services.find_bootstrap_address = lambda temp_dir: None
from clef_workbench.distributed import ReplicaError, connect
try:
    connect("auto")
except ReplicaError as error:
    print(error)
"""


def test_no_cluster_to_join_is_an_error_naming_our_flag_and_variable_not_rays():
    # A fresh interpreter: this session may already be connected to the test cluster, and then connect does nothing.
    done = subprocess.run([sys.executable, "-c", NO_CLUSTER_HERE], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    message = done.stdout.strip()
    assert message.startswith("cannot join the Ray cluster at 'auto': Could not find any running Ray instance."), \
        done.stdout + done.stderr
    assert "--ray ADDRESS" in message and "CLEF_RAY_ADDRESS" in message
    assert "--address" not in message and " RAY_ADDRESS" not in message


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.kill
def test_ray_run_answers_as_in_process_with_a_replica_killed_mid_run(tmp_path, tiny_release, tiny_engine):
    local_cluster()
    store = Store(tmp_path / "w.db")
    set_id = ticket_set(store, 4, bad_cases=True)
    expected = in_process_results(store, set_id, tiny_engine)

    pool = ReplicaPool.start(str(tiny_release), replicas=2)
    try:
        assert pool.info["replicas"] == 2 and pool.info["device"] == "cpu" and len(pool.slots) == 2
        run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=SETTINGS)
        runner = RayJobRunner(store, pool=pool, chunk_tokens=1)  # one case a chunk: many chunks to lose
        runner.start(run_id, None)
        progress = wait_for(lambda: (p := runner.progress(run_id))["done"] >= 2 and p, 300, "first results")
        assert progress["live"] and progress["rate_per_s"] > 0 and progress["eta_s"] > 0
        assert progress["done"] < progress["total"] - 6, "the run ended too soon to kill a replica mid-run"
        killed = ray.get(pool.slots[0].actor.pid.remote())
        assert pool.slots[0].in_flight >= 1  # it dies with chunks in flight
        os.kill(killed, signal.SIGKILL)  # a crash: no clean-up runs
        assert runner.wait(run_id, timeout=300)
        assert len(pool.slots) == 2 and not pool.dropped  # Ray restarted it and sent it its chunks again
        assert ray.get(pool.slots[0].actor.pid.remote()) != killed
    finally:
        pool.close()

    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["total"], run["errors"]) == ("finished", 22, 22, 2), run["error"]
    results = store.list_results(run_id)
    assert len({r["case_id"] for r in results}) == len(results) == 22  # none lost, none duplicated
    assert_same_answers(expected, results)
    errors = {r["error"].split(":")[0] for r in results if r["error"]}
    assert errors == {"RequestError", "TokenBudgetError"}


@pytest.mark.slow
@pytest.mark.ray
def test_cancel_and_resume_on_ray_from_a_runner_configured_by_the_environment(tmp_path, tiny_engine, monkeypatch):
    """The Runs page's path: the process-wide runner comes from make_job_runner, runs start with the resident
    engine (whose release the replicas load), cancel stops after the chunks in flight, resume sends the rest."""
    monkeypatch.setenv("CLEF_RAY_ADDRESS", local_cluster())
    store = Store(tmp_path / "w.db")
    set_id = ticket_set(store, 4)
    expected = in_process_results(store, set_id, tiny_engine)
    run_id = store.create_run(set_id, schema=TICKET_SCHEMA, model_id="demo", settings=SETTINGS)
    runner = make_job_runner(store, chunk_tokens=1)
    runner.start(run_id, tiny_engine)
    wait_for(lambda: store.get_run(run_id)["done"] >= 1, 300, "first results")
    assert runner.cancel(run_id) and runner.progress(run_id)["cancelling"]
    assert runner.wait(run_id, timeout=300)
    run = store.get_run(run_id)
    assert run["status"] == "cancelled" and 1 <= run["done"] < run["total"], run
    first = {r["case_id"]: r["finished_at"] for r in store.list_results(run_id)}

    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=300)
    assert store.get_run(run_id)["status"] == "finished"
    results = store.list_results(run_id)
    assert all(r["finished_at"] == first[r["case_id"]] for r in results if r["case_id"] in first)  # not redone
    assert_same_answers(expected, results)
    assert store.run_lease_holder(run_id) is None


@pytest.mark.slow
@pytest.mark.ray
def test_a_release_missing_on_a_node_is_an_error_naming_the_node(tmp_path):
    local_cluster()
    with pytest.raises(ReplicaError) as caught:
        ReplicaPool.start(str(tmp_path / "no-release-here"), replicas=1)
    message = str(caught.value)
    assert f"on node {os.uname().nodename}" in message and "no-release-here" in message
    assert "does not exist" in message and "Traceback" not in message
