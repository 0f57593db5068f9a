"""A run says what happened: `failed` when every case failed, `finished with errors` (count, first error, retry of
the failed cases into the same run) when some did; exports of such runs never crash; a remote model is checked
before a run starts; `python -m clef_workbench run` exits 1 for a failed run. Real SQLite, the real tiny engine
behind a wrapper that fails chosen cases, and real HTTP endpoints on 127.0.0.1 (a closed port, a stub server)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from clef_engine.remote import RemoteEngine
from clef_workbench import case_table, casesets
from clef_workbench.__main__ import main
from clef_workbench.jobs import EngineUnreachableError, JobRunner
from clef_workbench.run_status import FINISHED_WITH_ERRORS, run_outcome
from clef_workbench.store import RunSettings, Store
from tests.support import REPO
from tests.support.endpoints import FailingEngine, RefusingEndpoint, serve
from tests.support.servers import free_port

SCHEMA_FILE = REPO / "schemas" / "support-ticket-routing.json"
SCHEMA = {"name": "small", "version": "1", "questions": {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None}},
}}


def make_run(tmp_path: Path, states: list[str], expected: dict | None = None) -> tuple[Store, int]:
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": s, **({"expected": expected} if expected else {})} for s in states])
    return store, store.create_run(set_id, schema=SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))


def run_to_end(store: Store, run_id: int, engine, **start) -> JobRunner:
    runner = JobRunner(store)
    runner.start(run_id, engine, **start)
    assert runner.wait(run_id, timeout=120)
    return runner


def test_a_run_whose_every_case_failed_is_failed_and_its_exports_list_the_errors(tmp_path, tiny_engine):
    store, run_id = make_run(tmp_path, [f"ticket {i}" for i in range(5)])
    run_to_end(store, run_id, FailingEngine(tiny_engine, {"ticket"}))

    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["errors"]) == ("failed", 5, 5)
    assert run["error"].startswith("every case failed (5 of 5); the first error: ClefError: engine fault")
    outcome = run_outcome(run, store.list_results(run_id))
    assert (outcome.label, outcome.tone, outcome.errors, outcome.can_retry) == ("failed", "error", 5, True)
    assert "0 of 5 cases have answers" in outcome.message

    # exports of a run without one answer: the errors, one per case, under the usual header (was KeyError)
    csv_lines = casesets.export_results_csv(store, run_id).splitlines()
    assert csv_lines[0].startswith("\ufeffrun_id,case_id,source_id,position,state,question_id") and len(csv_lines) == 6
    jsonl = [json.loads(line) for line in casesets.export_results_jsonl(store, run_id).splitlines()]
    assert [line["error"].startswith("ClefError") for line in jsonl] == [True] * 5


def test_some_failed_cases_finish_with_errors_and_retry_only_those_into_the_same_run(tmp_path, tiny_engine):
    states = ["my invoice is wrong", "flaky: the app crashes", "refund please", "flaky: login fails"]
    store, run_id = make_run(tmp_path, states, expected={"team": "billing"})
    engine = FailingEngine(tiny_engine, {"flaky"})
    run_to_end(store, run_id, engine)

    run = store.get_run(run_id)
    assert (run["status"], run["errors"]) == ("finished", 2)
    results = store.list_results(run_id)
    outcome = run_outcome(run, results)
    assert (outcome.label, outcome.tone, outcome.errors) == (FINISHED_WITH_ERRORS, "warning", 2)
    assert outcome.first_error == "ClefError: engine fault on 'flaky: the app crashes'"
    flaky_ids = [r["case_id"] for r in results if "flaky" in r["state"]]
    assert outcome.failed_case_ids == flaky_ids and outcome.can_retry
    answered_before = {r["case_id"]: r["finished_at"] for r in results if not r["error"]}

    engine.failing.clear()
    run_to_end(store, run_id, engine, retry_failed=True)
    run = store.get_run(run_id)
    assert (run["status"], run["done"], run["errors"]) == ("finished", 4, 0)
    after = {r["case_id"]: r for r in store.list_results(run_id)}
    assert all(after[case_id]["finished_at"] == stamp for case_id, stamp in answered_before.items())  # not redone
    assert all(after[case_id]["response"]["answers"] for case_id in flaky_ids)
    assert run_outcome(run, list(after.values())).label == "finished"


def test_a_run_on_a_remote_endpoint_that_stopped_is_refused_before_it_starts(tmp_path):
    store, run_id = make_run(tmp_path, ["a ticket"])
    server = serve(RefusingEndpoint)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    engine = RemoteEngine(url, max_retries=0)  # added while the endpoint was up
    server.shutdown()
    server.server_close()
    try:
        with pytest.raises(EngineUnreachableError) as refused:
            JobRunner(store).start(run_id, engine)
    finally:
        engine.close()
    assert str(refused.value).startswith("Run not started: its model's endpoint")
    assert f"could not reach {url}" in str(refused.value)
    run = store.get_run(run_id)
    assert (run["status"], run["done"]) == ("pending", 0)  # nothing ran, nothing recorded


def cli_db(tmp_path: Path) -> Path:
    store = Store(tmp_path / "w.db")
    store.add_cases(store.create_case_set("tickets"), [{"state": "my invoice is wrong"}, {"state": "app crash"}])
    return tmp_path / "w.db"


def test_the_cli_exits_1_for_a_run_whose_every_case_failed_and_for_an_endpoint_that_is_down(tmp_path, capsys):
    db = cli_db(tmp_path)
    server = serve(RefusingEndpoint)
    try:
        code = main(["run", "--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE),
                     "--model", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
    assert code == 1
    assert "run 1 failed: every case failed (2 of 2)" in capsys.readouterr().err
    assert Store(db).get_run(1)["status"] == "failed"

    closed = f"http://127.0.0.1:{free_port()}"
    code = main(["run", "--db", str(db), "--case-set", "tickets", "--schema", str(SCHEMA_FILE), "--model", closed])
    assert code == 1
    assert f"could not reach {closed}" in capsys.readouterr().err
    assert [r["id"] for r in Store(db).list_runs()] == [1]  # no run recorded for the refused one


def test_a_records_latency_is_its_share_of_its_own_batch_and_the_queue_wait_is_apart(tmp_path, tiny_engine):
    """The runner keeps a chunk queued behind the one on the engine, so a chunk's time from submission to answer
    includes the whole previous chunk. A record's latency must be its own batch's time shared by tokens: the
    latencies of one chunk add up to at most that chunk's time from submission to answer, and within one engine
    batch they are in proportion to the records' tokens."""
    tickets = json.loads(SCHEMA_FILE.read_text())
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": example["state"]} for example in tickets["examples"]] * 2)
    tickets.pop("examples")
    run_id = store.create_run(set_id, schema=tickets, model_id="demo", settings=RunSettings(chunk_size=2))
    run_to_end(store, run_id, tiny_engine)

    chunks: dict[tuple[str, str], list[dict]] = {}
    for result in store.list_results(run_id):
        chunks.setdefault((result["started_at"], result["finished_at"]), []).append(result)
    assert len(chunks) == 5 and all(len(chunk) == 2 for chunk in chunks.values())
    for chunk in chunks.values():
        responses = [r["response"] for r in chunk]
        assert [r["latency_ms"] for r in chunk] == [resp["x_compute_ms"] for resp in responses]
        # submission to answer, queueing included: every record of the chunk waited as long as the whole chunk
        wall = min(resp["x_latency_ms"] for resp in responses)
        rounding = 0.001 * len(chunk) + 0.01
        assert sum(r["latency_ms"] for r in chunk) <= wall + rounding
        assert all(0 <= resp["x_queue_ms"] <= resp["x_latency_ms"] for resp in responses)
        # one engine batch (two records fit its budget): compute in proportion to tokens
        per_token = [r["latency_ms"] / r["input_tokens"] for r in chunk]
        assert max(per_token) - min(per_token) <= 0.001 / min(r["input_tokens"] for r in chunk) * 2


def test_a_refused_case_deletion_writes_nothing_and_puts_the_rows_back_with_the_other_edits(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    ids = store.add_cases(set_id, [{"state": f"ticket {i}"} for i in range(4)])
    store.create_run(set_id, schema=SCHEMA, model_id="demo")  # its results would use every case
    original = case_table.editor_frame(store, set_id)
    edited = original[~original["id"].isin([ids[1], ids[2]])].copy()  # two rows deleted in the editor
    edited.loc[edited["id"] == ids[3], "state"] = "ticket 3, edited"
    edited = pd.concat([edited, pd.DataFrame([{"id": None, "state": "a new ticket"}])], ignore_index=True)

    with pytest.raises(case_table.CaseDeletionRefusedError) as refused:
        case_table.apply_case_edits(store, set_id, edited, None)
    assert refused.value.case_ids == [ids[1], ids[2]]
    assert [c["state"] for c in store.list_cases(set_id)] == [f"ticket {i}" for i in range(4)]  # nothing written

    shown = case_table.with_rows_restored(original, edited, refused.value.case_ids)
    assert shown["state"].tolist() == ["ticket 0", "ticket 1", "ticket 2", "ticket 3, edited", "a new ticket"]
    assert shown["id"].tolist()[:4] == ids
