"""What the Case sets page shows and says, without Streamlit: labels, imports, edits, deletes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from clef_workbench import case_table, casesets, importing
from clef_workbench.case_table import CaseDeletionRefusedError
from clef_workbench.casesets import CaseImportError, CsvMapping
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import SchemaError
from clef_workbench.store import NewCase, StoreError
from workbench_ui import units

NO_SCHEMA = "(none)"
NOT_MAPPED = "(not mapped)"
FIELDS_FROM_COLUMNS = "Fields from columns"
STATE_MODES = [FIELDS_FROM_COLUMNS, "Whole state from one column"]
PREVIEW_CASES = 10
PREVIEW_STATE_CHARS = 200
LISTED_PROBLEMS = 50


def when(iso: str, *, digits: int = 19) -> str:
    """A stored UTC timestamp as people read it: date and time to the second (or the millisecond, digits=23)."""
    return iso[:digits].replace("T", " ")


def case_set_label(case_set: dict) -> str:
    return f"{case_set['name']} ({case_set['case_count']} cases)"


def deleted_set_label(case_set: dict) -> str:
    return f"{case_set['name']} · {case_set['case_count']} cases · deleted {when(case_set['deleted_at'])} UTC"


def case_set_caption(case_set: dict) -> str:
    return (f"Schema: **{case_set['schema_name'] or 'none'}** · {case_set['case_count']} cases · created "
            f"{when(case_set['created_at'])} · {case_set['description'] or ''}")


def case_set_schema(library: SchemaLibrary, slug: str | None) -> tuple[dict | None, str | None]:
    """The schema a set's expected answers are checked against, and a warning when it does not load."""
    if not slug or slug not in library.slugs():
        return None, None
    try:
        return library.load(slug).to_dict(), None
    except SchemaError as exc:
        return None, f"Schema {slug!r} does not load, so expected answers are not checked: {exc}"


def library_question_ids(library: SchemaLibrary) -> list[str]:
    """Every question id of the library: without a schema, a column named like one holds an answer, not evidence."""
    ids: dict[str, None] = {}
    for slug in library.slugs():
        try:
            ids.update(dict.fromkeys(library.load(slug).questions))
        except SchemaError:
            continue
    return list(ids)


def schema_pick(case_set: dict, slugs: list[str]) -> str:
    return case_set["schema_name"] if case_set["schema_name"] in slugs else NO_SCHEMA


def export_stem(name: str) -> str:
    """A file name for a case set's export: its name in lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cases"


def problems_markdown(problems: list) -> str:
    more = len(problems) - LISTED_PROBLEMS
    return "\n".join(f"- {p}" for p in problems[:LISTED_PROBLEMS]) + (f"\n- … and {more} more" if more > 0 else "")


def plural(count: int, noun: str) -> str:
    """ "1 case", "3 cases"."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def delete_refusal(case_set: dict, runs_of_set: list[dict]) -> str | None:
    """Why a case set cannot be deleted now (it has runs), said before asking; None when it can."""
    if runs_of_set:
        them = "it" if len(runs_of_set) == 1 else "them"
        return (f"“{case_set['name']}” cannot be deleted: it has {plural(len(runs_of_set), 'run')}. Delete {them} "
                "on the Runs page first.")
    return None


def restore_deleted(store: Any, kind: str, object_id: Any) -> tuple[str, str]:
    """Undo a delete of "cases" (ids) or a "case_set": the message's kind and text."""
    try:
        if kind == "cases":
            for case_id in object_id:
                store.restore_case(case_id)
            return "success", f"Restored {len(object_id)} case(s)."
        store.restore_case_set(object_id)
        return "success", f"Restored case set #{object_id}."
    except StoreError as exc:
        return "error", f"Not restored: {exc}"


def mapped_index(columns: list[str], column: str | None) -> int:
    """Where `column` stands among a mapping selector's options (NOT_MAPPED, then `columns`); 0 when it is not there."""
    return 1 + columns.index(column) if column in columns else 0


@dataclass
class ImportMapping:
    """The columns chosen for an import, and what they mean for the state the model reads."""

    columns: list[str]
    questions: list[str]
    expected: dict[str, str] = field(default_factory=dict)  # column -> question id
    tags_column: str = NOT_MAPPED
    id_column: str = NOT_MAPPED
    answer_names: list[str] = field(default_factory=list)  # more names of answers: the library's, without a schema

    @property
    def label_like(self) -> list[str]:
        return casesets.label_like_columns(self.columns, [*self.questions, *self.answer_names])

    @property
    def used(self) -> set[str]:
        return set(self.expected) | ({self.tags_column, self.id_column} - {NOT_MAPPED})

    def suggested_state(self) -> list[str]:
        """The columns to offer as the state: the evidence, never an answer, the tags or a record's id."""
        left_out = self.used | set(importing.id_like_columns(self.columns)) | set(self.label_like)
        return importing.suggested_state_columns(self.columns, left_out, self.questions)

    def mapping(self, *, state_columns: list[str] | None = None, state_text_column: str | None = None) -> CsvMapping:
        return CsvMapping(state_columns=state_columns or [], state_text_column=state_text_column,
                          expected_columns=self.expected,
                          tags_column=None if self.tags_column == NOT_MAPPED else self.tags_column,
                          id_column=None if self.id_column == NOT_MAPPED else self.id_column)

    def leaked(self, state: list[str]) -> list[str]:
        return [c for c in state if c in self.label_like or c in self.expected]

    def state_warning(self, state: list[str]) -> tuple[str, str] | None:
        """A warning when answers leak into the state; a caption naming the answer-like columns left out."""
        if leaked := self.leaked(state):
            return ("warning", "These columns look like expected answers and are in the state, so the model reads "
                               f"the answer: {', '.join(leaked)}. Remove them from the state unless that is what you "
                               "want.")
        if self.label_like:
            return "caption", "Left out of the state because they look like answers: " + ", ".join(
                f"`{c}`" for c in self.label_like)
        return None


