"""The SQLite store on real files: case sets and media, results uniqueness, migrations of an old file, the
append-only audit log, undo, and reviewers racing from separate processes."""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from clef_workbench import store as store_module
from clef_workbench.store import (
    DuplicateNameError,
    NotFoundError,
    ReviewConflictError,
    Store,
    StoreError,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
WEBM = b"\x1a\x45\xdf\xa3" + b"\x00" * 32
SCHEMA = {"name": "tickets", "version": "3", "questions": {
    "team": {"type": "choice", "instructions": "Team?", "criteria": {"billing": None, "tech": None, "unknown": None}},
    "urgent": {"type": "noul", "instructions": "Urgent?"},
}}


def make_items(store: Store, n_cases: int) -> tuple[int, list[int]]:
    set_id = store.create_case_set("set")
    case_ids = store.add_cases(set_id, [{"state": {"n": i}} for i in range(n_cases)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo")
    store.queue_review_items([
        {"run_id": run_id, "case_id": case_id, "question_id": "team", "question_type": "choice",
         "distribution": {"billing": 0.5, "tech": 0.4, "unknown": 0.1}, "predicted": "billing", "confidence": 0.5,
         "margin": 0.1 + i / 100, "reason": "margin below 0.2", "model_id": "demo", "schema_name": "tickets",
         "schema_version": "3"}
        for i, case_id in enumerate(case_ids)
    ])
    return run_id, case_ids


def test_case_set_with_media_round_trips(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("claims", schema_name="damage", description="photos")
    case_id = store.add_case(set_id, state={"claim": "dent"}, images=[PNG], videos=[WEBM],
                             expected={"severity": 2, "covered": True}, tags=["car"])
    with pytest.raises(DuplicateNameError, match="'claims' already exists"):
        store.create_case_set("claims")
    assert store.get_or_create_case_set("claims") == set_id
    reopened = Store(tmp_path / "w.db")  # a second connection sees what the first committed
    case = reopened.get_case(case_id)
    assert case["state"] == {"claim": "dent"}
    assert case["expected"] == {"severity": 2, "covered": True}
    assert case["images"] == [{"content_type": "image/png", "data": PNG}]
    assert case["videos"] == [{"content_type": "video/webm", "data": WEBM}]
    listed = reopened.list_case_sets()
    assert listed[0]["name"] == "claims" and listed[0]["case_count"] == 1
    assert reopened._conn().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_bad_media_is_refused_and_nothing_is_added(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("s")
    with pytest.raises(ValueError, match="case 2: image is not PNG, JPEG or WebP"):
        store.add_cases(set_id, [{"state": "ok", "images": [PNG]}, {"state": "bad", "images": [b"GIF89a..."]}])
    assert store.list_cases(set_id) == []


def test_results_are_unique_per_run_and_case(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("s")
    case_ids = store.add_cases(set_id, [{"state": i} for i in range(3)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo")
    assert store.record_results(run_id, [{"case_id": case_ids[0], "response": {"answers": {}}}]) == 1
    # a resumed chunk that overlaps an earlier one adds only the new case
    assert store.record_results(run_id, [{"case_id": case_ids[0], "response": {"x": 1}},
                                         {"case_id": case_ids[1], "error": "boom"}]) == 1
    assert store.unfinished_case_ids(run_id) == [case_ids[2]]
    run = store.get_run(run_id)
    assert (run["total"], run["done"], run["errors"]) == (3, 2, 1)
    assert store.list_results(run_id)[0]["response"] == {"answers": {}}
    assert store.delete_error_results(run_id) == 1
    assert store.unfinished_case_ids(run_id) == case_ids[1:]


def test_migrating_a_version_1_file_keeps_its_data(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)  # build the file exactly as release 1 of the schema left it
    for statement in store_module.MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version=1")
    conn.execute("INSERT INTO case_sets (id, name, created_at) VALUES (1, 'legacy', '2025-01-01')")
    conn.execute("""INSERT INTO cases (id, case_set_id, position, state_json, expected_json, created_at)
                    VALUES (7, 1, 0, '{"a":1}', '{"urgent":true}', '2025-01-01')""")
    conn.execute("""INSERT INTO runs (id, case_set_id, schema_json, schema_name, schema_version, model_id,
                    status, created_at) VALUES (3, 1, ?, 'tickets', '3', 'demo', 'finished', '2025-01-01')""",
                 (store_module._dumps(SCHEMA),))
    conn.execute("""INSERT INTO results (run_id, case_id, response_json, latency_ms, input_tokens, started_at,
                    finished_at) VALUES (3, 7, '{"answers":{}}', 12.5, 40, '2025-01-01', '2025-01-01')""")
    conn.commit()
    conn.close()

    store = Store(path)
    assert store.schema_version() == store_module.SCHEMA_VERSION == 8
    # a run from before the schema history links no version: it ran a schema the history never saw
    assert (store.get_run(3)["schema_version"], store.get_run(3)["schema_slug"]) == ("3", None)
    assert store.list_cases(1)[0]["tags"] == []  # column added by migration 2 with its default
    assert store.list_cases(1)[0]["expected"] == {"urgent": True}
    assert store.list_results(3)[0]["latency_ms"] == 12.5
    assert store.list_results(3)[0]["token_counts"] is None
    added = store.queue_review_items([{"run_id": 3, "case_id": 7, "question_id": "urgent", "question_type": "noul",
                                       "distribution": {"true": 0.55, "false": 0.45}, "predicted": "true",
                                       "confidence": 0.55, "margin": 0.1, "reason": "r", "model_id": "demo",
                                       "schema_name": "tickets", "schema_version": "3"}])
    assert added == 1
    Store(path)  # opening an up-to-date file again is a no-op
    assert Store(path).schema_version() == store_module.SCHEMA_VERSION


def test_a_file_from_a_newer_workbench_is_refused(tmp_path):
    path = tmp_path / "new.db"
    Store(path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="schema version 99, newer than this workbench knows"):
        Store(path)


def test_audit_log_cannot_be_changed_or_deleted(tmp_path):
    store = Store(tmp_path / "w.db")
    run_id, _ = make_items(store, 1)
    item = store.list_review_items(run_id)[0]
    store.apply_review_action(item["id"], reviewer="ana", action="accept", expected_version=0)
    raw = sqlite3.connect(tmp_path / "w.db")  # even a direct connection, bypassing the Store, is stopped
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        raw.execute("UPDATE review_actions SET reviewer = 'mallory'")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        raw.execute("DELETE FROM review_actions")
    raw.close()
    with pytest.raises(StoreError, match="cannot be deleted"):
        store.delete_run(run_id)
    assert [a["reviewer"] for a in store.list_review_actions(run_id=run_id)] == ["ana"]


def test_actions_labels_and_undo_append_to_the_log(tmp_path):
    store = Store(tmp_path / "w.db")
    run_id, _ = make_items(store, 2)
    first, second = store.list_review_items(run_id)
    with pytest.raises(ValueError, match="reviewer name is required"):
        store.apply_review_action(first["id"], reviewer="  ", action="accept", expected_version=0)
    with pytest.raises(ValueError, match="'sales' is not an option"):
        store.apply_review_action(first["id"], reviewer="ana", action="correct", label="sales", expected_version=0)
    accepted = store.apply_review_action(first["id"], reviewer="ana", action="accept", expected_version=0)
    assert (accepted["status"], accepted["label"], accepted["version"]) == ("accepted", "billing", 1)
    corrected = store.apply_review_action(second["id"], reviewer="ana", action="correct", label="tech",
                                          expected_version=0)
    assert corrected["label"] == "tech"

    undone = store.undo_last_action("ana")  # the most recent one: the correction
    assert undone["id"] == second["id"] and undone["status"] == "open" and undone["label"] is None
    undone = store.undo_last_action("ana")  # then the accept
    assert undone["id"] == first["id"] and undone["status"] == "open"
    with pytest.raises(StoreError, match="no action left to undo"):
        store.undo_last_action("ana")
    log = store.list_review_actions(run_id=run_id)
    assert [a["action"] for a in log] == ["accept", "correct", "undo", "undo"]
    assert log[2]["undoes_action_id"] == log[1]["id"]
    assert log[2]["before"]["label"] == "tech" and log[2]["after"]["status"] == "open"
    assert store.review_progress(run_id)["open"] == 2


def test_undo_is_refused_after_someone_else_changed_the_item(tmp_path):
    store = Store(tmp_path / "w.db")
    run_id, _ = make_items(store, 1)
    item = store.list_review_items(run_id)[0]
    store.apply_review_action(item["id"], reviewer="ana", action="skip", expected_version=0)
    store.apply_review_action(item["id"], reviewer="ben", action="unknown", expected_version=1)
    with pytest.raises(ReviewConflictError, match="changed by ben"):
        store.undo_last_action("ana")
    assert store.get_review_item(item["id"])["status"] == "unknown"
    with pytest.raises(NotFoundError):
        store.get_review_item(9999)


def _reviewer_process(path: str, reviewer: str, item_ids: list[int], barrier, queue) -> None:
    store = Store(path)
    seen = {item_id: store.get_review_item(item_id)["version"] for item_id in item_ids}  # what the page showed
    barrier.wait()  # everyone clicks at the same moment
    applied, conflicts = [], []
    for item_id in item_ids:
        try:
            store.apply_review_action(item_id, reviewer=reviewer, action="correct", label="tech",
                                      expected_version=seen[item_id])
            applied.append(item_id)
        except ReviewConflictError:
            conflicts.append(item_id)
    queue.put((reviewer, applied, conflicts))


def test_concurrent_reviewers_never_lose_or_double_apply(tmp_path):
    path = tmp_path / "w.db"
    store = Store(path)
    run_id, _ = make_items(store, 30)
    item_ids = [i["id"] for i in store.list_review_items(run_id)]
    context = multiprocessing.get_context("fork")
    reviewers = ["ana", "ben", "cho", "dan"]
    barrier = context.Barrier(len(reviewers))
    queue = context.Queue()
    # each reviewer walks the queue in a different order so they collide on different items
    orders = [item_ids, item_ids[::-1], item_ids[1::2] + item_ids[::2], item_ids[::2] + item_ids[1::2]]
    processes = [context.Process(target=_reviewer_process, args=(str(path), name, order, barrier, queue))
                 for name, order in zip(reviewers, orders, strict=True)]
    for process in processes:
        process.start()
    outcomes = [queue.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0

    applied = [item for _, ok, _ in outcomes for item in ok]
    conflicts = [item for _, _, failed in outcomes for item in failed]
    assert sorted(applied) == sorted(item_ids)  # every item applied exactly once: none lost, none twice
    assert len(conflicts) == len(item_ids) * (len(reviewers) - 1)  # every other attempt got a clear conflict
    log = store.list_review_actions(run_id=run_id)
    assert len(log) == len(item_ids)
    winner = {entry["item_id"]: entry["reviewer"] for entry in log}
    for reviewer, ok, _ in outcomes:
        assert all(winner[item] == reviewer for item in ok)
    assert all(i["version"] == 1 and i["status"] == "corrected" for i in store.list_review_items(run_id))


def test_soft_deletes_are_logged_and_undone(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    first, second = store.add_cases(set_id, [{"state": "a"}, {"state": "b"}])
    store.delete_case(first, who="ana")
    assert [c["id"] for c in store.list_cases(set_id)] == [second] and store.get_case_set(set_id)["case_count"] == 1
    store.restore_case(first)
    assert [c["id"] for c in store.list_cases(set_id)] == [first, second]
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo")
    store.delete_run(run_id)
    assert store.list_runs() == [] and [r["id"] for r in store.list_runs(deleted=True)] == [run_id]
    with pytest.raises(NotFoundError):
        store.get_run(run_id)
    store.delete_case_set(set_id)  # its only run is deleted, so the set can go too
    with pytest.raises(StoreError, match="restore the case set 'tickets' first"):
        store.restore_run(run_id)
    with pytest.raises(DuplicateNameError, match="deleted case set named 'tickets' exists"):
        store.create_case_set("tickets")
    store.restore_case_set(set_id)
    store.restore_run(run_id)
    assert store.get_run(run_id)["total"] == 2
    log = [(c["action"], c["kind"], c["who"]) for c in reversed(store.list_changes())]
    assert log == [("delete", "case", "ana"), ("restore", "case", ""), ("delete", "run", ""),
                   ("delete", "case_set", ""), ("restore", "case_set", ""), ("restore", "run", "")]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._conn().execute("DELETE FROM change_log")


def test_importing_the_same_cases_twice_adds_them_once(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    rows = [{"state": {"n": i}, "expected": {"urgent": i % 2 == 0}, "tags": ["t"]} for i in range(10)]
    rows.append(dict(rows[0]))  # a row repeated in the file is a case of its own
    assert len(store.add_cases(set_id, rows, skip_existing=True)) == 11
    assert store.add_cases(set_id, rows, skip_existing=True) == []
    assert store.get_case_set(set_id)["case_count"] == 11
    changed = [{**rows[1], "expected": {"urgent": True}}]
    assert len(store.add_cases(set_id, changed, skip_existing=True)) == 1, "different content is a new case"
    assert len(store.add_cases(set_id, rows[:1])) == 1, "without skip_existing every case is added"


def test_drafts_round_trip_by_key(tmp_path):
    store = Store(tmp_path / "w.db")
    assert store.load_draft("decide:x") is None
    store.save_draft("decide:x", {"state_text": "hello", "rows": []})
    store.save_draft("decide:x", {"state_text": "hello again", "rows": []})
    assert Store(tmp_path / "w.db").load_draft("decide:x") == {"state_text": "hello again", "rows": []}
