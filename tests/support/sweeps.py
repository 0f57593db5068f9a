"""What the sweep tests share: a one-question library schema to sweep."""

from __future__ import annotations

from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema


def one_question_schema(library: SchemaLibrary) -> None:
    """The shipped ticket schema's `team` question alone, as a library schema of its own: a sweep on a busy CPU
    takes a state and a schema per case and variant, and one question keeps both short."""
    tickets = library.load("support-ticket-routing")
    library.create(Schema(name="Ticket team", questions={"team": tickets.questions["team"]}))
