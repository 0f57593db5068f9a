"""The schema library: one human-readable, git-diffable JSON file per schema in a folder (default ./schemas).

A schema file holds, in this key order:

    {"name": str, "version": int >= 1, "description": str,
     "questions": {id: {"type": "noul"|"choice"|"score", "instructions": str | JSON, "criteria": ...}},
     "examples": [{"name": str, "state": any JSON}, ...]}      # optional: example states to try on the Decide page

`questions` is exactly the System One `questions` map (spec §5), so it goes into a request unchanged. Files are
written with indent 2, UTF-8, a trailing newline and a fixed key order, so edits show up as small git diffs.

Validation applies the System One contract (clef_engine.protocol, what the release code accepts); `lint` warns
where the hosted Clef service would refuse a schema and about schemas that are valid but likely to give poor
answers. Every message names the question and the field it concerns.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from clef_engine import protocol
from clef_engine.errors import Problem, RequestError
from clef_workbench.settings import WorkbenchSettings

# The System One contract (question types, id rules, hosted limits) is clef_engine.protocol's; the names below
# are kept for the pages.
QUESTION_TYPES = protocol.QUESTION_TYPES
NOUL_CRITERIA_KEYS = protocol.NOUL_OPTION_IDS

# Descriptions at least this similar (difflib ratio) inside one question are probably copy-paste mistakes:
# the model cannot tell such options apart.
NEAR_DUPLICATE_RATIO = 0.9

# An option whose id (underscores read as spaces) or description matches these gives the model a way out when no
# real option fits. Descriptions need a stricter pattern: "other" or "none" appear in ordinary descriptions too.
UNKNOWN_OPTION_ID_PATTERN = re.compile(
    r"\b(unknown|none|other|others|unsure|unclear|undetermined|indeterminate|cannot tell|cant tell|cannot determine|"
    r"na|n a|not applicable|insufficient|needs more (?:data|info|information)|no match|neither|uncertain)\b",
    re.IGNORECASE,
)
UNKNOWN_DESCRIPTION_PATTERN = re.compile(
    r"\b(none of (?:these|the above|the options)|unknown|can(?:not|'t) (?:tell|determine|decide)|"
    r"not enough (?:information|evidence|data)|insufficient (?:information|evidence|data)|not applicable)\b",
    re.IGNORECASE,
)

SCHEMA_FILE_SUFFIX = ".json"
SLUG_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,79}")
MAX_IMPORT_BYTES = 2 * 1024 * 1024  # a 64-question schema with 255 long options each stays far below this

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class SchemaProblem:
    """One thing wrong with a schema. `loc` is a path into the schema file, e.g. ("questions", "q1", "criteria")."""

    loc: tuple[str | int, ...]
    msg: str
    severity: Severity = "error"

    @property
    def question_id(self) -> str | None:
        """The question this problem concerns, when it concerns one."""
        if len(self.loc) >= 2 and self.loc[0] == "questions":
            return str(self.loc[1])
        return None

    def __str__(self) -> str:
        return f"{self.severity}: {self.msg}"


class SchemaError(ValueError):
    """A schema is invalid (or a file is not a schema). `problems` lists every error found, not just the first."""

    def __init__(self, problems: list[SchemaProblem], *, source: str | None = None):
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(prefix + "; ".join(p.msg for p in self.problems))


class _PairsDict(dict):
    """A dict that remembers keys that occurred more than once in the JSON text (json keeps only the last one)."""

    duplicate_keys: tuple[str, ...] = ()


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _PairsDict:
    result = _PairsDict()
    duplicates = []
    for key, value in pairs:
        if key in result and key not in duplicates:
            duplicates.append(key)
        result[key] = value
    result.duplicate_keys = tuple(duplicates)
    return result


def loads_schema_json(text: str, *, source: str = "schema") -> Any:
    """Parse JSON text, keeping track of duplicate keys so that validation can report duplicate ids.

    Raises SchemaError naming the line and column of a syntax error.
    """
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            [SchemaProblem((), f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")], source=source
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# Validation and lint


def _q(qid: str, fieldname: str) -> str:
    return f'question "{qid}", field "{fieldname}"'


def _is_blank_instruction(instructions: Any) -> bool:
    if instructions is None:
        return True
    if isinstance(instructions, str):
        return not instructions.strip()
    if isinstance(instructions, dict | list):
        return len(instructions) == 0
    return False


def _where(loc: tuple[str | int, ...]) -> str:
    """A location in a questions map in words: 'question "q1", field "criteria"'."""
    if len(loc) < 2 or loc[0] != "questions":
        return '"questions"' if loc == ("questions",) else " / ".join(map(str, loc)) or "the schema"
    where = f'question "{loc[1]}"'
    if len(loc) > 2:
        where += f', field "{loc[2]}"'
    if len(loc) > 3:
        where += f", {'level' if isinstance(loc[3], int) else 'key'} {json.dumps(loc[3], ensure_ascii=False)}"
    return where


def _schema_problem(problem: Problem, severity: Severity = "error") -> SchemaProblem:
    return SchemaProblem(problem.loc, f"{_where(problem.loc)}: {problem.msg}", severity)


def validate_questions(questions: Any) -> list[SchemaProblem]:
    """Errors that make `questions` unusable as a System One questions map: the contract's rules
    (clef_engine.protocol), plus what only a file can get wrong (duplicate keys, unknown question fields).
    Limits of the hosted service are warnings of `lint_questions`, not errors."""
    if not isinstance(questions, dict):
        return [SchemaProblem(("questions",), '"questions" must be a map of question id -> question')]
    problems: list[SchemaProblem] = []
    for dup in getattr(questions, "duplicate_keys", ()):
        problems.append(SchemaProblem(("questions", dup), f'question "{dup}": the id appears more than once; '
                                                          "only the last one would be kept"))
    for qid, question in questions.items():
        if not isinstance(question, dict):
            continue
        for key in question:
            if key not in protocol.QUESTION_FIELDS:
                problems.append(SchemaProblem(("questions", qid, key), f"{_q(qid, key)}: unknown field (allowed: "
                                                                       f"{', '.join(protocol.QUESTION_FIELDS)})"))
        for dup in getattr(question.get("criteria"), "duplicate_keys", ()):
            problems.append(SchemaProblem(("questions", qid, "criteria", dup),
                                          f'{_q(qid, "criteria")}: option id "{dup}" appears more than once'))
    try:
        protocol.validate_request({"state": "", "questions": questions})
    except RequestError as exc:
        problems.extend(_schema_problem(p) for p in exc.problems)
    return problems


def _descriptions(question: dict) -> list[tuple[str, str]]:
    """(label, description) pairs of the answers a question offers, as the model would read them."""
    criteria = question.get("criteria")
    qtype = question.get("type")
    if qtype == "choice" and isinstance(criteria, dict):
        return [(f'option "{k}"', v) for k, v in criteria.items() if isinstance(v, str)]
    if qtype == "score" and isinstance(criteria, list):
        return [(f"level {i}", v) for i, v in enumerate(criteria) if isinstance(v, str)]
    if qtype == "noul" and isinstance(criteria, dict):
        return [(f'"{k}"', v) for k, v in criteria.items() if isinstance(v, str)]
    return []


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def lint_questions(questions: Any) -> list[SchemaProblem]:
    """Warnings about a questions map that the hosted service would refuse, or that is valid but likely to give
    poor or ambiguous answers."""
    if not isinstance(questions, dict):
        return []
    warnings = [_schema_problem(p, "warning") for p in protocol.hosted_service_problems(questions)]
    seen_folded: dict[str, str] = {}
    for qid, question in questions.items():
        folded = qid.casefold()
        if folded in seen_folded:
            warnings.append(SchemaProblem(("questions", qid), f'question "{qid}", field "id": differs from '
                                                              f'"{seen_folded[folded]}" only in letter case',
                                          "warning"))
        seen_folded.setdefault(folded, qid)
        if not isinstance(question, dict) or question.get("type") not in QUESTION_TYPES:
            continue
        if _is_blank_instruction(question.get("instructions")):
            warnings.append(SchemaProblem(("questions", qid, "instructions"),
                                          f"{_q(qid, 'instructions')}: empty; the model will read only the id "
                                          f'"{qid}" as the question', "warning"))
        criteria = question.get("criteria")
        if question["type"] == "choice" and isinstance(criteria, dict):
            has_way_out = any(UNKNOWN_OPTION_ID_PATTERN.search(re.sub(r"[_.\-]+", " ", k))
                              or UNKNOWN_DESCRIPTION_PATTERN.search(v or "") for k, v in criteria.items())
            if not has_way_out:
                warnings.append(SchemaProblem(("questions", qid, "criteria"),
                                              f"{_q(qid, 'criteria')}: no \"unknown\" / \"none of these\" option; "
                                              "when nothing fits, the model must still pick one of the listed "
                                              "options", "warning"))
            folded_ids: dict[str, str] = {}
            for option_id in criteria:
                key = _normalized(option_id)
                if key in folded_ids:
                    warnings.append(SchemaProblem(("questions", qid, "criteria", option_id),
                                                  f'{_q(qid, "criteria")}: option ids "{folded_ids[key]}" and '
                                                  f'"{option_id}" differ only in case or spaces', "warning"))
                folded_ids.setdefault(key, option_id)
        described = _descriptions(question)
        for i, (label_a, desc_a) in enumerate(described):
            for label_b, desc_b in described[i + 1:]:
                a, b = _normalized(desc_a), _normalized(desc_b)
                if not a or not b:
                    continue
                ratio = difflib.SequenceMatcher(None, a, b).ratio()
                if ratio >= NEAR_DUPLICATE_RATIO:
                    warnings.append(SchemaProblem(("questions", qid, "criteria"),
                                                  f"{_q(qid, 'criteria')}: {label_a} and {label_b} have nearly the "
                                                  f"same description ({ratio:.0%} similar); the model can hardly "
                                                  "tell them apart", "warning"))
        if question["type"] == "choice" and isinstance(criteria, dict):
            for option_id, desc in criteria.items():
                if desc is None or (isinstance(desc, str) and not desc.strip()):
                    warnings.append(SchemaProblem(("questions", qid, "criteria", option_id),
                                                  f'{_q(qid, "criteria")}: option "{option_id}" has no '
                                                  "description; the model sees only its id", "warning"))
    return warnings


# ---------------------------------------------------------------------------------------------------------------
# The schema document


@dataclass
class Schema:
    """One schema of the library. `questions` is the System One questions map, in the order the model reads it."""

    name: str
    questions: dict[str, Any]
    version: int = 1
    description: str = ""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The file's content, keys in the fixed order name, version, description, questions, examples."""
        data: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "questions": {qid: _canonical_question(q) for qid, q in self.questions.items()},
        }
        if self.examples:
            data["examples"] = [_canonical_example(e) for e in self.examples]
        return data

    def to_json(self) -> str:
        """Indent 2, UTF-8 text, trailing newline: the exact bytes of the library file."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "schema") -> Schema:
        """Build a Schema from parsed JSON. Raises SchemaError listing every error (file shape and questions)."""
        problems = validate_schema_dict(data)
        if problems:
            raise SchemaError(problems, source=source)
        return cls(
            name=data["name"].strip(),
            version=data.get("version", 1),
            description=data.get("description", ""),
            questions=_plain(data["questions"]),
            examples=_plain(data.get("examples", [])),
        )

    @classmethod
    def from_json(cls, text: str, *, source: str = "schema") -> Schema:
        return cls.from_dict(loads_schema_json(text, source=source), source=source)

    def problems(self) -> list[SchemaProblem]:
        """Errors and warnings, errors first."""
        return validate_schema_dict(self.to_dict()) + lint_questions(self.questions)


def _content(schema: Schema) -> dict[str, Any]:
    """What a save can change: everything but the version number."""
    data = schema.to_dict()
    data.pop("version")
    return data


def _plain(value: Any) -> Any:
    """Turn _PairsDicts back into plain dicts (recursively), keeping order."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _canonical_question(question: dict[str, Any]) -> dict[str, Any]:
    # Fixed key order so files diff cleanly; choice options and score levels keep the author's order
    # (the response echoes choice ids in that order; score level order is meaning).
    out = {k: question[k] for k in ("type", "instructions", "criteria") if k in question}
    out.update({k: v for k, v in question.items() if k not in out})
    return out


