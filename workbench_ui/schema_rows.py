"""Builder rows: the editable, list-shaped form of a questions map (a list, so a duplicated id stays visible)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from clef_workbench.schemas import NOUL_CRITERIA_KEYS, SchemaProblem, validate_questions


def _q(qid: str, fieldname: str) -> str:
    return f'question "{qid}", field "{fieldname}"'


def _as_text(value: Any) -> str:
    """A description for a text box. The contract allows JSON descriptions; the builder shows them as JSON text."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def question_to_row(qid: str, question: dict[str, Any]) -> dict[str, Any]:
    criteria = question.get("criteria")
    row: dict[str, Any] = {"id": qid, "type": question.get("type", "noul"),
                           "instructions": _as_text(question.get("instructions", "")), "options": [], "levels": [],
                           "true": "", "false": ""}
    if row["type"] == "choice" and isinstance(criteria, dict):
        row["options"] = [{"id": k, "description": _as_text(v)} for k, v in criteria.items()]
    elif row["type"] == "score" and isinstance(criteria, list):
        row["levels"] = [_as_text(v) for v in criteria]
    elif row["type"] == "noul" and isinstance(criteria, dict):
        row.update({side: _as_text(criteria.get(side)) for side in NOUL_CRITERIA_KEYS})
    return row


def questions_to_rows(questions: dict[str, Any]) -> list[dict[str, Any]]:
    return [question_to_row(qid, q) for qid, q in questions.items()]


def row_to_question(row: dict[str, Any]) -> dict[str, Any]:
    """An editable row as a System One question. Blank option descriptions become null; blank noul sides drop."""
    qtype = row.get("type", "noul")
    instructions = row.get("instructions", "")
    question: dict[str, Any] = {"type": qtype, "instructions": instructions}
    if qtype == "choice":
        question["criteria"] = {str(o.get("id", "")).strip(): (o.get("description") or "").strip() or None
                                for o in row.get("options", []) if str(o.get("id", "")).strip()}
    elif qtype == "score":
        question["criteria"] = [str(level) for level in row.get("levels", [])]
    else:
        sides = {k: (row.get(k) or "").strip() for k in NOUL_CRITERIA_KEYS if (row.get(k) or "").strip()}
        question["criteria"] = sides or None
    return question


def options_to_text(options: Iterable[dict[str, Any]]) -> str:
    lines = []
    for option in options:
        description = (option.get("description") or "").strip()
        lines.append(f"{option['id']}: {description}" if description else str(option["id"]))
    return "\n".join(lines)


def text_to_options(text: str) -> list[dict[str, str]]:
    """Editor text back to options: each non-blank line `id: description` or `id` (the id ends at the first colon)."""
    lines = (line.partition(":") for line in text.splitlines() if line.strip())
    return [{"id": option_id.strip(), "description": description.strip()} for option_id, _, description in lines]


def levels_to_text(levels: Iterable[str]) -> str:
    return "\n".join(str(level) for level in levels)


def text_to_levels(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def rows_to_questions(rows: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], list[SchemaProblem]]:
    """Rows as a questions map, with every problem (duplicate ids and validate_questions')."""
    questions: dict[str, Any] = {}
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
    return questions, problems
