"""SQLite persistence of the workbench, the only package that speaks SQL: one `Store` over a module per concern
(docs/architecture.md lists them; `rows.py` types what they take and return).

One file, WAL mode so readers never block the writer, foreign keys on, numbered migrations in `PRAGMA user_version`.
Every write takes the write lock up front (`BEGIN IMMEDIATE`), so two writers queue on the busy timeout instead of
failing half-way. Deletes are soft and logged, so they can be undone; a review action names the item version the
reviewer saw and a stale one is refused (`ReviewConflictError`); the audit logs are append-only (triggers).
"""

from __future__ import annotations

from clef_workbench.store.base import (
    DuplicateNameError,
    NotFoundError,
    ReviewConflictError,
    StoreError,
    _dumps,
    media_content_type,
    now_iso,
)
from clef_workbench.store.calibrations import CalibrationsMixin
from clef_workbench.store.cases import CaseSetsMixin
from clef_workbench.store.drafts import DraftsMixin
from clef_workbench.store.migrations import MIGRATIONS, SCHEMA_VERSION
from clef_workbench.store.review import ReviewMixin
from clef_workbench.store.rows import (
    Answered,
    Calibration,
    Case,
    NewCase,
    NewResult,
    NewReviewItem,
    RayPlacement,
    Response,
    Result,
    ReviewItem,
    Run,
    RunSettings,
    Sweep,
    SweepAnswer,
    SweepVariant,
)
from clef_workbench.store.runs import RunsMixin, new_lease_owner
from clef_workbench.store.schema_versions import SchemaVersionsMixin
from clef_workbench.store.sweeps import SweepsMixin

__all__ = [
    "MIGRATIONS", "SCHEMA_VERSION", "DuplicateNameError", "NotFoundError", "ReviewConflictError", "Store",
    "StoreError", "_dumps", "media_content_type", "new_lease_owner", "now_iso", "Answered", "Calibration", "Case",
    "NewCase", "NewResult", "NewReviewItem", "RayPlacement", "Response", "Result", "ReviewItem", "Run", "RunSettings",
    "Sweep", "SweepAnswer", "SweepVariant",
]


class Store(CaseSetsMixin, RunsMixin, ReviewMixin, DraftsMixin, SchemaVersionsMixin, CalibrationsMixin,
            SweepsMixin):
    """All persistent state of the workbench in one SQLite file. Safe to share between threads and processes."""
