"""The store's foundation: errors, JSON and time helpers, one SQLite connection per thread, explicit read and write
transactions, migrations, and the append-only change log that soft deletes and restores write to."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from clef_engine.protocol import sniff_content_type
from clef_workbench.store.migrations import MIGRATIONS, SCHEMA_VERSION
from clef_workbench.store.rows import Change, ReviewItem

BUSY_TIMEOUT_MS = 30_000
CHANGE_KINDS = ("case_set", "case", "run", "schema")
RUN_STATUSES = ("pending", "running", "cancelled", "finished", "failed")  # a sweep's too


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


def _writable(path: Path) -> bool:
    """Whether this process may write the file (its effective user, as SQLite's open will be)."""
    return os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def filtered(query: str, filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """`query` (which has a WHERE) narrowed to rows whose columns equal the filters that are not None; its params."""
    given = {column: value for column, value in filters.items() if value is not None}
    return query + "".join(f" AND {column} = ?" for column in given), list(given.values())


class StoreBase:
    """Connections, transactions, migrations and the change log; the concern mixins build on these."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.read_only = False
        self._uri: str | None = None
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._choose_mode()
        self._local = threading.local()
        conn = self._conn()
        if not self.read_only:
            conn.execute("PRAGMA journal_mode=WAL")
        self._migrate(conn)

    def _choose_mode(self) -> None:
        """Open a database this process cannot write read-only, without side files: opened normally, a read-only
        file in WAL mode gets `-wal` and `-shm` side files created with its own read-only mode, which keep it
        unusable after its permissions are restored. Without a `-wal` file no connection has it open and the file
        holds every commit, so SQLite may treat it as immutable (no locks, no side files; what its owner writes
        later is for a store opened after); with one, it reads through the side files already there. Side files
        left read-only next to a writable database are named, for the same reason."""
        wal, shm = (self.path.with_name(self.path.name + suffix) for suffix in ("-wal", "-shm"))
        if self.path.exists() and not _writable(self.path):
            self.read_only = True
            self._uri = self.path.resolve().as_uri() + ("?mode=ro" if wal.exists() else "?mode=ro&immutable=1")
            return
        for side_file in (wal, shm):
            if side_file.exists() and not _writable(side_file):
                raise StoreError(f"the database file {side_file} is read-only for this user: nothing was read or "
                                 "written; make it writable (chmod u+w) and try again")

    def require_writable(self) -> None:
        """Raise StoreError naming the file when this store was opened read-only."""
        if self.read_only:
            raise StoreError(f"the database file {self.path} is read-only for this user: nothing was written; make "
                             "it writable (chmod u+w) and try again")

    def _conn(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections must not be shared across threads)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: we issue BEGIN ourselves, so the transaction boundaries are explicit
            conn = sqlite3.connect(self._uri or self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   uri=self._uri is not None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._local.conn = conn
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding the write lock from its first statement (no lock upgrade deadlocks)."""
        self.require_writable()
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
        if self.read_only:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                raise StoreError(f"the database file {self.path} is read-only for this user and has database schema "
                                 f"version {version}, not this workbench's {SCHEMA_VERSION}: nothing was read; make "
                                 "it writable (chmod u+w) so that it can be upgraded, or use a matching workbench")
            return
        with self._write() as conn:  # a second process opening the same file waits here, then sees our version
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has database schema version {version}, newer than this workbench knows "
                                 f"({SCHEMA_VERSION}); upgrade the workbench or point CLEF_DB at another file")
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[number - 1]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={number}")

    @staticmethod
    def _insert(conn: sqlite3.Connection, table: str, **values: Any) -> int:
        """Write one row of `table` (column=value); its id."""
        row_id = conn.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                              list(values.values())).lastrowid
        if row_id is None:
            raise StoreError("the insert wrote no row")
        return row_id

    def _one(self, query: str, params: Sequence[Any], missing: str, conn: sqlite3.Connection | None = None
             ) -> sqlite3.Row:
        """The row `query` finds (on `conn`, else this thread's connection); NotFoundError(`missing`) if none."""
        row = (conn or self._conn()).execute(query, params).fetchone()
        if row is None:
            raise NotFoundError(missing)
        return row

    @staticmethod
    def _decoded(row: sqlite3.Row, *columns: str) -> dict[str, Any]:
        """The row as a dict, each `<column>_json` decoded under `column`."""
        item = dict(row)
        for column in columns:
            item[column] = _loads(item.pop(f"{column}_json"))
        return item

    def _set_status(self, table: str, row_id: int, status: str, error: str | None) -> None:
        """Move a run or a sweep to a status: `running` clears the last error and stamps started_at (the first
        time), `pending` changes the status only, the others stamp finished_at and keep `error`."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, not {status!r}")
        params: list[str | None]
        if status == "running":
            changes, params = ", error = NULL, finished_at = NULL, started_at = COALESCE(started_at, ?)", [now_iso()]
        elif status == "pending":
            changes, params = "", []
        else:
            changes, params = ", error = ?, finished_at = ?", [error, now_iso()]
        with self._write() as conn:
            if conn.execute(f"UPDATE {table} SET status = ?{changes} WHERE id = ?",
                            [status, *params, row_id]).rowcount != 1:
                raise NotFoundError(f"{table[:-1]} {row_id} does not exist")

    def schema_version(self) -> int:
        """The migration number this file is at."""
        return self._conn().execute("PRAGMA user_version").fetchone()[0]

    # -- the change log: every delete and restore, append-only ---------------------------------------------------

    def _log_change(self, conn: sqlite3.Connection, action: str, kind: str, object_id: Any, label: str, *,
                    who: str = "", data: Any = None) -> int:
        return self._insert(conn, "change_log", at=now_iso(), who=who or "", action=action, kind=kind,
                            object_id=str(object_id), label=label, data_json=None if data is None else _dumps(data))

    def _set_deleted(self, kind: str, object_id: int, *, deleted: bool, who: str,
                     label: Callable[[sqlite3.Row], str],
                     refuse: Callable[[sqlite3.Connection, sqlite3.Row], str | None] = lambda conn, row: None) -> None:
        """Soft-delete (or restore) one row of `kind`'s table and log it; `refuse` says why it may not be, if so."""
        table, words = {"case_set": ("case_sets", "case set"), "case": ("cases", "case"), "run": ("runs", "run")}[kind]
        with self._write() as conn:
            row = self._one(f"SELECT * FROM {table} WHERE id = ? AND deleted_at IS {'' if deleted else 'NOT '}NULL",
                            (object_id,), f"{words} {object_id} {'does not exist' if deleted else 'is not deleted'}",
                            conn)
            reason = refuse(conn, row)
            if reason:
                raise StoreError(reason)
            conn.execute(f"UPDATE {table} SET deleted_at = ? WHERE id = ?", (now_iso() if deleted else None, object_id))
            self._log_change(conn, "delete" if deleted else "restore", kind, object_id, label(row), who=who)

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
        query, params = filtered("SELECT * FROM change_log WHERE 1 = 1", {"kind": kind})
        rows = self._conn().execute(query + " ORDER BY id DESC", params).fetchall()
        return [cast(Change, self._decoded(row, "data")) for row in rows]
