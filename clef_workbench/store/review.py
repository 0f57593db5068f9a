"""The review queue: per-schema rules, items frozen at queue time, reviewer actions checked against the version the
reviewer saw (a stale action is refused with ReviewConflictError, never applied twice), and the append-only audit
log of actions with undo."""

from __future__ import annotations

import sqlite3
from typing import Any, cast

from clef_workbench.store.base import ReviewConflictError, StoreBase, StoreError, _dumps, _loads, filtered, now_iso
from clef_workbench.store.rows import ItemState, Label, NewReviewItem, ReviewAction, ReviewItem

REVIEW_STATUSES = ("open", "accepted", "corrected", "unknown", "skipped")
REVIEW_ACTIONS = ("accept", "correct", "unknown", "skip")
# status an action leaves the item in
_ACTION_STATUS = {"accept": "accepted", "correct": "corrected", "unknown": "unknown", "skip": "skipped"}


class ReviewMixin(StoreBase):
    # -- review queue ------------------------------------------------------------------------------------------

    def get_review_rules(self, schema_name: str) -> dict | None:
        query = "SELECT rules_json FROM review_rules WHERE schema_name = ?"
        row = self._conn().execute(query, (schema_name,)).fetchone()
        return None if row is None else _loads(row[0])

    def save_review_rules(self, schema_name: str, rules: dict) -> None:
        with self._write() as conn:
            conn.execute(
                """INSERT INTO review_rules (schema_name, rules_json, updated_at) VALUES (?, ?, ?)
                   ON CONFLICT (schema_name) DO UPDATE SET rules_json = excluded.rules_json,
                   updated_at = excluded.updated_at""", (schema_name, _dumps(rules), now_iso()))

    def queue_review_items(self, items: list[NewReviewItem]) -> int:
        """Add items to the review queue with their reason frozen now. An item already queued for the same (run, case,
        question) is left as it is. Returns the number added."""
        stamp = now_iso()
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(
                """INSERT INTO review_items (run_id, case_id, question_id, question_type, distribution_json,
                       predicted, confidence, margin, reason, model_id, schema_name, schema_version,
                       created_at, updated_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (run_id, case_id, question_id) DO NOTHING""",
                [(i["run_id"], i["case_id"], i["question_id"], i["question_type"], _dumps(i["distribution"]),
                  str(i["predicted"]), float(i["confidence"]), float(i["margin"]), i["reason"], i["model_id"],
                  i["schema_name"], str(i["schema_version"]), stamp, stamp) for i in items])
            return conn.total_changes - before

    def _item_row(self, row: sqlite3.Row) -> ReviewItem:
        return cast(ReviewItem, self._decoded(row, "distribution", "label"))

    def list_review_items(self, run_id: int, *, statuses: tuple[str, ...] | None = None) -> list[ReviewItem]:
        """Queue of a run, worst first: open items before skipped ones before done ones, each by smallest margin."""
        query = """SELECT * FROM review_items WHERE run_id = ?"""
        params: list[Any] = [run_id]
        if statuses:
            query += f" AND status IN ({','.join('?' * len(statuses))})"
            params.extend(statuses)
        query += """ ORDER BY CASE status WHEN 'open' THEN 0 WHEN 'skipped' THEN 1 ELSE 2 END,
                     margin ASC, confidence ASC, id ASC"""
        return [self._item_row(r) for r in self._conn().execute(query, params).fetchall()]

    def get_review_item(self, item_id: int) -> ReviewItem:
        return self._item_row(self._one("SELECT * FROM review_items WHERE id = ?", (item_id,),
                                        f"review item {item_id} does not exist"))

    def review_progress(self, run_id: int) -> dict[str, int]:
        """Counts per status plus total and reviewed (accepted + corrected + unknown)."""
        rows = self._conn().execute("SELECT status, COUNT(*) FROM review_items WHERE run_id = ? GROUP BY status",
                                    (run_id,)).fetchall()
        counts = {status: 0 for status in REVIEW_STATUSES}
        counts.update({r[0]: r[1] for r in rows})
        counts["total"] = sum(counts[s] for s in REVIEW_STATUSES)
        counts["reviewed"] = counts["accepted"] + counts["corrected"] + counts["unknown"]
        return counts

    @staticmethod
    def _item_state(item: sqlite3.Row) -> ItemState:
        return {"status": item["status"], "label": _loads(item["label_json"]), "reviewer": item["reviewer"]}

    def apply_review_action(self, item_id: int, *, reviewer: str, action: str, expected_version: int,
                            label: Any = None, comment: str | None = None) -> ReviewItem:
        """Apply accept / correct / unknown / skip to an item, if it is still at the version the reviewer saw.

        accept labels the item with the model's answer; correct with `label` (option id, level or bool); unknown
        and skip carry no label. `comment` is kept with the action in the audit log. Raises ReviewConflictError if
        someone else acted first. Returns the new item."""
        reviewer = (reviewer or "").strip()
        if not reviewer:
            raise ValueError("reviewer name is required")
        if action not in REVIEW_ACTIONS:
            raise ValueError(f"action must be one of {REVIEW_ACTIONS}, not {action!r}")
        with self._write() as conn:
            row = self._one("SELECT * FROM review_items WHERE id = ?", (item_id,),
                            f"review item {item_id} does not exist", conn)
            if row["version"] != expected_version:
                raise ReviewConflictError(
                    f"review item {item_id} was changed by {row['reviewer'] or 'another reviewer'} "
                    f"(now {row['status']!r}) after you loaded it; your {action!r} was not applied — reload it",
                    item=self._item_row(row),
                )
            if action == "correct" and label is None:
                raise ValueError("correct needs the right answer (an option id, a level or true/false)")
            new_label = None if action not in ("accept", "correct") else coerce_label(
                row["question_id"], row["question_type"], list(_loads(row["distribution_json"])),
                row["predicted"] if action == "accept" else label)
            after = ItemState(status=_ACTION_STATUS[action], label=new_label, reviewer=reviewer)
            return self._act(conn, item_id, reviewer, action, self._item_state(row), after,
                             comment=(comment or "").strip() or None)

    def _act(self, conn: sqlite3.Connection, item_id: int, reviewer: str, action: str, before: ItemState,
             after: ItemState, *, comment: str | None = None, undoes: int | None = None) -> ReviewItem:
        """Move the item from `before` to `after` and append the action to the audit log; the item as it is now."""
        conn.execute(
            """UPDATE review_items SET status = ?, label_json = ?, reviewer = ?, version = version + 1,
               updated_at = ? WHERE id = ?""",
            (after["status"], None if after["label"] is None else _dumps(after["label"]), after["reviewer"],
             now_iso(), item_id))
        self._insert(conn, "review_actions", item_id=item_id, reviewer=reviewer, at=now_iso(), action=action,
                     before_json=_dumps(before), after_json=_dumps(after), comment=comment, undoes_action_id=undoes)
        return self._item_row(conn.execute("SELECT * FROM review_items WHERE id = ?", (item_id,)).fetchone())

    def undo_last_action(self, reviewer: str, *, run_id: int | None = None) -> ReviewItem:
        """Undo this reviewer's most recent action that is not yet undone, by appending an `undo` entry and
        restoring the item's previous state. Refused if another reviewer changed the item since. Returns the item.
        """
        reviewer = (reviewer or "").strip()
        if not reviewer:
            raise ValueError("reviewer name is required")
        with self._write() as conn:
            query, params = filtered(
                """SELECT a.* FROM review_actions a JOIN review_items i ON i.id = a.item_id
                   WHERE a.action != 'undo'
                     AND NOT EXISTS (SELECT 1 FROM review_actions u WHERE u.undoes_action_id = a.id)""",
                {"a.reviewer": reviewer, "i.run_id": run_id})
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
            return self._act(conn, row["id"], reviewer, "undo", current, _loads(last["before_json"]),
                             undoes=last["id"])

    def list_review_actions(self, *, run_id: int | None = None, item_id: int | None = None) -> list[ReviewAction]:
        """The audit log in the order written, with before/after states decoded."""
        query, params = filtered("""SELECT a.*, i.run_id, i.case_id, i.question_id FROM review_actions a
                                    JOIN review_items i ON i.id = a.item_id WHERE 1 = 1""",
                                 {"i.run_id": run_id, "a.item_id": item_id})
        rows = self._conn().execute(query + " ORDER BY a.id", params).fetchall()
        return [cast(ReviewAction, self._decoded(row, "before", "after")) for row in rows]


def label_key(label: Label) -> str:
    """The distribution key of a label: 'true'/'false' for noul, '2' for a score level, the id for a choice."""
    return str(label).lower() if isinstance(label, bool) else str(label)


def coerce_label(question_id: str, question_type: str, options: list[str], value: Any) -> Label:
    """A raw answer (a cell's text, JSON, a reviewer's pick) in the type expected answers use: bool for noul, int
    level for score, option id str for choice; ValueError says what the question allows."""
    if question_type == "noul":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "y", "1"):
            return True
        if text in ("false", "no", "n", "0"):
            return False
        raise ValueError(f"{value!r} is not an answer to yes/no question {question_id!r} (use true/false or yes/no)")
    if question_type == "score":
        levels = len(options)
        try:
            number = float(value)
            if not number.is_integer():
                raise ValueError
            level = int(number)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{value!r} is not a level number of score question {question_id!r} "
                             f"(0 to {levels - 1})") from exc
        if not 0 <= level < levels:
            raise ValueError(f"level {level} is out of range for score question {question_id!r} (0 to {levels - 1})")
        return level
    text = str(value).strip()
    if text not in options:
        raise ValueError(f"{value!r} is not an option of question {question_id!r} (allowed: {', '.join(options)})")
    return text
