"""SQLite persistence for case sets, runs, results and the review queue. The only module that speaks SQL.

One file (path configurable), WAL mode so readers never block the writer, foreign keys on, numbered migrations
tracked in `PRAGMA user_version`. Every write runs in a `BEGIN IMMEDIATE` transaction: the write lock is taken up
front, so two writers queue on SQLite's busy timeout instead of failing half-way. Review actions check the
version of the item the reviewer saw; a stale action is refused with `ReviewConflictError`, never applied twice.
The audit log (`review_actions`) is append-only, enforced by triggers.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from clef_engine.media import sniff_content_type

BUSY_TIMEOUT_MS = 30_000

RUN_STATUSES = ("pending", "running", "cancelled", "finished", "failed")
REVIEW_STATUSES = ("open", "accepted", "corrected", "unknown", "skipped")
REVIEW_ACTIONS = ("accept", "correct", "unknown", "skip")
# status an action leaves the item in
_ACTION_STATUS = {"accept": "accepted", "correct": "corrected", "unknown": "unknown", "skip": "skipped"}

# Each migration is a list of statements run in one transaction. Never edit a released migration: append a new one.
MIGRATIONS: list[list[str]] = [
    # 1: case sets, cases with media, runs and results
    [
        """CREATE TABLE case_sets (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            schema_name TEXT,
            description TEXT NOT NULL DEFAULT '',
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE cases (
            id INTEGER PRIMARY KEY,
            case_set_id INTEGER NOT NULL REFERENCES case_sets(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            state_json TEXT NOT NULL,
            expected_json TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL
        )""",
        "CREATE INDEX cases_by_set ON cases(case_set_id, position)",
        """CREATE TABLE case_media (
            id INTEGER PRIMARY KEY,
            case_id INTEGER NOT NULL REFERENCES cases(id) ON DELETE CASCADE,
            kind TEXT NOT NULL CHECK (kind IN ('image', 'video')),
            position INTEGER NOT NULL,
            content_type TEXT NOT NULL,
            data BLOB NOT NULL
        )""",
        "CREATE INDEX media_by_case ON case_media(case_id, kind, position)",
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            case_set_id INTEGER NOT NULL REFERENCES case_sets(id),
            schema_json TEXT NOT NULL,
            schema_name TEXT NOT NULL,
            schema_version TEXT NOT NULL,
            model_id TEXT NOT NULL,
            model_revision TEXT,
            status TEXT NOT NULL DEFAULT 'pending'
                CHECK (status IN ('pending', 'running', 'cancelled', 'finished', 'failed')),
            error TEXT,
            settings_json TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL,
            started_at TEXT,
            finished_at TEXT
        )""",
        """CREATE TABLE results (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            case_id INTEGER NOT NULL REFERENCES cases(id) ON DELETE CASCADE,
            response_json TEXT,
            error TEXT,
            latency_ms REAL,
            input_tokens INTEGER,
            started_at TEXT NOT NULL,
            finished_at TEXT NOT NULL,
            UNIQUE (run_id, case_id)
        )""",
    ],
    # 2: tags on cases, token counts per result, the review queue with its append-only audit log, review rules
    [
        "ALTER TABLE cases ADD COLUMN tags_json TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE results ADD COLUMN token_counts_json TEXT",
        """CREATE TABLE review_items (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            case_id INTEGER NOT NULL REFERENCES cases(id),
            question_id TEXT NOT NULL,
            question_type TEXT NOT NULL,
            distribution_json TEXT NOT NULL,
            predicted TEXT NOT NULL,
            confidence REAL NOT NULL,
            margin REAL NOT NULL,
            reason TEXT NOT NULL,
            model_id TEXT NOT NULL,
            schema_name TEXT NOT NULL,
            schema_version TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'open'
                CHECK (status IN ('open', 'accepted', 'corrected', 'unknown', 'skipped')),
            label_json TEXT,
            reviewer TEXT,
            version INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            UNIQUE (run_id, case_id, question_id)
        )""",
        "CREATE INDEX review_queue_order ON review_items(run_id, status, margin)",
        """CREATE TABLE review_actions (
            id INTEGER PRIMARY KEY,
            item_id INTEGER NOT NULL REFERENCES review_items(id),
            reviewer TEXT NOT NULL,
            at TEXT NOT NULL,
            action TEXT NOT NULL CHECK (action IN ('accept', 'correct', 'unknown', 'skip', 'undo')),
            before_json TEXT NOT NULL,
            after_json TEXT NOT NULL,
            undoes_action_id INTEGER REFERENCES review_actions(id)
        )""",
        "CREATE INDEX actions_by_reviewer ON review_actions(reviewer, id)",
        """CREATE TRIGGER review_actions_append_only_update BEFORE UPDATE ON review_actions
           BEGIN SELECT RAISE(ABORT, 'review_actions is an append-only audit log: rows cannot be changed'); END""",
        """CREATE TRIGGER review_actions_append_only_delete BEFORE DELETE ON review_actions
           BEGIN SELECT RAISE(ABORT, 'review_actions is an append-only audit log: rows cannot be deleted'); END""",
        """CREATE TABLE review_rules (
            schema_name TEXT PRIMARY KEY,
            rules_json TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(Exception):
    """A store operation was refused; the message says what and why."""


class DuplicateNameError(StoreError):
    """A case set with this name already exists."""


class NotFoundError(StoreError, KeyError):
    """The row asked for does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ReviewConflictError(StoreError):
    """The review item changed since the reviewer loaded it; the action was not applied."""

    def __init__(self, message: str, *, item: dict | None = None):
        super().__init__(message)
        self.item = item


def now_iso() -> str:
    """Current UTC time as ISO 8601 with milliseconds (sorts as text)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def media_content_type(data: bytes, kind: str) -> str:
    """Media type of an image or video from its magic bytes; raises ValueError naming what was expected."""
    expected = {"image": "PNG, JPEG or WebP", "video": "MP4, WebM or MOV"}
    if kind not in expected:
        raise ValueError(f"unknown media kind {kind!r}")
    content_type = sniff_content_type(data)
    if content_type is None or not content_type.startswith(f"{kind}/"):
        raise ValueError(f"{kind} is not {expected[kind]} (unrecognised file header)")
    return content_type


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    """All persistent state of the workbench in one SQLite file. Safe to share between threads and processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        self._migrate(conn)

    # -- connections and transactions ------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections must not be shared across threads)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: we issue BEGIN ourselves, so the transaction boundaries are explicit
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._local.conn = conn
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding the write lock from its first statement (no lock upgrade deadlocks)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: several SELECTs see one consistent snapshot."""
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (other threads' connections close when they are collected)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # a second process opening the same file waits here, then sees our version
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has database schema version {version}, newer than this workbench knows "
                    f"({SCHEMA_VERSION}); upgrade the workbench or point CLEF_DB at another file"
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[number - 1]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={number}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def schema_version(self) -> int:
        """The migration number this file is at."""
        return self._conn().execute("PRAGMA user_version").fetchone()[0]

    # -- case sets ---------------------------------------------------------------------------------------------

    def create_case_set(self, name: str, *, schema_name: str | None = None, description: str = "") -> int:
        """Create an empty case set; raises DuplicateNameError if the name is taken."""
        name = (name or "").strip()
        if not name:
            raise ValueError("case set name must not be empty")
        try:
            with self._write() as conn:
                cur = conn.execute(
                    "INSERT INTO case_sets (name, schema_name, description, created_at) VALUES (?, ?, ?, ?)",
                    (name, schema_name, description, now_iso()),
                )
                return int(cur.lastrowid)
        except sqlite3.IntegrityError as exc:
            raise DuplicateNameError(f"a case set named {name!r} already exists; choose another name") from exc

    def get_or_create_case_set(self, name: str, *, schema_name: str | None = None) -> int:
        """Id of the case set with this name, created if missing."""
        row = self._conn().execute("SELECT id FROM case_sets WHERE name = ?", (name.strip(),)).fetchone()
        if row:
            return int(row["id"])
        try:
            return self.create_case_set(name, schema_name=schema_name)
        except DuplicateNameError:  # another session created it between our SELECT and INSERT
            return int(self._conn().execute("SELECT id FROM case_sets WHERE name = ?", (name.strip(),)).fetchone()[0])

    def list_case_sets(self) -> list[dict]:
        """Every case set with its case count, newest first."""
        rows = self._conn().execute(
            """SELECT s.id, s.name, s.schema_name, s.description, s.created_at,
                      (SELECT COUNT(*) FROM cases c WHERE c.case_set_id = s.id) AS case_count
               FROM case_sets s ORDER BY s.id DESC"""
        ).fetchall()
        return [dict(r) for r in rows]

    def get_case_set(self, case_set_id: int) -> dict:
        row = self._conn().execute(
            """SELECT s.id, s.name, s.schema_name, s.description, s.created_at,
                      (SELECT COUNT(*) FROM cases c WHERE c.case_set_id = s.id) AS case_count
               FROM case_sets s WHERE s.id = ?""",
            (case_set_id,),
        ).fetchone()
        if row is None:
            raise NotFoundError(f"case set {case_set_id} does not exist")
        return dict(row)

    def update_case_set(
        self,
        case_set_id: int,
        *,
        name: str | None = None,
        schema_name: str | None = None,
        description: str | None = None,
    ) -> None:
        self.get_case_set(case_set_id)
        try:
            with self._write() as conn:
                if name is not None:
                    if not name.strip():
                        raise ValueError("case set name must not be empty")
                    conn.execute("UPDATE case_sets SET name = ? WHERE id = ?", (name.strip(), case_set_id))
                if schema_name is not None:
                    conn.execute("UPDATE case_sets SET schema_name = ? WHERE id = ?", (schema_name, case_set_id))
                if description is not None:
                    conn.execute("UPDATE case_sets SET description = ? WHERE id = ?", (description, case_set_id))
        except sqlite3.IntegrityError as exc:
            raise DuplicateNameError(f"a case set named {name!r} already exists; choose another name") from exc

    def delete_case_set(self, case_set_id: int) -> None:
        """Delete a case set and its cases; refused while runs of it exist (their results would be orphaned)."""
        with self._write() as conn:
            runs = conn.execute("SELECT COUNT(*) FROM runs WHERE case_set_id = ?", (case_set_id,)).fetchone()[0]
            if runs:
                raise StoreError(f"case set {case_set_id} has {runs} run(s); delete the runs first")
            conn.execute("DELETE FROM case_sets WHERE id = ?", (case_set_id,))

    # -- cases -------------------------------------------------------------------------------------------------

    def add_case(
        self,
        case_set_id: int,
        *,
        state: Any,
        images: list[bytes] | None = None,
        videos: list[bytes] | None = None,
        expected: dict[str, str | bool | int] | None = None,
        tags: list[str] | None = None,
    ) -> int:
        """Append one case (media stored with it as blobs); returns its id."""
        return self.add_cases(
            case_set_id, [{"state": state, "images": images, "videos": videos, "expected": expected, "tags": tags}]
        )[0]

    def add_cases(self, case_set_id: int, cases: list[dict]) -> list[int]:
        """Append several cases in one transaction: all are added or none (an import never half-lands)."""
        prepared = []
        for index, case in enumerate(cases):
            try:
                media = [
                    (kind, position, media_content_type(blob, kind), bytes(blob))
                    for kind in ("image", "video")
                    for position, blob in enumerate(case.get(kind + "s") or [])
                ]
                state_json = _dumps(case["state"])
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"case {index + 1}: {exc}") from exc
            prepared.append(
                (state_json, _dumps(case.get("expected") or {}), _dumps(list(case.get("tags") or [])), media)
            )
        ids: list[int] = []
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM case_sets WHERE id = ?", (case_set_id,)).fetchone() is None:
                raise NotFoundError(f"case set {case_set_id} does not exist")
            position = conn.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM cases WHERE case_set_id = ?", (case_set_id,)
            ).fetchone()[0]
            for state_json, expected_json, tags_json, media in prepared:
                cur = conn.execute(
                    """INSERT INTO cases (case_set_id, position, state_json, expected_json, tags_json, created_at)
                       VALUES (?, ?, ?, ?, ?, ?)""",
                    (case_set_id, position, state_json, expected_json, tags_json, now_iso()),
                )
                case_id = int(cur.lastrowid)
                conn.executemany(
                    "INSERT INTO case_media (case_id, kind, position, content_type, data) VALUES (?, ?, ?, ?, ?)",
                    [(case_id, kind, pos, ctype, blob) for kind, pos, ctype, blob in media],
                )
                ids.append(case_id)
                position += 1
        return ids

    def update_case(
        self,
        case_id: int,
        *,
        state: Any = ...,
        expected: dict[str, str | bool | int] | None = ...,  # type: ignore[assignment]
        tags: list[str] | None = ...,  # type: ignore[assignment]
    ) -> None:
        """Change the given fields of a case (media stay)."""
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM cases WHERE id = ?", (case_id,)).fetchone() is None:
                raise NotFoundError(f"case {case_id} does not exist")
            if state is not ...:
                conn.execute("UPDATE cases SET state_json = ? WHERE id = ?", (_dumps(state), case_id))
            if expected is not ...:
                conn.execute("UPDATE cases SET expected_json = ? WHERE id = ?", (_dumps(expected or {}), case_id))
            if tags is not ...:
                conn.execute("UPDATE cases SET tags_json = ? WHERE id = ?", (_dumps(list(tags or [])), case_id))

    def delete_case(self, case_id: int) -> None:
        with self._write() as conn:
            used = conn.execute("SELECT COUNT(*) FROM results WHERE case_id = ?", (case_id,)).fetchone()[0]
            if used:
                raise StoreError(f"case {case_id} has results in {used} run(s); delete those runs first")
            conn.execute("DELETE FROM cases WHERE id = ?", (case_id,))

    @staticmethod
    def _case_row(row: sqlite3.Row) -> dict:
        return {
            "id": row["id"],
            "case_set_id": row["case_set_id"],
            "position": row["position"],
            "state": _loads(row["state_json"]),
            "expected": _loads(row["expected_json"]),
            "tags": _loads(row["tags_json"]),
            "image_count": row["image_count"],
            "video_count": row["video_count"],
        }

    _CASE_SELECT = """SELECT c.*,
        (SELECT COUNT(*) FROM case_media m WHERE m.case_id = c.id AND m.kind = 'image') AS image_count,
        (SELECT COUNT(*) FROM case_media m WHERE m.case_id = c.id AND m.kind = 'video') AS video_count
        FROM cases c"""

    def list_cases(self, case_set_id: int) -> list[dict]:
        """Cases of a set in order, without media bytes (counts only)."""
        rows = self._conn().execute(
            self._CASE_SELECT + " WHERE c.case_set_id = ? ORDER BY c.position", (case_set_id,)
        ).fetchall()
        return [self._case_row(r) for r in rows]

    def get_case(self, case_id: int, *, with_media: bool = True) -> dict:
        """One case; with media, `images`/`videos` are lists of {content_type, data: bytes} in order."""
        with self._read() as conn:
            row = conn.execute(self._CASE_SELECT + " WHERE c.id = ?", (case_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"case {case_id} does not exist")
            case = self._case_row(row)
            if with_media:
                media = conn.execute(
                    "SELECT kind, content_type, data FROM case_media WHERE case_id = ? ORDER BY kind, position",
                    (case_id,),
                ).fetchall()
                case["images"] = [{"content_type": m["content_type"], "data": m["data"]} for m in media
                                  if m["kind"] == "image"]
                case["videos"] = [{"content_type": m["content_type"], "data": m["data"]} for m in media
                                  if m["kind"] == "video"]
        return case

    def get_cases(self, case_ids: list[int]) -> list[dict]:
        """Several cases with media, in the order asked."""
        return [self.get_case(case_id) for case_id in case_ids]

    # -- runs and results --------------------------------------------------------------------------------------

    def create_run(
        self,
        case_set_id: int,
        *,
        schema: dict,
        model_id: str,
        model_revision: str | None = None,
        settings: dict | None = None,
    ) -> int:
        """Record a run of a case set against a schema (a dict with name, version, questions); status pending."""
        if not isinstance(schema, dict) or not isinstance(schema.get("questions"), dict) or not schema["questions"]:
            raise ValueError("schema must be a dict with a non-empty 'questions' map")
        self.get_case_set(case_set_id)
        with self._write() as conn:
            cur = conn.execute(
                """INSERT INTO runs (case_set_id, schema_json, schema_name, schema_version, model_id, model_revision,
                                     settings_json, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                (
                    case_set_id,
                    _dumps(schema),
                    str(schema.get("name") or "unnamed"),
                    str(schema.get("version") or "1"),
                    model_id,
                    model_revision,
                    _dumps(settings or {}),
                    now_iso(),
                ),
            )
            return int(cur.lastrowid)

    @staticmethod
    def _run_row(row: sqlite3.Row) -> dict:
        run = dict(row)
        run["schema"] = _loads(run.pop("schema_json"))
        run["settings"] = _loads(run.pop("settings_json"))
        return run

    _RUN_SELECT = """SELECT r.*, s.name AS case_set_name,
        (SELECT COUNT(*) FROM cases c WHERE c.case_set_id = r.case_set_id) AS total,
        (SELECT COUNT(*) FROM results x WHERE x.run_id = r.id) AS done,
        (SELECT COUNT(*) FROM results x WHERE x.run_id = r.id AND x.error IS NOT NULL) AS errors
        FROM runs r JOIN case_sets s ON s.id = r.case_set_id"""

    def get_run(self, run_id: int) -> dict:
        """A run with its schema, settings and progress counts (total cases, done, errors)."""
        row = self._conn().execute(self._RUN_SELECT + " WHERE r.id = ?", (run_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"run {run_id} does not exist")
        return self._run_row(row)

    def list_runs(self, case_set_id: int | None = None) -> list[dict]:
        """Runs, newest first, optionally of one case set."""
        if case_set_id is None:
            rows = self._conn().execute(self._RUN_SELECT + " ORDER BY r.id DESC").fetchall()
        else:
            rows = self._conn().execute(
                self._RUN_SELECT + " WHERE r.case_set_id = ? ORDER BY r.id DESC", (case_set_id,)
            ).fetchall()
        return [self._run_row(r) for r in rows]

    def set_run_status(self, run_id: int, status: str, *, error: str | None = None) -> None:
        """Move a run to a status; `running` stamps started_at (first time), terminal states stamp finished_at."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {RUN_STATUSES}, not {status!r}")
        with self._write() as conn:
            if status == "running":
                conn.execute(
                    """UPDATE runs SET status = ?, error = NULL, finished_at = NULL,
                       started_at = COALESCE(started_at, ?) WHERE id = ?""",
                    (status, now_iso(), run_id),
                )
            elif status == "pending":
                conn.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run_id))
            else:
                conn.execute(
                    "UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
                    (status, error, now_iso(), run_id),
                )

    def delete_run(self, run_id: int) -> None:
        """Delete a run and its results; refused once reviewers have acted on it (the audit log is permanent)."""
        with self._write() as conn:
            acted = conn.execute(
                """SELECT COUNT(*) FROM review_actions a JOIN review_items i ON i.id = a.item_id
                   WHERE i.run_id = ?""",
                (run_id,),
            ).fetchone()[0]
            if acted:
                raise StoreError(f"run {run_id} has {acted} review action(s) in the audit log; it cannot be deleted")
            conn.execute("DELETE FROM review_items WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    def unfinished_case_ids(self, run_id: int) -> list[int]:
        """Cases of the run's case set that have no result yet, in case-set order."""
        rows = self._conn().execute(
            """SELECT c.id FROM cases c JOIN runs r ON r.case_set_id = c.case_set_id
               WHERE r.id = ? AND NOT EXISTS (SELECT 1 FROM results x WHERE x.run_id = r.id AND x.case_id = c.id)
               ORDER BY c.position""",
            (run_id,),
        ).fetchall()
        return [r[0] for r in rows]

    def record_results(self, run_id: int, results: list[dict]) -> int:
        """Write results of one chunk atomically. Each dict: case_id, response | error, latency_ms, input_tokens,
        token_counts, started_at, finished_at. A (run, case) already recorded is kept, not duplicated; returns
        how many rows were new."""
        stamp = now_iso()
        rows = [
            (
                run_id,
                r["case_id"],
                None if r.get("response") is None else _dumps(r["response"]),
                r.get("error"),
                r.get("latency_ms"),
                r.get("input_tokens"),
                None if r.get("token_counts") is None else _dumps(r["token_counts"]),
                r.get("started_at") or stamp,
                r.get("finished_at") or stamp,
            )
            for r in results
        ]
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(
                """INSERT INTO results (run_id, case_id, response_json, error, latency_ms, input_tokens,
                                        token_counts_json, started_at, finished_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, case_id) DO NOTHING""",
                rows,
            )
            return conn.total_changes - before

    def delete_error_results(self, run_id: int) -> int:
        """Forget the failed results of a run so that resuming it tries those cases again."""
        with self._write() as conn:
            return conn.execute("DELETE FROM results WHERE run_id = ? AND error IS NOT NULL", (run_id,)).rowcount

    def list_results(self, run_id: int) -> list[dict]:
        """Results of a run in case-set order, each with the case's state, expected answers and tags."""
        rows = self._conn().execute(
            """SELECT x.*, c.position, c.state_json, c.expected_json, c.tags_json FROM results x
               JOIN cases c ON c.id = x.case_id WHERE x.run_id = ? ORDER BY c.position""",
            (run_id,),
        ).fetchall()
        out = []
        for row in rows:
            item = dict(row)
            item["response"] = _loads(item.pop("response_json"))
            item["token_counts"] = _loads(item.pop("token_counts_json"))
            item["state"] = _loads(item.pop("state_json"))
            item["expected"] = _loads(item.pop("expected_json"))
            item["tags"] = _loads(item.pop("tags_json"))
            out.append(item)
        return out

    # -- review queue ------------------------------------------------------------------------------------------

    def get_review_rules(self, schema_name: str) -> dict | None:
        row = self._conn().execute("SELECT rules_json FROM review_rules WHERE schema_name = ?", (schema_name,))
        found = row.fetchone()
        return None if found is None else _loads(found[0])

    def save_review_rules(self, schema_name: str, rules: dict) -> None:
        with self._write() as conn:
            conn.execute(
                """INSERT INTO review_rules (schema_name, rules_json, updated_at) VALUES (?, ?, ?)
                   ON CONFLICT (schema_name) DO UPDATE SET rules_json = excluded.rules_json,
                   updated_at = excluded.updated_at""",
                (schema_name, _dumps(rules), now_iso()),
            )

    def queue_review_items(self, items: list[dict]) -> int:
        """Add items to the review queue with their reason frozen now. Each dict: run_id, case_id, question_id,
        question_type, distribution {option: p}, predicted, confidence, margin, reason, model_id, schema_name,
        schema_version. An item already queued for the same (run, case, question) is left as it is. Returns the
        number added."""
        stamp = now_iso()
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(
                """INSERT INTO review_items (run_id, case_id, question_id, question_type, distribution_json,
                       predicted, confidence, margin, reason, model_id, schema_name, schema_version,
                       created_at, updated_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (run_id, case_id, question_id) DO NOTHING""",
                [
                    (
                        i["run_id"], i["case_id"], i["question_id"], i["question_type"], _dumps(i["distribution"]),
                        str(i["predicted"]), float(i["confidence"]), float(i["margin"]), i["reason"],
                        i["model_id"], i["schema_name"], str(i["schema_version"]), stamp, stamp,
                    )
                    for i in items
                ],
            )
            return conn.total_changes - before

    @staticmethod
    def _item_row(row: sqlite3.Row) -> dict:
        item = dict(row)
        item["distribution"] = _loads(item.pop("distribution_json"))
        item["label"] = _loads(item.pop("label_json"))
        return item

    def list_review_items(self, run_id: int, *, statuses: tuple[str, ...] | None = None) -> list[dict]:
        """Queue of a run, worst first: open items before skipped ones before done ones, each by smallest margin."""
        query = """SELECT * FROM review_items WHERE run_id = ?"""
        params: list[Any] = [run_id]
        if statuses:
            query += f" AND status IN ({','.join('?' * len(statuses))})"
            params.extend(statuses)
        query += """ ORDER BY CASE status WHEN 'open' THEN 0 WHEN 'skipped' THEN 1 ELSE 2 END,
                     margin ASC, confidence ASC, id ASC"""
        return [self._item_row(r) for r in self._conn().execute(query, params).fetchall()]

    def get_review_item(self, item_id: int) -> dict:
        row = self._conn().execute("SELECT * FROM review_items WHERE id = ?", (item_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"review item {item_id} does not exist")
        return self._item_row(row)

    def review_progress(self, run_id: int) -> dict[str, int]:
        """Counts per status plus total and reviewed (accepted + corrected + unknown)."""
        rows = self._conn().execute(
            "SELECT status, COUNT(*) FROM review_items WHERE run_id = ? GROUP BY status", (run_id,)
        ).fetchall()
        counts = {status: 0 for status in REVIEW_STATUSES}
        counts.update({r[0]: r[1] for r in rows})
        counts["total"] = sum(counts[s] for s in REVIEW_STATUSES)
        counts["reviewed"] = counts["accepted"] + counts["corrected"] + counts["unknown"]
        return counts

    @staticmethod
    def _item_state(item: dict | sqlite3.Row) -> dict:
        return {"status": item["status"], "label": _loads(item["label_json"]), "reviewer": item["reviewer"]}

    def apply_review_action(
        self, item_id: int, *, reviewer: str, action: str, expected_version: int, label: Any = None
    ) -> dict:
        """Apply accept / correct / unknown / skip to an item, if it is still at the version the reviewer saw.

        accept labels the item with the model's answer; correct with `label` (option id, level or bool); unknown
        and skip carry no label. Raises ReviewConflictError if someone else acted first. Returns the new item."""
        reviewer = (reviewer or "").strip()
        if not reviewer:
            raise ValueError("reviewer name is required")
        if action not in REVIEW_ACTIONS:
            raise ValueError(f"action must be one of {REVIEW_ACTIONS}, not {action!r}")
        with self._write() as conn:
            row = conn.execute("SELECT * FROM review_items WHERE id = ?", (item_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"review item {item_id} does not exist")
            if row["version"] != expected_version:
                raise ReviewConflictError(
                    f"review item {item_id} was changed by {row['reviewer'] or 'another reviewer'} "
                    f"(now {row['status']!r}) after you loaded it; your {action!r} was not applied — reload it",
                    item=self._item_row(row),
                )
            allowed = list(_loads(row["distribution_json"]).keys())
            if action == "accept":
                new_label: Any = _coerce_label(row["question_type"], row["predicted"])
            elif action == "correct":
                if label is None:
                    raise ValueError("correct needs the right answer (an option id, a level or true/false)")
                new_label = _coerce_label(row["question_type"], label)
                if _label_key(new_label) not in allowed:
                    raise ValueError(f"{label!r} is not an option of question {row['question_id']!r}: {allowed}")
            else:
                new_label = None
            before = self._item_state(row)
            after = {"status": _ACTION_STATUS[action], "label": new_label, "reviewer": reviewer}
            self._set_item_state(conn, item_id, after)
            conn.execute(
                """INSERT INTO review_actions (item_id, reviewer, at, action, before_json, after_json)
                   VALUES (?, ?, ?, ?, ?, ?)""",
                (item_id, reviewer, now_iso(), action, _dumps(before), _dumps(after)),
            )
            return self._item_row(conn.execute("SELECT * FROM review_items WHERE id = ?", (item_id,)).fetchone())

    @staticmethod
    def _set_item_state(conn: sqlite3.Connection, item_id: int, state: dict) -> None:
        conn.execute(
            """UPDATE review_items SET status = ?, label_json = ?, reviewer = ?, version = version + 1,
               updated_at = ? WHERE id = ?""",
            (state["status"], None if state["label"] is None else _dumps(state["label"]), state["reviewer"],
             now_iso(), item_id),
        )

    def undo_last_action(self, reviewer: str, *, run_id: int | None = None) -> dict:
        """Undo this reviewer's most recent action that is not yet undone, by appending an `undo` entry and
        restoring the item's previous state. Refused if another reviewer changed the item since. Returns the item.
        """
        reviewer = (reviewer or "").strip()
        if not reviewer:
            raise ValueError("reviewer name is required")
        with self._write() as conn:
            query = """SELECT a.* FROM review_actions a JOIN review_items i ON i.id = a.item_id
                       WHERE a.reviewer = ? AND a.action != 'undo'
                         AND NOT EXISTS (SELECT 1 FROM review_actions u WHERE u.undoes_action_id = a.id)"""
            params: list[Any] = [reviewer]
            if run_id is not None:
                query += " AND i.run_id = ?"
                params.append(run_id)
            last = conn.execute(query + " ORDER BY a.id DESC LIMIT 1", params).fetchone()
            if last is None:
                raise StoreError(f"{reviewer} has no action left to undo")
            row = conn.execute("SELECT * FROM review_items WHERE id = ?", (last["item_id"],)).fetchone()
            current = self._item_state(row)
            if current != _loads(last["after_json"]):
                raise ReviewConflictError(
                    f"review item {row['id']} was changed by {row['reviewer']} after your {last['action']!r}; "
                    "it cannot be undone",
                    item=self._item_row(row),
                )
            restored = _loads(last["before_json"])
            self._set_item_state(conn, row["id"], restored)
            conn.execute(
                """INSERT INTO review_actions (item_id, reviewer, at, action, before_json, after_json,
                                               undoes_action_id) VALUES (?, ?, ?, 'undo', ?, ?, ?)""",
                (row["id"], reviewer, now_iso(), _dumps(current), _dumps(restored), last["id"]),
            )
            return self._item_row(conn.execute("SELECT * FROM review_items WHERE id = ?", (row["id"],)).fetchone())

    def list_review_actions(self, *, run_id: int | None = None, item_id: int | None = None) -> list[dict]:
        """The audit log in the order written, with before/after states decoded."""
        query = """SELECT a.*, i.run_id, i.case_id, i.question_id FROM review_actions a
                   JOIN review_items i ON i.id = a.item_id WHERE 1 = 1"""
        params: list[Any] = []
        if run_id is not None:
            query += " AND i.run_id = ?"
            params.append(run_id)
        if item_id is not None:
            query += " AND a.item_id = ?"
            params.append(item_id)
        rows = self._conn().execute(query + " ORDER BY a.id", params).fetchall()
        out = []
        for row in rows:
            entry = dict(row)
            entry["before"] = _loads(entry.pop("before_json"))
            entry["after"] = _loads(entry.pop("after_json"))
            out.append(entry)
        return out


def _label_key(label: str | bool | int) -> str:
    """The distribution key of a label: 'true'/'false' for noul, '2' for a score level, the id for a choice."""
    return str(label).lower() if isinstance(label, bool) else str(label)


def _coerce_label(question_type: str, value: Any) -> str | bool | int:
    """A label in the type expected answers use: bool for noul, int level for score, option id str for choice."""
    if question_type == "noul":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "1"):
            return True
        if text in ("false", "no", "0"):
            return False
        raise ValueError(f"{value!r} is not true or false")
    if question_type == "score":
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{value!r} is not a score level number") from exc
    return str(value)
