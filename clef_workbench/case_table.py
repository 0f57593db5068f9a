"""The case table: a case set as an editable table (the Case sets page's editor), and a save of the edited table
back to the store, checked row by row before anything is written."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from clef_workbench.casesets import CaseImportError, parse_expected, state_text
from clef_workbench.store import NewCase, Store

EDITOR_COLUMNS = ["id", "state", "expected", "tags", "images", "videos"]


class CaseDeletionRefusedError(CaseImportError):
    """A save of the case table deleted rows of cases that cannot be deleted (their case set has runs); `case_ids`
    are those cases. Nothing was written."""

    def __init__(self, case_ids: list[int]):
        self.case_ids = list(case_ids)
        super().__init__([f"case {case_id} cannot be deleted: the case set has runs whose results use it"
                          for case_id in self.case_ids])


def editor_frame(store: Store, case_set_id: int) -> pd.DataFrame:
    """The case set as an editable table: state (text, or JSON for non-string states), expected (JSON object),
    tags (comma separated), and media counts (read-only)."""
    rows = [{"id": c["id"], "state": state_text(c["state"]),
             "expected": json.dumps(c["expected"], ensure_ascii=False) if c["expected"] else "",
             "tags": ", ".join(c["tags"]), "images": c["image_count"], "videos": c["video_count"]}
            for c in store.list_cases(case_set_id)]
    return pd.DataFrame(rows, columns=EDITOR_COLUMNS)


def with_rows_restored(original: pd.DataFrame, edited: pd.DataFrame, case_ids: list[int]) -> pd.DataFrame:
    """The edited table with the rows of `case_ids` (deleted in it, a deletion that was refused) put back where they
    were in `original`, as they are stored; every other edit is kept as the person made it (not saved)."""
    back = original[original["id"].isin(case_ids)]
    table = pd.concat([edited, back], ignore_index=True)
    position = {case_id: index for index, case_id in enumerate(original["id"])}
    # stored rows in their stored order, then the new rows (no id yet) in the order they were added
    order = [position.get(case_id, len(position) + index) if pd.notna(case_id) else len(position) + index
             for index, case_id in enumerate(table["id"])]
    return table.iloc[sorted(range(len(table)), key=order.__getitem__)].reset_index(drop=True)


@dataclass(frozen=True)
class CaseEdits:
    """What a save of the case table wrote: how many cases were added and updated, and which were deleted (their
    ids, for the undo)."""

    added: int
    updated: int
    deleted: list[int]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.updated or self.deleted)

    def summary(self) -> str:
        if not self.changed:  # e.g. a row selected but not deleted: say so rather than report a save of nothing
            return "Nothing to save: the table has no changes."
        return f"Saved: {self.added} added, {self.updated} updated, {len(self.deleted)} deleted."


def apply_case_edits(store: Store, case_set_id: int, edited: pd.DataFrame, schema: dict | None) -> CaseEdits:
    """Write an edited editor_frame back: rows without an id are added, rows whose state, expected or tags changed
    are updated, ids missing from `edited` are deleted. Every row is checked first; on any problem nothing is
    written and CaseImportError names each bad row (1-based, as shown) and column."""
    current = {c["id"]: c for c in store.list_cases(case_set_id)}
    problems: list[str] = []
    to_add: list[NewCase] = []
    to_update: list[tuple[int, NewCase]] = []
    kept: set[int] = set()
    for number, row in enumerate(edited.to_dict("records"), start=1):
        case_id = None if pd.isna(row.get("id")) else int(row["id"])
        state_text = row.get("state")
        if pd.isna(state_text) or not str(state_text).strip():
            problems.append(f"row {number}, state: must not be empty")
            continue
        state: Any = str(state_text)
        if state.strip().startswith(("{", "[")):
            try:
                state = json.loads(state)
            except json.JSONDecodeError as exc:
                problems.append(f"row {number}, state: looks like JSON but does not parse ({exc.msg} at line "
                                f"{exc.lineno} column {exc.colno})")
                continue
        expected_text = row.get("expected")
        try:
            raw = json.loads(expected_text) if isinstance(expected_text, str) and expected_text.strip() else {}
        except json.JSONDecodeError as exc:
            problems.append(f"row {number}, expected: not JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(raw, dict):
            problems.append(f"row {number}, expected: must be a JSON object {{question: answer}}")
            continue
        reported = len(problems)
        expected = parse_expected([(f"row {number}, expected", q, v) for q, v in raw.items()], schema, problems)
        if len(problems) > reported:
            continue
        tags_text = row.get("tags")
        tags = [t.strip() for t in str(tags_text).split(",") if t.strip()] if isinstance(tags_text, str) else []
        fields = NewCase(state=state, expected=expected, tags=tags)
        if case_id is None:
            to_add.append(fields)
        elif case_id not in current:
            problems.append(f"row {number}, id: case {case_id} is not in this case set")
        else:
            kept.add(case_id)
            old = current[case_id]
            if (old["state"], old["expected"], old["tags"]) != (state, expected, tags):
                to_update.append((case_id, fields))
    if problems:
        raise CaseImportError(problems)
    to_delete = [case_id for case_id in current if case_id not in kept]
    if to_delete and store.list_runs(case_set_id):  # refused for cases with results: checked before any write
        raise CaseDeletionRefusedError(to_delete)
    for case_id, case in to_update:
        store.update_case(case_id, state=case["state"], expected=case.get("expected"), tags=case.get("tags"))
    if to_add:
        store.add_cases(case_set_id, to_add)
    for case_id in to_delete:
        store.delete_case(case_id)
    return CaseEdits(added=len(to_add), updated=len(to_update), deleted=to_delete)
