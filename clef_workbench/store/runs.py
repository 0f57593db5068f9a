"""Runs of a case set against a schema, their per-case results, and the lease that lets one process at a time work
on a run. Deleting a run is soft (logged, restorable)."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import uuid
from dataclasses import replace
from typing import Any, cast

from clef_workbench.store.base import StoreBase, _dumps, _loads, filtered, now_iso
from clef_workbench.store.rows import NewResult, Result, Run, RunSettings
from clef_workbench.store.schema_versions import find_version_row


def new_lease_owner() -> str:
    """A lease owner id: host, process id and a random part (two runners in one process are two owners)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _owner_process_gone(owner: str) -> bool:
    """True when the owner ran on this host in a process that no longer exists (killed, crashed): its lease is
    void at once instead of after it expires. Owners on other hosts are judged by expiry alone."""
    host, _, rest = owner.partition(":")
    pid_text = rest.split(":", 1)[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False


def _run_label(row: sqlite3.Row) -> str:
    return f"run {row['id']} · {row['schema_name']}"


class RunsMixin(StoreBase):
    def create_run(self, case_set_id: int, *, schema: dict, model_id: str, model_revision: str | None = None,
                   settings: RunSettings = RunSettings()) -> int:
        """Record a pending run of a case set against a schema dict, linked to the schema history's version of this
        content (settings.schema_slug's first) and carrying its number; content never saved in the library links
        none and keeps the version its dict says."""
        if not isinstance(schema, dict) or not isinstance(schema.get("questions"), dict) or not schema["questions"]:
            raise ValueError("schema must be a dict with a non-empty 'questions' map")
        self.get_case_set(case_set_id)  # type: ignore[attr-defined]  # CaseSetsMixin's
        with self._write() as conn:
            version = find_version_row(conn, schema, settings.schema_slug)
            if version is not None:
                schema = {**schema, "version": version["number"]}
            return self._insert(conn, "runs", case_set_id=case_set_id, schema_json=_dumps(schema),
                                schema_name=str(schema.get("name") or "unnamed"),
                                schema_version=str(schema.get("version") or "1"),
                                schema_version_id=None if version is None else version["id"], model_id=model_id,
                                model_revision=model_revision, settings_json=_dumps(settings.to_json()),
                                created_at=now_iso())

    def _run_row(self, row: sqlite3.Row) -> Run:
        run = self._decoded(row, "schema")
        run["settings"] = RunSettings.from_json(_loads(run.pop("settings_json")))
        return cast(Run, run)

    _RUN_SELECT = """SELECT r.*, s.name AS case_set_name, v.slug AS schema_slug,
        (SELECT COUNT(*) FROM cases c WHERE c.case_set_id = r.case_set_id AND c.deleted_at IS NULL) AS total,
        (SELECT COUNT(*) FROM results x WHERE x.run_id = r.id) AS done,
        (SELECT COUNT(*) FROM results x WHERE x.run_id = r.id AND x.error IS NOT NULL) AS errors
        FROM runs r JOIN case_sets s ON s.id = r.case_set_id
        LEFT JOIN schema_versions v ON v.id = r.schema_version_id"""

    def get_run(self, run_id: int) -> Run:
        """A run with its schema, settings and progress counts (total cases, done, errors)."""
        return self._run_row(self._one(self._RUN_SELECT + " WHERE r.id = ? AND r.deleted_at IS NULL", (run_id,),
                                       f"run {run_id} does not exist"))

    def list_runs(self, case_set_id: int | None = None, *, deleted: bool = False) -> list[Run]:
        """Runs, newest first, optionally of one case set (with deleted=True: the deleted ones instead)."""
        query, params = filtered(f"{self._RUN_SELECT} WHERE r.deleted_at IS {'NOT ' if deleted else ''}NULL",
                                 {"r.case_set_id": case_set_id})
        rows = self._conn().execute(query + " ORDER BY r.id DESC", params).fetchall()
        return [self._run_row(r) for r in rows]

    def update_run_settings(self, run_id: int, **changes: Any) -> None:
        """Change a run's settings before it is retried or resumed (a budget that refused its cases): the cases it
        runs from then on use them; its answered cases keep their results."""
        settings = replace(self.get_run(run_id)["settings"], **changes)
        with self._write() as conn:
            conn.execute("UPDATE runs SET settings_json = ? WHERE id = ?", (_dumps(settings.to_json()), run_id))

    def set_run_status(self, run_id: int, status: str, *, error: str | None = None) -> None:
        self._set_status("runs", run_id, status, error)

    def delete_run(self, run_id: int, *, who: str = "") -> None:
        """Delete a run (soft: restore_run brings it back with its results); refused while a process works on it,
        and once reviewers have acted on it (the audit log is permanent)."""
        self._set_deleted("run", run_id, deleted=True, who=who, label=_run_label, refuse=self._delete_run_refusal)

    def delete_run_refusal(self, run_id: int) -> str | None:
        """Why delete_run would refuse the run now, or None: what a page says before it asks to confirm."""
        with self._read() as conn:
            row = self._one("SELECT * FROM runs WHERE id = ? AND deleted_at IS NULL", (run_id,),
                            f"run {run_id} does not exist", conn)
            return self._delete_run_refusal(conn, row)

    def _delete_run_refusal(self, conn: sqlite3.Connection, row: sqlite3.Row) -> str | None:
        acted = conn.execute("""SELECT COUNT(*) FROM review_actions a JOIN review_items i ON i.id = a.item_id
                                WHERE i.run_id = ?""", (row["id"],)).fetchone()[0]
        if acted:
            return (f"run {row['id']} cannot be deleted: reviewers have acted on it ({acted} review action(s), undone "
                    "ones included, in the audit log, which is kept)")
        return f"run {row['id']} is running; cancel it first" if self._live_owner(row) is not None else None

    def restore_run(self, run_id: int, *, who: str = "") -> None:
        """Undo delete_run."""
        def set_deleted(conn: sqlite3.Connection, row: sqlite3.Row) -> str | None:
            deleted_set = conn.execute("SELECT name FROM case_sets WHERE id = ? AND deleted_at IS NOT NULL",
                                       (row["case_set_id"],)).fetchone()
            return None if deleted_set is None else \
                f"restore the case set {deleted_set['name']!r} first: run {run_id} belongs to it"

        self._set_deleted("run", run_id, deleted=False, who=who, label=_run_label, refuse=set_deleted)

    # -- the lease: one process at a time works on a run -------------------------------------------------------

    @staticmethod
    def _live_owner(row: sqlite3.Row) -> str | None:
        owner, expires = row["lease_owner"], row["lease_expires_at"]
        if owner is None or expires is None or expires < time.time() or _owner_process_gone(owner):
            return None
        return owner

    def acquire_run_lease(self, run_id: int, owner: str, ttl_s: float) -> str | None:
        """Take the run's lease for `owner` for ttl_s seconds. Returns None on success, else the owner that holds a
        live lease (another process is working on the run). A lease whose holder's process is gone, or that was
        not renewed in time, is taken over."""
        with self._write() as conn:
            row = self._one("SELECT lease_owner, lease_expires_at FROM runs WHERE id = ? AND deleted_at IS NULL",
                            (run_id,), f"run {run_id} does not exist", conn)
            holder = self._live_owner(row)
            if holder is not None and holder != owner:
                return holder
            conn.execute("UPDATE runs SET lease_owner = ?, lease_expires_at = ? WHERE id = ?",
                         (owner, time.time() + ttl_s, run_id))
            return None

    def renew_run_lease(self, run_id: int, owner: str, ttl_s: float) -> bool:
        """Extend the lease if `owner` still holds it; False if it was lost (taken over after it expired)."""
        with self._write() as conn:
            cur = conn.execute("UPDATE runs SET lease_expires_at = ? WHERE id = ? AND lease_owner = ?",
                               (time.time() + ttl_s, run_id, owner))
            return cur.rowcount == 1

    def release_run_lease(self, run_id: int, owner: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE id = ? AND lease_owner = ?",
                         (run_id, owner))

    def run_lease_holder(self, run_id: int) -> str | None:
        """The owner holding a live lease on the run, or None."""
        row = self._conn().execute("SELECT lease_owner, lease_expires_at FROM runs WHERE id = ?",
                                   (run_id,)).fetchone()
        return None if row is None else self._live_owner(row)

    # -- results -----------------------------------------------------------------------------------------------

    def unfinished_case_ids(self, run_id: int) -> list[int]:
        """Cases of the run's case set that have no result yet, in case-set order."""
        rows = self._conn().execute(
            """SELECT c.id FROM cases c JOIN runs r ON r.case_set_id = c.case_set_id
               WHERE r.id = ? AND c.deleted_at IS NULL
                 AND NOT EXISTS (SELECT 1 FROM results x WHERE x.run_id = r.id AND x.case_id = c.id)
               ORDER BY c.position""", (run_id,)).fetchall()
        return [r[0] for r in rows]

    def record_results(self, run_id: int, results: list[NewResult]) -> int:
        """Write results of one chunk atomically. A (run, case) already recorded is kept, not duplicated; returns how
        many rows were new."""
        stamp = now_iso()
        rows = [(run_id, r["case_id"], None if r.get("response") is None else _dumps(r["response"]), r.get("error"),
                 r.get("latency_ms"), r.get("input_tokens"),
                 None if r.get("token_counts") is None else _dumps(r["token_counts"]),
                 r.get("started_at") or stamp, r.get("finished_at") or stamp) for r in results]
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(
                """INSERT INTO results (run_id, case_id, response_json, error, latency_ms, input_tokens,
                                        token_counts_json, started_at, finished_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, case_id) DO NOTHING""", rows)
            return conn.total_changes - before

    def delete_error_results(self, run_id: int) -> int:
        """Forget the failed results of a run so that resuming it tries those cases again."""
        with self._write() as conn:
            return conn.execute("DELETE FROM results WHERE run_id = ? AND error IS NOT NULL", (run_id,)).rowcount

    def list_results(self, run_id: int) -> list[Result]:
        """Results of a run in case-set order, each with the case's own id, state, expected answers and tags."""
        rows = self._conn().execute(
            """SELECT x.*, c.position, c.source_id, c.state_json, c.expected_json, c.tags_json FROM results x
               JOIN cases c ON c.id = x.case_id WHERE x.run_id = ? ORDER BY c.position""", (run_id,)).fetchall()
        columns = ("response", "token_counts", "state", "expected", "tags")
        return [cast(Result, self._decoded(row, *columns)) for row in rows]
