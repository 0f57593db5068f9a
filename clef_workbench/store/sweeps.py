"""Schema sweeps (`clef_workbench.sweeps`): a base schema and its variants over a case set's labelled cases, frozen
when the sweep is recorded, and one answer per case and variant. A case's answers are written in one transaction
with the mark that it is finished, so a killed sweep has every case either whole or not started, and a case is never
written twice (its mark is set once; a second write is refused). Once every case is finished, the composed schemas
of the held-out check are added as variants of kind "composed", each answering the cases of its fold only."""

from __future__ import annotations

import sqlite3
from typing import Any, cast

from clef_workbench.store.base import StoreBase, StoreError, _dumps, filtered, now_iso
from clef_workbench.store.rows import Response, Sweep, SweepAnswer, SweepVariant
from clef_workbench.store.schema_versions import find_version_row


class SweepsMixin(StoreBase):
    def create_sweep(self, case_set_id: int, *, schema: dict[str, Any], variants: list[SweepVariant],
                     case_ids: list[int], model_id: str, model_revision: str | None = None,
                     settings: dict[str, Any] | None = None) -> int:
        """Record a sweep (status pending) of `case_ids` of the case set; `variants` in order. Linked to the schema
        history's version of the base's content, if saved."""
        self.get_case_set(case_set_id)  # type: ignore[attr-defined]  # CaseSetsMixin's
        with self._write() as conn:
            version = find_version_row(conn, schema, (settings or {}).get("schema_slug"))
            sweep_id = self._insert(conn, "sweeps", case_set_id=case_set_id, schema_json=_dumps(schema),
                                    schema_name=str(schema.get("name") or "unnamed"),
                                    schema_version_id=None if version is None else version["id"], model_id=model_id,
                                    model_revision=model_revision, settings_json=_dumps(settings or {}),
                                    created_at=now_iso())
            self._insert_variants(conn, sweep_id, variants)
            conn.executemany("INSERT INTO sweep_cases (sweep_id, case_id, position) VALUES (?, ?, ?)",
                             [(sweep_id, case_id, position) for position, case_id in enumerate(case_ids)])
            return sweep_id

    def add_sweep_variants(self, sweep_id: int, variants: list[SweepVariant]) -> None:
        """Variants added after the sweep's own (the held-out check's composed schemas), in order."""
        with self._write() as conn:
            self._insert_variants(conn, sweep_id, variants)

    @staticmethod
    def _insert_variants(conn: sqlite3.Connection, sweep_id: int, variants: list[SweepVariant]) -> None:
        start = conn.execute("SELECT COUNT(*) FROM sweep_variants WHERE sweep_id = ?", (sweep_id,)).fetchone()[0]
        conn.executemany(
            """INSERT INTO sweep_variants (sweep_id, position, name, kind, question, schema_json, relabel_json)
               VALUES (?, ?, ?, ?, ?, ?, ?)""",
            [(sweep_id, position, v["name"], v["kind"], v["question"], _dumps(v["schema"]), _dumps(v["relabel"]))
             for position, v in enumerate(variants, start)])

    _SWEEP_SELECT = """SELECT w.*, s.name AS case_set_name,
        (SELECT COUNT(*) FROM sweep_variants v WHERE v.sweep_id = w.id AND v.kind != 'composed') AS variant_count,
        (SELECT COUNT(*) FROM sweep_cases c WHERE c.sweep_id = w.id) AS total,
        (SELECT COUNT(*) FROM sweep_cases c WHERE c.sweep_id = w.id AND c.finished_at IS NOT NULL) AS done,
        (SELECT COALESCE(SUM(c.state_prefills), 0) FROM sweep_cases c WHERE c.sweep_id = w.id) AS state_prefills
        FROM sweeps w JOIN case_sets s ON s.id = w.case_set_id"""

    def _sweep_row(self, row: sqlite3.Row) -> Sweep:
        return cast(Sweep, self._decoded(row, "schema", "settings"))

    def get_sweep(self, sweep_id: int) -> Sweep:
        """A sweep with its base schema, settings, variants (in order) and progress (total cases, done, the states
        prefilled for the done ones)."""
        with self._read() as conn:
            sweep = self._sweep_row(self._one(self._SWEEP_SELECT + " WHERE w.id = ?", (sweep_id,),
                                              f"sweep {sweep_id} does not exist", conn))
            sweep["variants"] = [cast(SweepVariant, self._decoded(v, "schema", "relabel")) for v in conn.execute(
                "SELECT name, kind, question, schema_json, relabel_json FROM sweep_variants WHERE sweep_id = ? "
                "ORDER BY position", (sweep_id,))]
        return sweep

    def list_sweeps(self, case_set_id: int | None = None) -> list[Sweep]:
        """Sweeps, newest first, optionally of one case set (without their variants)."""
        query, args = filtered(self._SWEEP_SELECT + " WHERE 1 = 1", {"w.case_set_id": case_set_id})
        rows = self._conn().execute(query + " ORDER BY w.id DESC", args).fetchall()
        return [self._sweep_row(row) for row in rows]

    def sweep_cases_left(self, sweep_id: int) -> list[int]:
        """The sweep's case ids without answers yet, in order."""
        rows = self._conn().execute(
            "SELECT case_id FROM sweep_cases WHERE sweep_id = ? AND finished_at IS NULL ORDER BY position",
            (sweep_id,)).fetchall()
        return [row["case_id"] for row in rows]

    def record_sweep_case(self, sweep_id: int, case_id: int, answers: list[tuple[int, Response | None, str | None]],
                          *, state_prefills: int, compute_ms: float) -> None:
        """A case's answers, one (variant position, response or None, error or None) per variant, and the mark
        that it is finished, in one transaction. A case finished already is refused (StoreError): it would have
        been computed twice."""
        with self._write() as conn:
            marked = conn.execute(
                """UPDATE sweep_cases SET state_prefills = ?, compute_ms = ?, finished_at = ?
                   WHERE sweep_id = ? AND case_id = ? AND finished_at IS NULL""",
                (state_prefills, compute_ms, now_iso(), sweep_id, case_id)).rowcount
            if marked != 1:
                raise StoreError(f"case {case_id} of sweep {sweep_id} is not one of its cases left to compute")
            self._insert_answers(conn, sweep_id, case_id, answers)

    def record_sweep_answers(self, sweep_id: int, case_id: int,
                             answers: list[tuple[int, Response | None, str | None]]) -> None:
        """Answers of a finished case to variants added later (`add_sweep_variants`); an answer stored already is
        refused (StoreError): it would have been computed twice."""
        try:
            with self._write() as conn:
                self._insert_answers(conn, sweep_id, case_id, answers)
        except sqlite3.IntegrityError:
            raise StoreError(f"case {case_id} of sweep {sweep_id} has an answer to one of these variants "
                             "already") from None

    @staticmethod
    def _insert_answers(conn: sqlite3.Connection, sweep_id: int, case_id: int,
                        answers: list[tuple[int, Response | None, str | None]]) -> None:
        conn.executemany(
            "INSERT INTO sweep_answers (sweep_id, case_id, variant, response_json, error) VALUES (?, ?, ?, ?, ?)",
            [(sweep_id, case_id, variant, None if response is None else _dumps(response), error)
             for variant, response, error in answers])

    def list_sweep_answers(self, sweep_id: int) -> list[SweepAnswer]:
        """Every stored answer of the sweep, in case order, then variant order."""
        rows = self._conn().execute(
            """SELECT a.case_id, s.position, a.variant, a.response_json, a.error, c.expected_json FROM sweep_answers a
               JOIN sweep_cases s ON s.sweep_id = a.sweep_id AND s.case_id = a.case_id
               JOIN cases c ON c.id = a.case_id
               WHERE a.sweep_id = ? ORDER BY s.position, a.variant""", (sweep_id,)).fetchall()
        return [cast(SweepAnswer, self._decoded(row, "response", "expected")) for row in rows]

    def count_sweep_answers(self, sweep_id: int) -> int:
        row = self._conn().execute("SELECT COUNT(*) FROM sweep_answers WHERE sweep_id = ?", (sweep_id,)).fetchone()
        return int(row[0])

    def set_sweep_status(self, sweep_id: int, status: str, *, error: str | None = None) -> None:
        self._set_status("sweeps", sweep_id, status, error)
