"""Calibrations: the per-question maps fitted on a run's labelled cases (`clef_workbench.calibration`), kept with
the schema version and the model that produced the run, since a map is only valid for the pair it was fitted on."""

from __future__ import annotations

import sqlite3
from typing import Any, cast

from clef_workbench.store.base import DuplicateNameError, StoreBase, _dumps, filtered, now_iso
from clef_workbench.store.rows import Calibration, Run


class CalibrationsMixin(StoreBase):
    def _calibration_row(self, row: sqlite3.Row) -> Calibration:
        return cast(Calibration, self._decoded(row, "payload"))

    def save_calibration(self, name: str, run: Run, payload: dict[str, Any]) -> int:
        """Keep a calibration fitted on `run` (a `get_run` row) under a unique `name`."""
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM calibrations WHERE name = ?", (name,)).fetchone():
                raise DuplicateNameError(f"a calibration named {name!r} exists already")
            return self._insert(conn, "calibrations", name=name, run_id=run["id"], schema_name=run["schema_name"],
                                schema_version_id=run["schema_version_id"], model_id=run["model_id"],
                                payload_json=_dumps(payload), created_at=now_iso())

    def get_calibration(self, calibration_id: int | None = None, *, name: str | None = None) -> Calibration:
        column, value = ("id", calibration_id) if name is None else ("name", name)
        return self._calibration_row(self._one(f"SELECT * FROM calibrations WHERE {column} = ?", (value,),
                                               f"calibration {value!r} does not exist"))

    def list_calibrations(self, *, schema_name: str | None = None, model_id: str | None = None) -> list[Calibration]:
        """Calibrations, newest first, optionally only those for one schema and/or model."""
        query, args = filtered("SELECT * FROM calibrations WHERE 1 = 1",
                               {"schema_name": schema_name, "model_id": model_id})
        rows = self._conn().execute(query + " ORDER BY id DESC", args).fetchall()
        return [self._calibration_row(row) for row in rows]