def _canonical_example(example: dict[str, Any]) -> dict[str, Any]:
    out = {k: example[k] for k in ("name", "state") if k in example}
    out.update({k: v for k, v in example.items() if k not in out})
    return out


def validate_schema_dict(data: Any) -> list[SchemaProblem]:
    """Errors in a parsed schema file: top-level fields, examples, and every question."""
    if not isinstance(data, dict):
        return [SchemaProblem((), "a schema file must hold a JSON object with name, version, description, "
                                  "questions")]
    problems: list[SchemaProblem] = []
    for dup in getattr(data, "duplicate_keys", ()):
        problems.append(SchemaProblem((dup,), f'the top-level field "{dup}" appears more than once'))
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append(SchemaProblem(("name",), 'field "name": required, a non-empty string'))
    elif len(name) > 200:
        problems.append(SchemaProblem(("name",), 'field "name": at most 200 characters'))
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        problems.append(SchemaProblem(("version",), f'field "version": must be a whole number ≥ 1 (got '
                                                    f"{json.dumps(version)})"))
    if not isinstance(data.get("description", ""), str):
        problems.append(SchemaProblem(("description",), 'field "description": must be a string'))
    if "questions" not in data:
        problems.append(SchemaProblem(("questions",), 'field "questions": required'))
    else:
        problems.extend(validate_questions(data["questions"]))
    examples = data.get("examples", [])
    if not isinstance(examples, list):
        problems.append(SchemaProblem(("examples",), 'field "examples": must be a list of {"name", "state"}'))
    else:
        for i, example in enumerate(examples):
            if not isinstance(example, dict) or "state" not in example:
                problems.append(SchemaProblem(("examples", i), f'example {i + 1}: must be an object with "name" '
                                                               'and "state"'))
            elif not isinstance(example.get("name", ""), str):
                problems.append(SchemaProblem(("examples", i, "name"), f'example {i + 1}, field "name": must be a '
                                                                       "string"))
    known = {"name", "version", "description", "questions", "examples"}
    for key in data:
        if key not in known:
            allowed = ", ".join(sorted(known))
            problems.append(SchemaProblem((key,), f'unknown top-level field "{key}" (allowed: {allowed})'))
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Diff of two versions: what an analyst asks of a history ("what did I change in the wording?"), question by
# question and option by option, rather than a line diff of the JSON (which git gives already).

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