def suggest_button_label(candidates: list[str]) -> str:
    return f"Use the {len(candidates)} column(s) that are not mapped or labels: " + ", ".join(candidates)


def state_choice_advice(candidates: list[str]) -> str:
    """What to do while no column is chosen as the state: the controls above that fix it, by their names."""
    offer = f" or take the suggestion with “{suggest_button_label(candidates)}”" if candidates else ""
    return ("Choose the columns the model reads in “Columns that become state fields” above" + offer
            + ". Nothing else is needed: the preview and the Import button appear then.")


def problems_heading(count: int, *, stage: str) -> str:
    """The line above listed problems, by stage: a refused "save", a file to "read", a JSONL "file", or "cells"."""
    problems = plural(count, "problem")
    if stage == "save":
        return f"Nothing was changed: {problems}."
    if stage == "read":
        return f"This file cannot be read as it is: {problems}."
    if stage == "file":
        them = "it" if count == 1 else "them"
        return f"This file cannot be imported as it is: {problems}. Fix {them} in the file and choose it again."
    return (f"These rows cannot be imported with this mapping: {problems}. Change the mapping above (the column "
            "of a question, or the state columns), or fix the file and choose it again.")


def preview_rows(parsed: list[dict]) -> list[dict[str, Any]]:
    """The first parsed cases as the preview table shows them (media counted; the source id where one is mapped)."""
    with_ids = any(c.get("source_id") for c in parsed)
    return [{**({"source id": c["source_id"]} if with_ids else {}),
             "state": casesets.state_text(c["state"])[:PREVIEW_STATE_CHARS], "expected": c["expected"],
             "tags": ", ".join(c["tags"]), "images": len(c["images"]), "videos": len(c["videos"])}
            for c in parsed[:PREVIEW_CASES]]


def imported_message(set_name: str, parsed: int, added: int, skipped_rows: list[int] | None) -> tuple[str, str]:
    """After an import, the message's kind and text (nothing new is information, not success)."""
    already = parsed - added
    skipped = f" Rows not imported, as agreed: {', '.join(map(str, skipped_rows))}." if skipped_rows else ""
    if not added:
        every = "it is" if parsed == 1 else f"all {parsed:,} are"
        return "info", f"Nothing new to import: {every} already in “{set_name}”.{skipped}"
    were = "was" if already == 1 else "were"
    return "success", (f"Imported {plural(added, 'case')} into “{set_name}”."
                       + (f" {already:,} {were} already in it and skipped." if already else "") + skipped)


def load_examples(store: Any, library: SchemaLibrary) -> str:
    return f"Example case sets ready: {len(casesets.load_example_case_sets(store, library.directory))}."


def import_parsed(store: Any, case_set_id: int, parsed: list[dict]) -> tuple[list[int] | None, str | None]:
    return units.refusal(casesets.import_cases, store, case_set_id, parsed)


@dataclass(frozen=True)
class SaveRefused:
    """Why edits were not saved, and the cases whose deletion was refused (their rows come back)."""

    problems: list[str]
    kept_case_ids: list[int] | None = None


def save_edits(store: Any, case_set_id: int, edited: pd.DataFrame,
               schema: dict | None) -> case_table.CaseEdits | SaveRefused:
    try:
        return case_table.apply_case_edits(store, case_set_id, edited, schema)
    except CaseDeletionRefusedError as exc:
        return SaveRefused(exc.problems, exc.case_ids)
    except CaseImportError as exc:
        return SaveRefused(exc.problems)


def kept_rows_message(refused: SaveRefused) -> str:
    return (f"Nothing was changed: {'; '.join(refused.problems)}. Delete its runs first. The rows are back in the "
            "table; your other edits are still there, not saved.")


def read_file(name: str, data: bytes, encoding: str | None, delimiter: str | None) -> tuple[Any, list[str]]:
    try:
        return importing.read_source(name, data, encoding=encoding, delimiter=delimiter), []
    except CaseImportError as exc:
        return None, exc.problems


def read_caption(source: Any) -> str:
    detected = " (detected)" if source.encoding and source.encoding == source.detected_encoding else ""
    return f"Read as **{source.describe()}**{detected}."


def parse_file(source: Any, mapping: CsvMapping | None, schema: dict | None,
               skip_bad_rows: bool) -> tuple[list[NewCase], list[str]]:
    """The cases of a read file under the mapping, or the problems of its cells (bad rows give neither)."""
    try:
        return importing.parse_cases(source, mapping, schema, skip_bad_rows=skip_bad_rows), []
    except importing.BadRowsError:
        return [], []
    except CaseImportError as exc:
        return [], exc.problems


@dataclass(frozen=True)
class ExportFiles:
    stem: str  # the files' name without its suffix
    jsonl: str
    csv: str
    caption: str = ""


def export_files(store: Any, case_set: dict) -> ExportFiles:
    return ExportFiles(export_stem(case_set["name"]), casesets.export_jsonl(store, case_set["id"]),
                       casesets.export_csv(store, case_set["id"]))
