"""What the sweep tests share: a one-question library schema to sweep, and a finished sweep to show."""

from __future__ import annotations

from typing import Any

from clef_engine import protocol
from clef_workbench import sweeps
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema
from clef_workbench.store import Store


def one_question_schema(library: SchemaLibrary) -> None:
    """The shipped ticket schema's `team` question alone, as a library schema of its own: a sweep on a busy CPU
    takes a state and a schema per case and variant, and one question keeps both short."""
    tickets = library.load("support-ticket-routing")
    library.create(Schema(name="Ticket team", questions={"team": tickets.questions["team"]}))


def seeded_sweep(store: Store, case_set_id: int, schema: dict[str, Any], slug: str) -> int:
    """A finished sweep of the case set with instructions removed and options reversed, answered as an engine
    answers (each variant's own option ids; the probabilities made up, varying with case and variant), for pages
    that show one."""
    variants = sweeps.auto_variants(schema, ["no_instructions", "reversed"])
    sweep_id = sweeps.start_sweep(store, case_set_id, schema, variants, model_id="clef-demo", folds=2,
                                  settings={"schema_slug": slug, "schema_version": schema.get("version")})
    sweep = store.get_sweep(sweep_id)
    for index, case_id in enumerate(store.sweep_cases_left(sweep_id)):
        answers = []
        for position, variant in enumerate(sweep["variants"]):
            asked = protocol.prepare_questions(variant["schema"]["questions"])
            given = {}
            for question in asked:
                weights = [((index + position) * 7 + k * 3) % 11 + 1 for k in range(len(question.option_ids))]
                given[question.id] = protocol.format_answer(question, [w / sum(weights) for w in weights])
            answers.append((position, {"model": "clef-demo", "answers": given}, None))
        store.record_sweep_case(sweep_id, case_id, answers, state_prefills=1, compute_ms=1.0)
    store.set_sweep_status(sweep_id, "finished")
    return sweep_id