# ---------------------------------------------------------------------------------------------------------------
# Builder rows: the editable, list-shaped form of a questions map (the Decide page's schema builder).
#
# A row is {"id", "type", "instructions", "options": [{"id", "description"}], "levels": [str],
#           "true": str, "false": str}. Rows are a list, so a duplicated id stays visible instead of being merged.


def _as_text(value: Any) -> str:
    """A description for a text box. The contract allows JSON descriptions; the builder shows them as JSON text."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def question_to_row(qid: str, question: dict[str, Any]) -> dict[str, Any]:
    """One question of a questions map as an editable row."""
    criteria = question.get("criteria")
    row: dict[str, Any] = {
        "id": qid,
        "type": question.get("type", "noul"),
        "instructions": _as_text(question.get("instructions", "")),
        "options": [],
        "levels": [],
        "true": "",
        "false": "",
    }
    if row["type"] == "choice" and isinstance(criteria, dict):
        row["options"] = [{"id": k, "description": _as_text(v)} for k, v in criteria.items()]
    elif row["type"] == "score" and isinstance(criteria, list):
        row["levels"] = [_as_text(v) for v in criteria]
    elif row["type"] == "noul" and isinstance(criteria, dict):
        row["true"] = _as_text(criteria.get("true"))
        row["false"] = _as_text(criteria.get("false"))
    return row


def questions_to_rows(questions: dict[str, Any]) -> list[dict[str, Any]]:
    return [question_to_row(qid, q) for qid, q in questions.items()]


def row_to_question(row: dict[str, Any]) -> dict[str, Any]:
    """An editable row as a System One question. Blank option descriptions become null; blank noul sides drop."""
    qtype = row.get("type", "noul")
    instructions = row.get("instructions", "")
    question: dict[str, Any] = {"type": qtype, "instructions": instructions}
    if qtype == "choice":
        question["criteria"] = {
            str(o.get("id", "")).strip(): (o.get("description") or "").strip() or None
            for o in row.get("options", [])
            if str(o.get("id", "")).strip()
        }
    elif qtype == "score":
        question["criteria"] = [str(level) for level in row.get("levels", [])]
    else:
        sides = {k: (row.get(k) or "").strip() for k in NOUL_CRITERIA_KEYS if (row.get(k) or "").strip()}
        question["criteria"] = sides or None
    return question


def options_to_text(options: Iterable[dict[str, Any]]) -> str:
    """Choice options as editor text: one option per line, `id: description` (or just `id`)."""
    lines = []
    for option in options:
        description = (option.get("description") or "").strip()
        lines.append(f"{option['id']}: {description}" if description else str(option["id"]))
    return "\n".join(lines)


def text_to_options(text: str) -> list[dict[str, str]]:
    """Editor text back to options. Each non-blank line is `id: description` or `id`; the id ends at the first
    colon, so ids typed in the builder cannot contain one (schema files can)."""
    options = []
    for line in text.splitlines():
        if not line.strip():
            continue
        option_id, _, description = line.partition(":")
        options.append({"id": option_id.strip(), "description": description.strip()})
    return options


def levels_to_text(levels: Iterable[str]) -> str:
    """Score levels as editor text: one per line, lowest first."""
    return "\n".join(str(level) for level in levels)


def text_to_levels(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def rows_to_questions(rows: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], list[SchemaProblem]]:
    """Rows as a questions map, plus errors the map alone could not show (duplicate ids, options dropped).

    The errors from validate_questions on the result are included, so the caller needs only this list.
    """
    questions = _PairsDict()
    problems: list[SchemaProblem] = []
    first_of: dict[str, int] = {}
    for index, row in enumerate(rows):
        qid = str(row.get("id", "")).strip()
        if not qid:
            problems.append(SchemaProblem(("questions", index), f'question {index + 1}, field "id": required'))
            continue
        if qid in questions:
            # on the later question by its position: the first one with the id is the one kept, and fine
            problems.append(SchemaProblem(("questions", index), f'question "{qid}": the id appears more than once '
                                                                f"(questions {first_of[qid] + 1} and {index + 1}); "
                                                                f"give question {index + 1} an id of its own"))
            continue
        first_of[qid] = index
        if row.get("type") == "choice":
            option_ids = [str(o.get("id", "")).strip() for o in row.get("options", [])]
            seen: set[str] = set()
            for option_id in option_ids:
                if option_id and option_id in seen:
                    problems.append(SchemaProblem(("questions", qid, "criteria", option_id),
                                                  f'{_q(qid, "criteria")}: option id "{option_id}" appears more '
                                                  "than once"))
                seen.add(option_id)
            if any(not o for o in option_ids):
                problems.append(SchemaProblem(("questions", qid, "criteria"),
                                              f"{_q(qid, 'criteria')}: an option has no id"))
        questions[qid] = row_to_question(row)
    problems.extend(validate_questions(questions))
    return _plain(questions), problems


# ---------------------------------------------------------------------------------------------------------------
# The library folder


def slugify(name: str) -> str:
    """A safe file stem for a schema name: lowercase ASCII letters, digits and dashes, at most 80 characters."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_name.lower()).strip("-")[:80].strip("-")
    return slug or "schema"


