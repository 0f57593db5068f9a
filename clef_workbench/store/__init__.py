"""SQLite persistence for case sets, runs, results, the review queue and drafts. The only package that speaks SQL.

One file (path configurable), WAL mode so readers never block the writer, foreign keys on, numbered migrations
tracked in `PRAGMA user_version` (`migrations.py`). Every write runs in a `BEGIN IMMEDIATE` transaction: the write
lock is taken up front, so two writers queue on SQLite's busy timeout instead of failing half-way. Deletes are soft
and logged in an append-only change log, so they can be undone. Review actions check the version of the item the
reviewer saw; a stale action is refused with `ReviewConflictError`, never applied twice. The audit logs
(`review_actions`, `change_log`) are append-only, enforced by triggers.

One `Store` object over one module per concern:
- `base.py`: connections, transactions, migrations, the change log, errors;
- `cases.py`: case sets and cases (media, content hashes, soft delete);
- `runs.py`: runs, results, the cross-process run lease;
- `review.py`: review rules, the queue, reviewer actions and undo;
- `drafts.py`: per-session drafts of the Decide page;
- `schema_versions.py`: the schema history (every saved content of a library schema) that runs link to;
- `calibrations.py`: calibrations fitted on a run's labelled cases, with the run's schema version and model;
- `sweeps.py`: schema sweeps, their variants and one answer per case and variant;
- `rows.py`: the types of what the store takes and returns (rows, a run's settings, a result's response).
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
