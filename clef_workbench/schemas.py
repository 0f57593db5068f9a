"""A schema and its rules: the document kept in the library (clef_workbench.schema_library), its validation by
the System One contract and its lint. Versions are compared in clef_workbench.schema_diff.

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

import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from clef_engine import protocol
from clef_engine.errors import Problem, RequestError

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
    """Parse JSON text, keeping duplicate keys so that validation can report duplicate ids; a syntax error raises
    SchemaError naming its line and column."""
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            [SchemaProblem((), f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")], source=source
        ) from None


# -- validation and lint ------------------------------------------------------------------------------------------

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
                loc = ("questions", qid, key)
                problems.append(SchemaProblem(loc, f"{_where(loc)}: unknown field (allowed: "
                                                   f"{', '.join(protocol.QUESTION_FIELDS)})"))
        for dup in getattr(question.get("criteria"), "duplicate_keys", ()):
            where = _where(("questions", qid, "criteria"))
            problems.append(SchemaProblem(("questions", qid, "criteria", dup),
                                          f'{where}: option id "{dup}" appears more than once'))
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


def way_out_options(criteria: dict[str, Any]) -> list[str]:
    """The ids of a choice question's options that give the model a way out when no real option fits ("unknown",
    "none of these"), by their id or their description."""
    return [k for k, v in criteria.items() if UNKNOWN_OPTION_ID_PATTERN.search(re.sub(r"[_.\-]+", " ", k))
            or UNKNOWN_DESCRIPTION_PATTERN.search(v if isinstance(v, str) else "")]


def lint_questions(questions: Any) -> list[SchemaProblem]:
    """Warnings about a questions map that the hosted service would refuse, or that is valid but likely to give
    poor or ambiguous answers."""
    if not isinstance(questions, dict):
        return []
    warnings = [_schema_problem(p, "warning") for p in protocol.hosted_service_problems(questions)]

    def warn(text: str, qid: str, field: str = "id", *option: str) -> None:
        loc = ("questions", qid) if field == "id" else ("questions", qid, field, *option)
        warnings.append(SchemaProblem(loc, f"{_where(('questions', qid, field))}: {text}", "warning"))

    seen_folded: dict[str, str] = {}
    for qid, question in questions.items():
        folded = qid.casefold()
        if folded in seen_folded:
            warn(f'differs from "{seen_folded[folded]}" only in letter case', qid)
        seen_folded.setdefault(folded, qid)
        if not isinstance(question, dict) or question.get("type") not in QUESTION_TYPES:
            continue
        instructions = question.get("instructions")
        if instructions in (None, {}, []) or (isinstance(instructions, str) and not instructions.strip()):
            warn(f'empty; the model will read only the id "{qid}" as the question', qid, "instructions")
        criteria = question.get("criteria")
        options = criteria if question["type"] == "choice" and isinstance(criteria, dict) else None
        if options is not None and not way_out_options(options):
            warn('no "unknown" / "none of these" option; when nothing fits, the model must still pick one of the '
                 "listed options", qid, "criteria")
        folded_ids: dict[str, str] = {}
        for option_id in options or {}:
            key = _normalized(option_id)
            if key in folded_ids:
                warn(f'option ids "{folded_ids[key]}" and "{option_id}" differ only in case or spaces', qid,
                     "criteria", option_id)
            folded_ids.setdefault(key, option_id)
        described = _descriptions(question)
        for i, (label_a, desc_a) in enumerate(described):
            for label_b, desc_b in described[i + 1:]:
                a, b = _normalized(desc_a), _normalized(desc_b)
                ratio = difflib.SequenceMatcher(None, a, b).ratio() if a and b else 0.0
                if ratio >= NEAR_DUPLICATE_RATIO:
                    warn(f"{label_a} and {label_b} have nearly the same description ({ratio:.0%} similar); the "
                         "model can hardly tell them apart", qid, "criteria")
        for option_id, desc in (options or {}).items():
            if desc is None or (isinstance(desc, str) and not desc.strip()):
                warn(f'option "{option_id}" has no description; the model sees only its id', qid, "criteria",
                     option_id)
    return warnings


# -- the schema document ------------------------------------------------------------------------------------------

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
            "name": self.name, "version": self.version, "description": self.description,
            "questions": {qid: _keys_first(q, "type", "instructions", "criteria") for qid, q in self.questions.items()},
        }
        if self.examples:
            data["examples"] = [_keys_first(e, "name", "state") for e in self.examples]
        return data

    def to_json(self) -> str:
        """The exact text of the library file."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "schema") -> Schema:
        """Build a Schema from parsed JSON. Raises SchemaError listing every error (file shape and questions)."""
        problems = validate_schema_dict(data)
        if problems:
            raise SchemaError(problems, source=source)
        return cls(name=data["name"].strip(), version=data.get("version", 1), description=data.get("description", ""),
                   questions=plain_json(data["questions"]), examples=plain_json(data.get("examples", [])))

    @classmethod
    def from_json(cls, text: str, *, source: str = "schema") -> Schema:
        return cls.from_dict(loads_schema_json(text, source=source), source=source)

    def problems(self) -> list[SchemaProblem]:
        """Errors and warnings, errors first."""
        return validate_schema_dict(self.to_dict()) + lint_questions(self.questions)


def plain_json(value: Any) -> Any:
    """A parsed value with its _PairsDicts turned back into plain dicts (recursively, a copy), keeping order."""
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_json(v) for v in value]
    return value


def _keys_first(value: dict[str, Any], *first: str) -> dict[str, Any]:
    """`value` with the keys `first` in that order ahead of the rest, so that files diff cleanly. Choice options and
    score levels keep the author's order (the response echoes choice ids in that order; score level order is
    meaning)."""
    return {**{key: value[key] for key in first if key in value}, **value}


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
