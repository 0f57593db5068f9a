"""Case sets and their cases (state, expected answers, tags, media blobs). Deletes are soft: the row is hidden,
kept, logged in the change log and can be restored. Each case carries a hash of its content, so importing the same
rows twice adds them once."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections import Counter
from typing import Any, cast

from clef_workbench.store.base import (
    DuplicateNameError,
    StoreBase,
    StoreError,
    _dumps,
    _loads,
    media_content_type,
    now_iso,
)
from clef_workbench.store.rows import Case, CaseSet, Label, Media, NewCase


def case_hash(state: Any, expected: Any, tags: Any, media: list[tuple[str, bytes]], source_id: str | None = None
              ) -> str:
    """Content hash of a case: its own id (when it has one), state, expected answers, tags and media bytes in
    order. Two tickets that say the same thing are two cases."""
    digest = hashlib.sha256()
    canonical = {"state": state, "expected": expected or {}, "tags": list(tags or [])}
    if source_id is not None:  # a case without one keeps the hash it was stored with
        canonical["source_id"] = source_id
    digest.update(json.dumps(canonical, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode())
    for kind, blob in media:
        digest.update(kind.encode() + hashlib.sha256(blob).digest())
    return digest.hexdigest()


def _case_label(row: sqlite3.Row) -> str:
    return f"case {row['id']}: {row['state_json'][:80]}"


class CaseSetsMixin(StoreBase):
    # -- case sets ---------------------------------------------------------------------------------------------

    def create_case_set(self, name: str, *, schema_name: str | None = None, description: str = "") -> int:
        """Create an empty case set; raises DuplicateNameError if the name is taken."""
        name = (name or "").strip()
        if not name:
            raise ValueError("case set name must not be empty")
        try:
            with self._write() as conn:
                return self._insert(conn, "case_sets", name=name, schema_name=schema_name, description=description,
                                    created_at=now_iso())
        except sqlite3.IntegrityError as exc:
            raise self._name_taken(name) from exc

    def _name_taken(self, name: str) -> DuplicateNameError:
        row = self._conn().execute("SELECT deleted_at FROM case_sets WHERE name = ?", (name,)).fetchone()
        if row is not None and row["deleted_at"]:
            return DuplicateNameError(f"a deleted case set named {name!r} exists; restore it or choose another name")
        return DuplicateNameError(f"a case set named {name!r} already exists; choose another name")

    def get_or_create_case_set(self, name: str, *, schema_name: str | None = None) -> int:
        """Id of the case set with this name, created if missing."""
        query = "SELECT id FROM case_sets WHERE name = ? AND deleted_at IS NULL"
        row = self._conn().execute(query, (name.strip(),)).fetchone()
        if row:
            return int(row["id"])
        try:
            return self.create_case_set(name, schema_name=schema_name)
        except DuplicateNameError:  # another session created it between our SELECT and INSERT
            row = self._conn().execute(query, (name.strip(),)).fetchone()
            if row is None:
                raise
            return int(row[0])

    _SET_SELECT = """SELECT s.id, s.name, s.schema_name, s.description, s.created_at, s.deleted_at,
        (SELECT COUNT(*) FROM cases c WHERE c.case_set_id = s.id AND c.deleted_at IS NULL) AS case_count
        FROM case_sets s"""

    def list_case_sets(self, *, deleted: bool = False) -> list[CaseSet]:
        """Every case set with its case count, newest first (with deleted=True: the deleted ones instead)."""
        where = "s.deleted_at IS NOT NULL" if deleted else "s.deleted_at IS NULL"
        rows = self._conn().execute(f"{self._SET_SELECT} WHERE {where} ORDER BY s.id DESC").fetchall()
        return [cast(CaseSet, dict(r)) for r in rows]

    def get_case_set(self, case_set_id: int) -> CaseSet:
        return cast(CaseSet, dict(self._one(self._SET_SELECT + " WHERE s.id = ? AND s.deleted_at IS NULL",
                                            (case_set_id,), f"case set {case_set_id} does not exist")))

    def update_case_set(self, case_set_id: int, *, name: str | None = None, schema_name: str | None = None,
                        description: str | None = None) -> None:
        self.get_case_set(case_set_id)
        if name is not None and not name.strip():
            raise ValueError("case set name must not be empty")
        changes = {"name": name and name.strip(), "schema_name": schema_name, "description": description}
        try:
            with self._write() as conn:
                for column, value in changes.items():
                    if value is not None:
                        conn.execute(f"UPDATE case_sets SET {column} = ? WHERE id = ?", (value, case_set_id))
        except sqlite3.IntegrityError as exc:
            raise self._name_taken((name or "").strip()) from exc

    def delete_case_set(self, case_set_id: int, *, who: str = "") -> None:
        """Delete a case set (soft: restore_case_set brings it back with its cases); refused while runs of it exist
        (their results would be orphaned)."""
        def runs_of(conn: sqlite3.Connection, row: sqlite3.Row) -> str | None:
            runs = conn.execute("SELECT COUNT(*) FROM runs WHERE case_set_id = ? AND deleted_at IS NULL",
                                (case_set_id,)).fetchone()[0]
            return f"case set {case_set_id} has {runs} run(s); delete the runs first" if runs else None

        self._set_deleted("case_set", case_set_id, deleted=True, who=who, label=lambda row: row["name"],
                          refuse=runs_of)

    def restore_case_set(self, case_set_id: int, *, who: str = "") -> None:
        """Undo delete_case_set."""
        self._set_deleted("case_set", case_set_id, deleted=False, who=who, label=lambda row: row["name"])

    # -- cases -------------------------------------------------------------------------------------------------

    def add_case(self, case_set_id: int, *, state: Any, images: list[bytes] | None = None,
                 videos: list[bytes] | None = None, expected: dict[str, Label] | None = None,
                 tags: list[str] | None = None, source_id: str | None = None) -> int:
        """Append one case (media stored with it as blobs); returns its id."""
        return self.add_cases(case_set_id, [{"state": state, "images": images, "videos": videos, "expected": expected,
                                             "tags": tags, "source_id": source_id}])[0]

    def add_cases(self, case_set_id: int, cases: list[NewCase], *, skip_existing: bool = False) -> list[int]:
        """Append cases in one transaction, all or none (an import never half-lands); the ids of those added. With
        skip_existing, a case whose content is already in the set is not added again. A case's `source_id` (its own
        id in its file, a ticket number) names one case of a set: a repeated one is refused (StoreError)."""
        prepared = []
        for index, case in enumerate(cases):
            try:
                media = [
                    (kind, position, media_content_type(blob, kind), bytes(blob))
                    for kind, blobs in (("image", case.get("images")), ("video", case.get("videos")))
                    for position, blob in enumerate(blobs or [])
                ]
                state_json = _dumps(case["state"])
                source_id = case.get("source_id")
                content = case_hash(case["state"], case.get("expected"), case.get("tags"),
                                    [(kind, blob) for kind, _, _, blob in media], source_id)
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"case {index + 1}: {exc}") from exc
            prepared.append(
                (state_json, _dumps(case.get("expected") or {}), _dumps(list(case.get("tags") or [])), media, content,
                 source_id))
        ids: list[int] = []
        with self._write() as conn:
            self._one("SELECT 1 FROM case_sets WHERE id = ? AND deleted_at IS NULL", (case_set_id,),
                      f"case set {case_set_id} does not exist", conn)
            present = self._content_hashes(conn, case_set_id) if skip_existing else Counter()
            position = conn.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM cases WHERE case_set_id = ?",
                                    (case_set_id,)).fetchone()[0]
            id_holders = dict(conn.execute("SELECT source_id, id FROM cases WHERE case_set_id = ? AND deleted_at IS "
                                           "NULL AND source_id IS NOT NULL", (case_set_id,)).fetchall())
            for state_json, expected_json, tags_json, media, content, source_id in prepared:
                if present[content] > 0:  # one stored copy answers for one incoming copy
                    present[content] -= 1
                    continue
                if source_id in id_holders:
                    raise StoreError(
                        f"the id {source_id!r} is already case {id_holders[source_id]}'s in this case set (an id "
                        "names one case); give the new case another id, or edit or delete case "
                        f"{id_holders[source_id]} first")
                case_id = self._insert(conn, "cases", case_set_id=case_set_id, position=position, state_json=state_json,
                                       expected_json=expected_json, tags_json=tags_json, content_hash=content,
                                       source_id=source_id, created_at=now_iso())
                conn.executemany(
                    "INSERT INTO case_media (case_id, kind, position, content_type, data) VALUES (?, ?, ?, ?, ?)",
                    [(case_id, kind, pos, ctype, blob) for kind, pos, ctype, blob in media])
                ids.append(case_id)
                if source_id is not None:
                    id_holders[source_id] = case_id
                position += 1
        return ids

    @staticmethod
    def _content_hashes(conn: sqlite3.Connection, case_set_id: int) -> Counter:
        """Hashes of the set's live cases; cases written before hashes existed (or edited) get theirs now."""
        for row in conn.execute("SELECT * FROM cases WHERE case_set_id = ? AND deleted_at IS NULL AND "
                                "content_hash IS NULL", (case_set_id,)).fetchall():
            media = conn.execute("SELECT kind, data FROM case_media WHERE case_id = ? ORDER BY kind, position",
                                 (row["id"],)).fetchall()
            content = case_hash(_loads(row["state_json"]), _loads(row["expected_json"]), _loads(row["tags_json"]),
                                [(m["kind"], m["data"]) for m in media], row["source_id"])
            conn.execute("UPDATE cases SET content_hash = ? WHERE id = ?", (content, row["id"]))
        rows = conn.execute("SELECT content_hash FROM cases WHERE case_set_id = ? AND deleted_at IS NULL",
                            (case_set_id,)).fetchall()
        return Counter(r[0] for r in rows)

    def update_case(self, case_id: int, *, state: Any = ...,
                    expected: dict[str, Label] | None = ...,  # type: ignore[assignment]
                    tags: list[str] | None = ...) -> None:  # type: ignore[assignment]
        """Change the given fields of a case (media stay)."""
        with self._write() as conn:
            self._one("SELECT 1 FROM cases WHERE id = ? AND deleted_at IS NULL", (case_id,),
                      f"case {case_id} does not exist", conn)
            if state is not ...:
                conn.execute("UPDATE cases SET state_json = ? WHERE id = ?", (_dumps(state), case_id))
            if expected is not ...:
                conn.execute("UPDATE cases SET expected_json = ? WHERE id = ?", (_dumps(expected or {}), case_id))
            if tags is not ...:
                conn.execute("UPDATE cases SET tags_json = ? WHERE id = ?", (_dumps(list(tags or [])), case_id))
            conn.execute("UPDATE cases SET content_hash = NULL WHERE id = ?", (case_id,))  # recomputed when needed

    def delete_case(self, case_id: int, *, who: str = "") -> None:
        """Delete a case (soft: restore_case brings it back); refused while runs have results for it."""
        def used(conn: sqlite3.Connection, row: sqlite3.Row) -> str | None:
            runs = conn.execute("""SELECT COUNT(*) FROM results x JOIN runs r ON r.id = x.run_id
                                   WHERE x.case_id = ? AND r.deleted_at IS NULL""", (case_id,)).fetchone()[0]
            return f"case {case_id} has results in {runs} run(s); delete those runs first" if runs else None

        self._set_deleted("case", case_id, deleted=True, who=who, label=_case_label, refuse=used)

    def restore_case(self, case_id: int, *, who: str = "") -> None:
        """Undo delete_case (into its case set, at its old position)."""
        self._set_deleted("case", case_id, deleted=False, who=who, label=_case_label)

    @staticmethod
    def _case_row(row: sqlite3.Row) -> Case:
        return Case(id=row["id"], case_set_id=row["case_set_id"], position=row["position"], source_id=row["source_id"],
                    state=_loads(row["state_json"]), expected=_loads(row["expected_json"]),
                    tags=_loads(row["tags_json"]), image_count=row["image_count"], video_count=row["video_count"])

    _CASE_SELECT = """SELECT c.*,
        (SELECT COUNT(*) FROM case_media m WHERE m.case_id = c.id AND m.kind = 'image') AS image_count,
        (SELECT COUNT(*) FROM case_media m WHERE m.case_id = c.id AND m.kind = 'video') AS video_count
        FROM cases c"""

    def list_cases(self, case_set_id: int) -> list[Case]:
        """Cases of a set in order, without media bytes (counts only)."""
        rows = self._conn().execute(self._CASE_SELECT + " WHERE c.case_set_id = ? AND c.deleted_at IS NULL ORDER BY "
                                    "c.position", (case_set_id,)).fetchall()
        return [self._case_row(r) for r in rows]

    def get_case(self, case_id: int, *, with_media: bool = True) -> Case:
        """One case; with media, `images`/`videos` are lists of {content_type, data: bytes} in order. A deleted
        case is still found here: runs and reviews that used it keep showing it."""
        with self._read() as conn:
            case = self._case_row(self._one(self._CASE_SELECT + " WHERE c.id = ?", (case_id,),
                                            f"case {case_id} does not exist", conn))
            if with_media:
                media = conn.execute("SELECT kind, content_type, data FROM case_media WHERE case_id = ? ORDER BY kind, "
                                     "position", (case_id,)).fetchall()
                items = [(m["kind"], Media(content_type=m["content_type"], data=m["data"])) for m in media]
                case["images"] = [item for kind, item in items if kind == "image"]
                case["videos"] = [item for kind, item in items if kind == "video"]
        return case

    def get_cases(self, case_ids: list[int]) -> list[Case]:
        """Several cases with media, in the order asked."""
        return [self.get_case(case_id) for case_id in case_ids]
