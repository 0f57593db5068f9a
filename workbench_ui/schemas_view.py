"""What the Schemas page shows and says, without Streamlit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clef_workbench.schema_diff import diff_schemas, diff_text
from clef_workbench.schema_library import SchemaEntry, SchemaLibrary
from clef_workbench.schemas import Schema, SchemaProblem
from workbench_ui.cases_view import when

STARTER_QUESTIONS = {"q1": {"type": "noul", "instructions": "Replace this with your first question.", "criteria": None}}


@dataclass
class Listing:
    entries: list[SchemaEntry]
    schemas: dict[str, Schema] = field(default_factory=dict)
    lint: dict[str, list[SchemaProblem]] = field(default_factory=dict)

    @property
    def slugs(self) -> list[str]:
        return [e.slug for e in self.entries]

    def entry(self, slug: str) -> SchemaEntry:
        return next(e for e in self.entries if e.slug == slug)

    def label(self, slug: str) -> str:
        return f"{self.entry(slug).name} ({slug}.json)"

    def table(self) -> list[dict[str, Any]]:
        """The library table: one row per file; a file that does not load says so instead of counts."""
        return [{"file": f"{e.slug}.json", "name": e.name, "version": e.version if e.problem is None else None,
                 "questions": e.question_count if e.problem is None else None,
                 "lint": ("cannot load" if e.problem else
                          f"{len(self.lint[e.slug])} warning(s)" if self.lint[e.slug] else "ok"),
                 "description": e.description} for e in self.entries]


def last_edited(library: SchemaLibrary, slugs: list[str]) -> str | None:
    """The schema whose file changed last (saved here, on the Decide page, or outside the workbench)."""
    return max(slugs, key=lambda slug: library.path_of(slug).stat().st_mtime_ns, default=None)


def shown_schema(slugs: list[str], *, linked: str | None, kept: str | None, last_edited: str | None) -> str:
    """The schema the page opens on: linked (first visit), else chosen before, else last edited, else the first."""
    return next(slug for slug in (linked, kept, last_edited, slugs[0]) if slug in slugs)


def listing(library: SchemaLibrary) -> Listing:
    result = Listing(library.list())
    for entry in result.entries:
        if entry.problem is None:
            result.schemas[entry.slug] = library.load(entry.slug)
            result.lint[entry.slug] = result.schemas[entry.slug].problems()
    return result


def starter_schema(name: str, description: str) -> Schema:
    """A new schema: one placeholder question, so that it is valid and opens in the editors."""
    return Schema(name=name, questions=dict(STARTER_QUESTIONS), description=description)


def overview(schema: Schema) -> str:
    return (f"**{schema.name}** · version {schema.version} · {len(schema.questions)} questions · "
            f"{len(schema.examples)} example states")


def question_rows(schema: Schema) -> list[dict[str, Any]]:
    rows = []
    for qid, question in schema.questions.items():
        criteria = question.get("criteria")
        answers_text = {"noul": "true / false",
                        "choice": ", ".join(criteria) if isinstance(criteria, dict) else "",
                        "score": f"{len(criteria)} levels" if isinstance(criteria, list) else ""}
        rows.append({"id": qid, "type": question["type"], "instructions": question.get("instructions"),
                     "answers": answers_text.get(question["type"], "")})
    return rows


def version_rows(versions: list[dict]) -> list[dict[str, Any]]:
    """The history table, newest first; `note` says where a version came from (an adopted sweep)."""
    return [{"version": v["number"], "saved": when(v["created_at"]), "how": v["action"],
             "note": v["note"], "by": v["who"], "runs": v["run_count"]} for v in versions]


def default_diff_from(numbers: list[int]) -> int:
    """The index of the version the diff starts from: the one before the latest (the latest if it is alone)."""
    return min(1, len(numbers) - 1)


@dataclass(frozen=True)
class VersionDiff:
    title: str
    text: str  # one line per change, [-removed-]{+added+} inside reworded text
    rows: list[dict[str, str]]  # the changes as a table (none when nothing changed)


def version_diff(versions: list[dict], old_number: int, new_number: int) -> VersionDiff:
    by_number = {v["number"]: v for v in versions}
    changes = diff_schemas(by_number[old_number]["schema"], by_number[new_number]["schema"])
    return VersionDiff(f"Changes from version {old_number} to version {new_number}", diff_text(changes),
                       [c.as_row() for c in changes])


def restored_message(slug: str, number: int | None, restored: Schema) -> str:
    """After a restore: an undone delete (number None) or an old version saved again as a new one."""
    what = f"version {number} as version {restored.version}" if number else f"{slug}.json"
    return f"Restored {what}."


def delete_unconfirmed_message(slug: str) -> str:
    return f"Tick “Yes, delete {slug}.json” first: nothing was deleted."
