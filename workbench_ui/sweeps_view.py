"""What the Sweeps page shows, without Streamlit: the alternatives a person writes per question (their editor's
text and what is wrong with it), and Adopt (a sweep's schema made the library schema's new version, its note naming
the sweep and its figures; undone by restoring the version before). The sweep itself (variants, execution, scores)
is clef_workbench.sweeps'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema, SchemaError
from workbench_ui import schema_rows


@dataclass(frozen=True)
class AlternativeEditor:
    """A question's editor text for a written alternative: its instructions and its options as text (choice and
    yes/no: `id: description` per line; score: one level per line, lowest first)."""

    instructions: str
    options: str
    options_help: str


def alternative_editor(question: dict[str, Any]) -> AlternativeEditor:
    """The editor of an alternative to `question`, filled with the question as it is."""
    row = schema_rows.question_to_row("q", question)
    if row["type"] == "score":
        return AlternativeEditor(row["instructions"], schema_rows.levels_to_text(row["levels"]),
                                 "One level per line, the lowest first.")
    if row["type"] == "choice":
        return AlternativeEditor(row["instructions"], schema_rows.options_to_text(row["options"]),
                                 "One option per line: `id: description` (or just `id`). Add, remove, reorder or "
                                 "reword options.")
    sides = [{"id": side, "description": row[side]} for side in ("true", "false") if row[side]]
    return AlternativeEditor(row["instructions"], schema_rows.options_to_text(sides),
                             "What `true` and `false` mean, `true: …` and `false: …`, or nothing.")


def written_alternative(question_id: str, question: dict[str, Any], instructions: str,
                        options: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The alternative a person wrote for `question` as a question of the same type, or None with what is wrong
    (each message names the question and field). The same question as it is is refused: it is no alternative."""
    row = {"id": question_id, "type": question["type"], "instructions": instructions.strip(), "options": [],
           "levels": [], "true": "", "false": ""}
    if question["type"] == "score":
        row["levels"] = schema_rows.text_to_levels(options)
    elif question["type"] == "choice":
        row["options"] = schema_rows.text_to_options(options)
    else:
        sides = {o["id"]: o["description"] for o in schema_rows.text_to_options(options)}
        unknown = sorted(set(sides) - {"true", "false"})
        if unknown:
            return None, [f'question "{question_id}", field "criteria": a yes/no question describes only `true` '
                          f"and `false`, not {', '.join(unknown)}"]
        row.update(sides)
    questions, problems = schema_rows.rows_to_questions([row])
    errors = [p.msg for p in problems if p.severity == "error"]
    if errors:
        return None, errors
    written = questions[question_id]
    if written == schema_rows.row_to_question(schema_rows.question_to_row(question_id, question)):
        return None, [f'question "{question_id}": the alternative is the question as it is; change its '
                      "instructions or options"]
    return written, []
