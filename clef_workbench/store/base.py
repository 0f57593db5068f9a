"""The store's foundation: errors, JSON and time helpers, one SQLite connection per thread, explicit read and write
transactions, migrations, and the append-only change log that soft deletes and restores write to."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from clef_engine.protocol import sniff_content_type
from clef_workbench.store.migrations import MIGRATIONS, SCHEMA_VERSION
from clef_workbench.store.rows import Change, ReviewItem

BUSY_TIMEOUT_MS = 30_000
CHANGE_KINDS = ("case_set", "case", "run", "schema")


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

    def __init__(self, message: str, *, item: ReviewItem | None = None):
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


def inserted_id(cursor: sqlite3.Cursor) -> int:
    """The rowid of the row the cursor's INSERT just wrote."""
    if cursor.lastrowid is None:
        raise StoreError("the insert wrote no row")
    return cursor.lastrowid


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class StoreBase:
    """Connections, transactions, migrations and the change log; the concern mixins build on these."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._refuse_unwritable()
        self._local = threading.local()
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        self._migrate(conn)

    def _refuse_unwritable(self) -> None:
        """Refuse a database this process cannot write before SQLite opens it: opened, a read-only file in WAL mode
        gets `-wal` and `-shm` side files created with its own read-only mode, which keep it unusable after its
        permissions are restored. Side files already left read-only are named, for the same reason."""
        for path in (self.path, self.path.with_name(self.path.name + "-wal"),
                     self.path.with_name(self.path.name + "-shm")):
            if path.exists() and not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
                raise StoreError(f"the database file {path} is read-only for this user: nothing was read or written; "
                                 "make it writable (chmod u+w) and try again")

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

    # -- the change log: every delete and restore, append-only ---------------------------------------------------

    @staticmethod
    def _log_change(conn: sqlite3.Connection, action: str, kind: str, object_id: Any, label: str, *,
                    who: str = "", data: Any = None) -> int:
        cur = conn.execute(
            "INSERT INTO change_log (at, who, action, kind, object_id, label, data_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (now_iso(), who or "", action, kind, str(object_id), label, None if data is None else _dumps(data)),
        )
        return inserted_id(cur)

    def log_change(self, action: str, kind: str, object_id: Any, label: str, *, who: str = "",
                   data: Any = None) -> int:
        """Append a delete or restore of something the store does not hold itself (a schema file, whose JSON goes
        in `data` so that it can be restored). Returns the entry's id."""
        if action not in ("delete", "restore") or kind not in CHANGE_KINDS:
            raise ValueError(f"action must be delete or restore and kind one of {CHANGE_KINDS}")
        with self._write() as conn:
            return self._log_change(conn, action, kind, object_id, label, who=who, data=data)

    def list_changes(self, *, kind: str | None = None) -> list[Change]:
        """The change log, newest first, `data` decoded."""
        query, params = "SELECT * FROM change_log", []
        if kind is not None:
            query += " WHERE kind = ?"
            params.append(kind)
        rows = self._conn().execute(query + " ORDER BY id DESC", params).fetchall()
        out = []
        for row in rows:
            entry = dict(row)
            entry["data"] = _loads(entry.pop("data_json"))
            out.append(cast(Change, entry))
        return out
