"""The difference between two versions of a schema: what an analyst asks of a history ("what did I change in the
wording?"), question by question and option by option, rather than a line diff of the JSON (which git gives
already)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from clef_workbench.schemas import NOUL_CRITERIA_KEYS

ChangeKind = Literal["added", "removed", "renamed", "changed", "moved"]
_MARK = {"added": "+", "removed": "-", "renamed": "~", "changed": "~", "moved": "~"}


@dataclass(frozen=True)
class SchemaChange:
    """One difference between two schemas. `loc` is a path as in SchemaProblem: ("questions", "q1", "criteria",
    "billing") is option "billing" of question "q1", an int last element a score level, ("questions", "q1",
    "true") a yes/no question's "true" description. `old`/`new` hold the values (for a rename: the old and the
    new id; for a reorder: the ids in the old and the new order)."""

    kind: ChangeKind
    loc: tuple[str | int, ...]
    old: Any = None
    new: Any = None

    @property
    def question_id(self) -> str | None:
        return str(self.loc[1]) if len(self.loc) >= 2 and self.loc[0] == "questions" else None

    def where(self) -> str:
        """The changed thing in words: 'question "q1", option "billing"'."""
        if self.loc == ("questions",):
            return "question order"
        if self.loc[0] != "questions":
            return {"name": "name", "description": "description", "examples": "example states"}.get(
                str(self.loc[0]), str(self.loc[0]))
        where = f'question "{self.loc[1]}"'
        if len(self.loc) == 3:
            part = self.loc[2]
            where += (", option order" if part == "criteria" and self.kind == "moved" else
                      f', "{part}" description' if part in NOUL_CRITERIA_KEYS else f", {part}")
        elif len(self.loc) == 4:
            part = self.loc[3]
            where += f", level {part}" if isinstance(part, int) else f', option "{part}"'
        return where

    def as_row(self) -> dict[str, str]:
        """The change as a table row of text: change, where, before, after."""
        def text(value: Any) -> str:
            return "" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return {"change": self.kind, "where": self.where(), "before": text(self.old), "after": text(self.new)}

    def __str__(self) -> str:
        mark, where = _MARK[self.kind], self.where()
        if self.kind == "renamed":
            return f'{mark} {where} renamed to "{self.new}"'
        if self.kind == "moved":
            return f"{mark} {where}: {', '.join(map(str, self.old))} → {', '.join(map(str, self.new))}"
        if self.kind == "added":
            return f"{mark} {where} added" + (f": {_show(self.new)}" if self.new not in (None, "") else "")
        if self.kind == "removed":
            return f"{mark} {where} removed" + (f" (was {_show(self.old)})" if self.old not in (None, "") else "")
        return f"{mark} {where}: {word_diff(self.old, self.new)}"


def _show(value: Any) -> str:
    if isinstance(value, dict) and "type" in value:  # a whole question
        criteria = value.get("criteria")
        detail = ", ".join(criteria) if isinstance(criteria, dict) and value["type"] == "choice" else (
            f"{len(criteria)} levels" if isinstance(criteria, list) else "")
        return f"{value['type']}" + (f" ({detail})" if detail else "") + f", {_show(value.get('instructions'))}"
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else f'"{value}"'


def word_diff(old: Any, new: Any) -> str:
    """Two texts as one, git --word-diff style: [-removed words-]{+added words+}. Non-text values as JSON."""
    old_text = old if isinstance(old, str) else json.dumps(old, ensure_ascii=False)
    new_text = new if isinstance(new, str) else json.dumps(new, ensure_ascii=False)
    a, b = old_text.split(), new_text.split()
    if a == b:  # only the spacing changed: show both texts whole
        return f"[-{old_text}-]{{+{new_text}+}}"
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        removed = f"[-{' '.join(a[i1:i2])}-]" if op in ("replace", "delete") else ""
        added = f"{{+{' '.join(b[j1:j2])}+}}" if op in ("replace", "insert") else ""
        out.append(" ".join(a[i1:i2]) if op == "equal" else removed + added)
    return " ".join(out)


def _diff_keyed(loc: tuple[str | int, ...], old: dict, new: dict, *, rename_if: Callable[[Any], bool],
                inner: Callable[[tuple, Any, Any], list[SchemaChange]]) -> list[SchemaChange]:
    """Changes between two ordered maps (questions, or a choice's options): removed, added, renamed (an id gone and
    a new one with the very same value, when `rename_if(value)`), changed (by `inner`), and order."""
    removed = [k for k in old if k not in new]
    added = [k for k in new if k not in old]
    renamed: dict[str, str] = {}
    for key in removed:
        twin = next((a for a in added if a not in renamed.values() and new[a] == old[key] and rename_if(old[key])),
                    None)
        if twin is not None:
            renamed[key] = twin
    changes = [SchemaChange("removed", (*loc, k), old=old[k]) for k in removed if k not in renamed]
    changes += [SchemaChange("renamed", (*loc, k), old=k, new=v) for k, v in renamed.items()]
    changes += [SchemaChange("added", (*loc, k), new=new[k]) for k in added if k not in renamed.values()]
    for key in (k for k in old if k in new):
        changes += inner((*loc, key), old[key], new[key])
    old_order = [renamed.get(k, k) for k in old if k in new or k in renamed]
    new_order = [k for k in new if k in old or k in renamed.values()]
    if old_order != new_order:
        changes.append(SchemaChange("moved", loc, old=old_order, new=new_order))
    return changes


def _diff_value(loc: tuple, old: Any, new: Any) -> list[SchemaChange]:
    if old == new:
        return []
    if old in (None, "") and new not in (None, ""):
        return [SchemaChange("added", loc, new=new)]
    if new in (None, "") and old not in (None, ""):
        return [SchemaChange("removed", loc, old=old)]
    return [SchemaChange("changed", loc, old=old, new=new)]


def _diff_levels(loc: tuple, old: list, new: list) -> list[SchemaChange]:
    changes = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        for offset in range(max(i2 - i1, j2 - j1)):
            i, j = i1 + offset, j1 + offset
            if op == "replace" and i < i2 and j < j2:
                changes.append(SchemaChange("changed", (*loc, j), old=old[i], new=new[j]))
            elif op in ("replace", "delete") and i < i2:
                changes.append(SchemaChange("removed", (*loc, i), old=old[i]))
            elif op in ("replace", "insert") and j < j2:
                changes.append(SchemaChange("added", (*loc, j), new=new[j]))
    return changes


def _diff_question(loc: tuple, old: Any, new: Any) -> list[SchemaChange]:
    if not isinstance(old, dict) or not isinstance(new, dict):
        return _diff_value(loc, old, new)
    changes = _diff_value((*loc, "type"), old.get("type"), new.get("type"))
    changes += _diff_value((*loc, "instructions"), old.get("instructions"), new.get("instructions"))
    a, b = old.get("criteria"), new.get("criteria")
    if changes and changes[0].loc[-1] == "type" or a == b:
        return changes + ([] if a == b else [SchemaChange("changed", (*loc, "criteria"), old=a, new=b)])
    if new.get("type") == "score" and isinstance(a, list) and isinstance(b, list):
        return changes + _diff_levels((*loc, "criteria"), a, b)
    if new.get("type") == "noul":  # the yes / no descriptions, at ("questions", id, "true" | "false")
        a, b = a or {}, b or {}
        for side in dict.fromkeys([*a, *b]):
            changes += _diff_value((*loc, side), a.get(side), b.get(side))
        return changes
    if isinstance(a, dict) and isinstance(b, dict):
        return changes + _diff_keyed((*loc, "criteria"), a, b, rename_if=lambda d: d not in (None, ""),
                                     inner=_diff_value)
    return changes + [SchemaChange("changed", (*loc, "criteria"), old=a, new=b)]


def diff_schemas(old: dict[str, Any], new: dict[str, Any]) -> list[SchemaChange]:
    """What changed from schema `old` to schema `new` (both as dicts: a file's content, a version, a run's schema):
    name and description wording, example states, questions added / removed / renamed / reordered, and per
    question its type, instructions, options (added, removed, renamed, reworded, reordered), score levels and
    yes/no descriptions. The version number is not a change."""
    changes = _diff_value(("name",), old.get("name"), new.get("name"))
    changes += _diff_value(("description",), old.get("description") or "", new.get("description") or "")
    if (old.get("examples") or []) != (new.get("examples") or []):
        changes.append(SchemaChange("changed", ("examples",), old=len(old.get("examples") or []),
                                    new=len(new.get("examples") or [])))
    return changes + _diff_keyed(("questions",), old.get("questions") or {}, new.get("questions") or {},
                                 rename_if=lambda q: True, inner=_diff_question)


def diff_text(changes: Iterable[SchemaChange]) -> str:
    """A readable view of a diff, one line per change ([-removed-]{+added+} inside reworded text)."""
    lines = [str(change) for change in changes]
    return "\n".join(lines) if lines else "No changes."