@dataclass(frozen=True)
class SchemaEntry:
    """A line of the library listing. `problem` is set (and the rest partly empty) when the file does not load."""

    slug: str
    path: Path
    name: str
    version: int
    description: str
    question_count: int
    problem: str | None = None


class SchemaLibrary:
    """The schema files of one folder. Slugs (file stems) are the ids; they never contain path separators.

    With a `history` (the workbench's Store), every content a schema is saved with is also kept there as a numbered
    version (clef_workbench/store/schema_versions.py) and the file carries that number; a file changed outside the
    workbench (git, an editor) becomes a version when the library reads it. Deleting keeps the history, so a
    deleted schema can be restored, and any version can be restored as a new one. Without a history the library is
    the folder alone."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, history: Any = None):
        if directory is None:
            directory = WorkbenchSettings.from_env().schemas_dir
        self.directory = Path(directory)
        self.history = history

    def path_of(self, slug: str) -> Path:
        """The file of a slug. Refuses anything that is not a plain slug, so no name can leave the folder."""
        if not isinstance(slug, str) or not SLUG_PATTERN.fullmatch(slug):
            raise SchemaError([SchemaProblem((), f"{slug!r} is not a schema id (lowercase letters, digits, dashes)")])
        return self.directory / f"{slug}{SCHEMA_FILE_SUFFIX}"

    def slugs(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.stem for p in self.directory.glob(f"*{SCHEMA_FILE_SUFFIX}")
                      if p.is_file() and SLUG_PATTERN.fullmatch(p.stem))

    def list(self) -> list[SchemaEntry]:
        """Every schema file, sorted by slug; files that fail to load are listed with their problem."""
        entries = []
        for slug in self.slugs():
            path = self.path_of(slug)
            try:
                schema = self.load(slug)
            except SchemaError as exc:
                entries.append(SchemaEntry(slug, path, slug, 0, "", 0, problem=str(exc)))
                continue
            entries.append(SchemaEntry(slug, path, schema.name, schema.version, schema.description,
                                       len(schema.questions)))
        return entries

    def exists(self, slug: str) -> bool:
        return self.path_of(slug).is_file()

    def load(self, slug: str) -> Schema:
        path = self.path_of(slug)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SchemaError([SchemaProblem((), f'no schema "{slug}" in {self.directory}')]) from None
        except UnicodeDecodeError:
            raise SchemaError([SchemaProblem((), "the file is not UTF-8 text")], source=path.name) from None
        return self._recorded(slug, Schema.from_json(text, source=path.name), "on disk")

    def _recorded(self, slug: str, schema: Schema, action: str) -> Schema:
        """The schema numbered as its version in the history (recorded there if its content is new)."""
        if self.history is None:
            return schema
        version = self.history.record_schema_version(slug, schema.to_dict(), action=action)
        return dataclasses.replace(schema, version=version["number"])

    def _write(self, slug: str, schema: Schema, action: str) -> Schema:
        problems = validate_schema_dict(schema.to_dict())
        if problems:
            raise SchemaError(problems, source=schema.name)
        # into the history first: a file never holds a version the history lacks
        schema = self._recorded(slug, schema, action)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_of(slug)
        tmp = path.with_name(f".{path.name}.tmp")
        # Write then rename, so a crash never leaves a half-written schema file.
        tmp.write_text(schema.to_json(), encoding="utf-8")
        os.replace(tmp, path)
        return schema

    def unique_slug(self, name: str) -> str:
        base = slugify(name)
        slug, n = base, 2
        while self.exists(slug):
            suffix = f"-{n}"
            slug = base[: 80 - len(suffix)] + suffix
            n += 1
        return slug

    def create(self, schema: Schema, *, action: str = "create") -> str:
        """Save a new schema under a fresh slug derived from its name; returns the slug. Never overwrites."""
        slug = self.unique_slug(schema.name)
        self._write(slug, schema, action)
        return slug

    def update(self, slug: str, schema: Schema, *, action: str = "update") -> Schema:
        """Overwrite an existing schema. The version goes up by one when anything but the version changed (each
        save is a version); returns what was saved. The slug (file name) stays, even if the name changed, so
        references to it keep working."""
        current = self.load(slug)
        saved = Schema(name=schema.name, questions=_plain(schema.questions), version=current.version,
                       description=schema.description, examples=_plain(list(schema.examples)))
        if _content(saved) != _content(current):
            saved.version = current.version + 1
        else:
            saved.version = max(schema.version, current.version)
        return self._write(slug, saved, action)

    def duplicate(self, slug: str, new_name: str | None = None) -> str:
        """Copy a schema under a new name (default "<name> (copy)"), starting again at version 1."""
        original = self.load(slug)
        copy = Schema(name=new_name or f"{original.name} (copy)", questions=original.questions, version=1,
                      description=original.description, examples=original.examples)
        return self.create(copy, action="duplicate")

    def delete(self, slug: str, *, who: str = "") -> None:
        """Remove the file. With a history, its versions stay and the delete is logged: `restore` undoes it."""
        path = self.path_of(slug)
        if not path.is_file():
            raise SchemaError([SchemaProblem((), f'no schema "{slug}" in {self.directory}')])
        if self.history is not None:
            current = self.load(slug)  # records the file's content if the history lacks it
            path.unlink()
            self.history.log_change("delete", "schema", slug, f"{current.name} ({slug}.json)", who=who,
                                    data={"version": current.version})
        else:
            path.unlink()

    def deleted(self) -> list[str]:
        """Slugs with a history but no file: deleted schemas that `restore` brings back."""
        if self.history is None:
            return []
        return [slug for slug in self.history.schema_history_slugs() if not self.exists(slug)]

    def restore(self, slug: str, number: int | None = None, *, who: str = "") -> Schema:
        """Make version `number` of the schema its current content again, as a new version (nothing is lost), or
        bring a deleted schema back (number None: its latest version). Needs a history."""
        if self.history is None:
            raise SchemaError([SchemaProblem((), "this library keeps no history to restore from")])
        from clef_workbench.store import NotFoundError

        try:
            version = (self.history.latest_schema_version(slug) if number is None
                       else self.history.get_schema_version_number(slug, number))
        except NotFoundError as exc:
            raise SchemaError([SchemaProblem((), str(exc))]) from None
        if version is None:
            raise SchemaError([SchemaProblem((), f'schema "{slug}" has no history to restore')])
        schema = Schema.from_dict(version["schema"], source=f"{slug} version {version['number']}")
        was_deleted = not self.exists(slug)
        if was_deleted:
            saved = self._write(slug, schema, "restore")
            self.history.log_change("restore", "schema", slug, f"{saved.name} ({slug}.json)", who=who,
                                    data={"version": saved.version})
            return saved
        return self.update(slug, schema, action="restore")

    def import_json(self, data: bytes | str, *, filename: str | None = None, overwrite: bool = False) -> str:
        """Add a schema from uploaded JSON. The file name the user gave is used only in messages (never as a path);
        the slug comes from the schema's name. Also accepts a bare questions map or a System One request, then
        named after the file. Returns the slug. With overwrite, a schema of the same slug is replaced."""
        source = filename or "upload"
        if isinstance(data, bytes):
            if len(data) > MAX_IMPORT_BYTES:
                raise SchemaError([SchemaProblem((), f"the file is {len(data):,} bytes; at most "
                                                     f"{MAX_IMPORT_BYTES:,} are accepted")], source=source)
            try:
                data = data.decode("utf-8-sig")
            except UnicodeDecodeError:
                raise SchemaError([SchemaProblem((), "the file is not UTF-8 text")], source=source) from None
        parsed = loads_schema_json(data, source=source)
        if isinstance(parsed, dict) and "name" not in parsed:
            # A System One request or a bare questions map: wrap it, naming it after the uploaded file.
            stem = Path(filename).stem if filename else "imported schema"
            if "questions" in parsed:
                questions = parsed["questions"]
            else:
                questions = parsed
            wrapped = _PairsDict(name=stem, version=1, description=f"Imported from {source}", questions=questions)
            parsed = wrapped
        schema = Schema.from_dict(parsed, source=source)
        slug = slugify(schema.name)
        if overwrite and self.exists(slug):
            self._write(slug, schema, "import")
            return slug
        return self.create(schema, action="import")

    def export_json(self, slug: str) -> str:
        """The schema file's canonical text (what a download gives)."""
        return self.load(slug).to_json()
