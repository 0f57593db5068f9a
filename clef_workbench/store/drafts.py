"""Drafts: what a page's editors held, per browser session, so that a reload or a new tab restores it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from clef_workbench.store.base import StoreBase, _dumps, _loads, now_iso

# A reload starts a new draft from the old one, so drafts pile up; ones nobody touched for this long are dropped.
DRAFT_DAYS = 30


class DraftsMixin(StoreBase):
    def save_draft(self, key: str, data: Any) -> None:
        """Keep `data` (JSON-able) under `key` (e.g. "decide:<session token>"), replacing what was there."""
        with self._write() as conn:
            conn.execute(
                """INSERT INTO drafts (key, data_json, updated_at) VALUES (?, ?, ?)
                   ON CONFLICT (key) DO UPDATE SET data_json = excluded.data_json, updated_at = excluded.updated_at""",
                (key, _dumps(data), now_iso()))
            cutoff = (datetime.now(UTC) - timedelta(days=DRAFT_DAYS)).isoformat(timespec="milliseconds")
            conn.execute("DELETE FROM drafts WHERE updated_at < ?", (cutoff,))

    def load_draft(self, key: str) -> Any:
        """The draft kept under `key`, or None."""
        row = self._conn().execute("SELECT data_json FROM drafts WHERE key = ?", (key,)).fetchone()
        return None if row is None else _loads(row[0])
