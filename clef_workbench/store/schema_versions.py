"""Schema history: every distinct content a library schema (a slug) was saved with, numbered 1, 2, 3… per slug, kept
forever (append-only, enforced by triggers). The JSON file in the library folder is the current version; this table
is its past. A run links the version whose content it ran (`runs.schema_version_id`), found by content, so runs
compare exactly across versions.

Two hashes per version: `content_hash` over everything but the version number (a save that changes nothing is not a
new version), and `run_hash` over what a run keeps of a schema (name, description, questions: runs drop the example
states), by which a run finds its version.
"""

from __future__ import annotations

import hashlib
import sqlite3
from typing import Any, cast

from clef_workbench.store.base import StoreBase, _dumps, now_iso
from clef_workbench.store.rows import RecordedSchemaVersion, SchemaVersion

# Why a version was written: the library's operations, "adopt" for a sweep's result made the schema's new version
# (its note names the sweep and its figures), and "on disk" for a file changed outside the workbench (a git pull,
# an editor) that the workbench read.
SCHEMA_VERSION_ACTIONS = ("create", "update", "duplicate", "import", "restore", "adopt", "on disk")


def _digest(value: Any) -> str:
    # key order is kept (not sorted): the order of questions and options is what the model reads
    return hashlib.sha256(_dumps(value).encode()).hexdigest()


def schema_hashes(schema: dict) -> tuple[str, str]:
    """(content hash, run hash) of a schema dict (a library file's content or a run's schema)."""
    run_part = {"name": schema.get("name"), "description": schema.get("description") or "",
                "questions": schema.get("questions")}
    return _digest({**run_part, "examples": schema.get("examples") or []}), _digest(run_part)


class SchemaVersionsMixin(StoreBase):
    _VERSION_SELECT = """SELECT v.*, (SELECT COUNT(*) FROM runs r WHERE r.schema_version_id = v.id
                                       AND r.deleted_at IS NULL) AS run_count
                         FROM schema_versions v"""
    _LATEST = _VERSION_SELECT + " WHERE v.slug = ? ORDER BY v.number DESC LIMIT 1"

    def _version_row(self, row: sqlite3.Row) -> SchemaVersion:
        return cast(SchemaVersion, self._decoded(row, "schema"))

    def record_schema_version(self, slug: str, schema: dict, *, action: str, who: str = "",
                              note: str = "") -> RecordedSchemaVersion:
        """Keep `schema` (a library file's content) as the next version of `slug`, unless it is the content of the
        slug's latest version already. Returns that version, with `new` saying whether it was just written. Its
        number is one more than the latest, or the schema's own `version` if that is higher (a file that had
        versions before it had a history keeps its numbering); its `schema` carries that number."""
        if action not in SCHEMA_VERSION_ACTIONS:
            raise ValueError(f"action must be one of {SCHEMA_VERSION_ACTIONS}, not {action!r}")
        content_hash, run_hash = schema_hashes(schema)
        # The library records every file it reads: a read answers the usual case (unchanged) without the write lock.
        latest = self._conn().execute(self._LATEST, (slug,)).fetchone()
        if latest is not None and latest["content_hash"] == content_hash:
            return RecordedSchemaVersion(**self._version_row(latest), new=False)
        with self._write() as conn:
            latest = conn.execute(self._LATEST, (slug,)).fetchone()
            if latest is not None and latest["content_hash"] == content_hash:
                return RecordedSchemaVersion(**self._version_row(latest), new=False)
            own = schema.get("version")
            number = max((latest["number"] if latest is not None else 0) + 1,
                         own if isinstance(own, int) and not isinstance(own, bool) else 1)
            numbered = {**schema, "version": number}
            version_id = self._insert(conn, "schema_versions", slug=slug, number=number, content_hash=content_hash,
                                      run_hash=run_hash, schema_json=_dumps(numbered), action=action, who=who or "",
                                      note=note, created_at=now_iso())
        return RecordedSchemaVersion(**self.get_schema_version(version_id), new=True)

    def get_schema_version(self, version_id: int) -> SchemaVersion:
        return self._version_row(self._one(self._VERSION_SELECT + " WHERE v.id = ?", (version_id,),
                                           f"schema version {version_id} does not exist"))

    def list_schema_versions(self, slug: str) -> list[SchemaVersion]:
        """The versions of a slug, newest first, each with how many (not deleted) runs used it."""
        rows = self._conn().execute(self._VERSION_SELECT + " WHERE v.slug = ? ORDER BY v.number DESC",
                                    (slug,)).fetchall()
        return [self._version_row(r) for r in rows]

    def latest_schema_version(self, slug: str) -> SchemaVersion | None:
        row = self._conn().execute(self._LATEST, (slug,)).fetchone()
        return None if row is None else self._version_row(row)

    def get_schema_version_number(self, slug: str, number: int) -> SchemaVersion:
        return self._version_row(self._one(self._VERSION_SELECT + " WHERE v.slug = ? AND v.number = ?",
                                           (slug, number), f'schema "{slug}" has no version {number}'))

    def schema_history_slugs(self) -> list[str]:
        """Every slug with a history, sorted (deleted schemas included: their history stays)."""
        rows = self._conn().execute("SELECT DISTINCT slug FROM schema_versions ORDER BY slug").fetchall()
        return [r[0] for r in rows]


def find_version_row(conn: sqlite3.Connection, schema: dict, slug: str | None) -> sqlite3.Row | None:
    """The version whose content a run of `schema` runs: same run hash, the given slug's first, then the newest."""
    _, run_hash = schema_hashes(schema)
    return conn.execute(
        "SELECT * FROM schema_versions WHERE run_hash = ? ORDER BY (slug = ?) DESC, id DESC LIMIT 1",
        (run_hash, slug or ""),
    ).fetchone()
