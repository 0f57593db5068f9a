"""The Sweeps page's view-model: alternatives written per question, the leaderboard (table, chart rows, order
sensitivity, the composed best schema), a variant's flipped cases with their Decide links, and Adopt into a real
schema library (the new version's note, refusals, Undo)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from urllib.parse import parse_qsl

from clef_workbench import sweeps
from clef_workbench.sweep_runner import SweepRunner
from clef_workbench.sweeps import BestSchema, Metric, QuestionScore, SweepResult, Variant, VariantScore
from tests.support.sweeps import one_question_schema, seeded_sweep
from workbench_ui import links
from workbench_ui import sweeps_view as sv

SLUG = "support-ticket-routing"


# -- written alternatives --------------------------------------------------------------------------------------------


def test_an_alternative_starts_from_the_question_and_must_change_it(library):
    questions = library.load(SLUG).questions
    team = sv.alternative_editor(questions["team"])
    assert team.instructions == "Which team should handle this ticket?"
    assert team.options.splitlines()[0] == "billing: Invoices, charges, refunds, payment methods, plan prices."
    assert sv.alternative_editor(questions["priority"]).options.splitlines()[0].startswith("Low: a question")
    assert sv.alternative_editor(questions["needs_human_agent"]).options.splitlines() == [
        "true: It needs investigation, a judgement call, an account change, or an apology.",
        "false: A standard how-to article fully answers it."]

    assert sv.written_alternative("team", questions["team"], team.instructions, team.options) == (
        None, ['question "team": the alternative is the question as it is; change its instructions or options'])
    fewer = "\n".join(team.options.splitlines()[:-1]) + "\nother: Anything else."
    question, problems = sv.written_alternative("team", questions["team"], "Which queue owns it?", fewer)
    assert problems == [] and question["instructions"] == "Which queue owns it?"
    assert list(question["criteria"])[-2:] == ["shipping", "other"] and question["criteria"]["other"] == (
        "Anything else.")

    assert sv.written_alternative("team", questions["team"], "Which queue?", "billing\nbilling: twice")[1] == [
        'question "team", field "criteria": option id "billing" appears more than once']
    assert sv.written_alternative("churn_threat", questions["churn_threat"], "Leaving?", "maybe: perhaps")[1] == [
        'question "churn_threat", field "criteria": a yes/no question describes only `true` and `false`, not maybe']


# -- a sweep's scores, as load_sweep gives them -------------------------------------------------------------------

BASE = {"name": "Tickets", "version": 2, "questions": {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Money", "tech": "Broken"}},
    "urgent": {"type": "noul", "instructions": "Is it urgent?", "criteria": None}}}
REVERSED = {**BASE, "questions": {**BASE["questions"], "team": {
    "type": "choice", "instructions": "Which team?", "criteria": {"o01_tech": "Broken", "o02_billing": "Money"}}}}
WORDED = {**BASE, "questions": {**BASE["questions"], "team": {
    "type": "choice", "instructions": "Which queue owns it?", "criteria": {"billing": "Money", "tech": "Broken"}}}}
PLAIN = {**BASE, "questions": {**BASE["questions"], "urgent": {"type": "noul", "instructions": "", "criteria": None}}}


def score(variant: Variant, accuracy: Metric, change: Metric, flips: dict[str, list[int]],
          order: float | None = None) -> VariantScore:
    questions = {qid: QuestionScore(qid, 40, accuracy, Metric(0.5), Metric(0.6), Metric(0.1), flips.get(qid, []),
                                    change, None if variant.kind == "base" else 0.2,
                                    change.low is not None and change.low > 0) for qid in BASE["questions"]}
    return VariantScore(variant, accuracy, change, questions, sorted({c for ids in flips.values() for c in ids}),
                        order)


def result_of(case_ids: list[int], slug: str = SLUG) -> SweepResult:
    base = Variant("base", BASE, "base")
    variants = [
        score(base, Metric(0.70, 0.60, 0.80), Metric(0.0, 0.0, 0.0), {}),
        score(Variant("reversed:team", REVERSED, "reversed", "team"), Metric(0.65, 0.55, 0.75),
              Metric(-0.05, -0.12, 0.02), {"team": case_ids[:2]}, order=0.25),
        score(Variant("written:team", WORDED, "custom", "team"), Metric(0.72, 0.62, 0.81), Metric(0.02, -0.03, 0.07),
              {"team": case_ids[1:2]}),
        score(Variant("no_instructions:urgent", PLAIN, "no_instructions", "urgent"), Metric(0.80, 0.71, 0.88),
              Metric(0.10, 0.04, 0.16), {"urgent": [case_ids[2]]}),
    ]
    best = BestSchema(PLAIN, {"team": "base", "urgent": "no_instructions:urgent"}, 5, Metric(0.78, 0.69, 0.86),
                      Metric(0.70, 0.60, 0.80), 40, 3)
    return SweepResult(7, "finished", 1, "Tickets", BASE, "clef-demo", {"schema_slug": slug, "schema_version": 2},
                       "2026-12-03T20:00:00", 40, 40, 40, variants, {"team": 0.25}, 0.2, ["team"], best)


def test_the_leaderboard_says_what_beats_the_base_only_when_the_interval_excludes_zero():
    result = result_of([11, 12, 13])
    table = sv.leaderboard_table(result)
    assert list(table["variant"]) == ["no_instructions:urgent", "written:team", "base", "reversed:team"]
    assert table.iloc[0].to_dict() == {
        "variant": "no_instructions:urgent", "kind": "no_instructions", "accuracy": "0.800 [0.710, 0.880]",
        "change vs base": "+0.100 [+0.040, +0.160]", "against the base": "better", "flipped cases": 1,
        "order sensitivity": "", "team": "0.800 [0.710, 0.880]", "urgent": "0.800 [0.710, 0.880]"}
    assert list(table["against the base"]) == ["better", "no clear difference", "base", "no clear difference"]
    assert table.iloc[3]["order sensitivity"] == "25%" and table.iloc[2]["change vs base"] == ""

    chart = sv.chart_frame(result)
    assert len(chart) == 4 * 3  # each variant: overall and each of two questions
    assert list(chart[chart["variant"] == "base"]["scope"]) == ["overall", "team", "urgent"]
    assert chart.iloc[0][["accuracy", "low", "high"]].tolist() == [0.70, 0.60, 0.80]

    assert sv.order_sensitivity_lines(result) == [
        (True, "`team`: 25% of cases change their answer when only the options' order changes — above the "
               "threshold (threshold 20%)")]
    assert sv.best_text(result) == (
        "**Composed best schema** (`team` from “base”, `urgent` from “no_instructions:urgent”): held-out accuracy "
        "0.780 [0.690, 0.860] against the base's 0.700 [0.600, 0.800] on the same 40 cases (5-fold: each fold's "
        "cases answered by the schema of each question's best wording on the other folds).")
    not_yet = dataclasses.replace(result, best=dataclasses.replace(result.best, heldout_accuracy=Metric(None)))
    assert "held-out accuracy is measured when every case is done" in sv.best_text(not_yet)
    assert sv.metric_text(Metric(None)) == "–"

    base_wins = dataclasses.replace(result, best=dataclasses.replace(result.best, schema=BASE,
                                                                     choices={"team": "base", "urgent": "base"}))
    assert sv.best_text(base_wins) == ("**Composed best schema**: the base as it is (`team` from “base”, `urgent` "
                                       "from “base”); nothing to adopt from it.")
    assert list(sv.adoption_choices(base_wins)) == ["no_instructions:urgent", "written:team"]


def test_a_variants_flipped_cases_open_in_decide_with_its_questions(store, library):
    set_id = store.create_case_set("Tickets")
    case_ids = store.add_cases(set_id, [
        {"state": "Charged twice\nfor March", "expected": {"team": "billing", "urgent": True}},
        {"state": {"subject": "App crashes"}, "expected": {"team": "tech"}},
        {"state": "Hello", "expected": {"urgent": False}}])
    result = result_of(case_ids)
    flips = sv.flipped_cases(store, result, "reversed:team")
    assert flips.to_dict("records") == [
        {"case": case_ids[0], "question": "team", "expected": "billing", "state": "Charged twice",
         "decide": f"/?sweep=7&variant=reversed%3Ateam&case={case_ids[0]}"},
        {"case": case_ids[1], "question": "team", "expected": "tech", "state": '{"subject": "App crashes"}',
         "decide": f"/?sweep=7&variant=reversed%3Ateam&case={case_ids[1]}"}]
    assert sv.flipped_cases(store, result, "base").empty


# -- adopt ---------------------------------------------------------------------------------------------------------


def test_adopt_asks_then_writes_a_version_whose_history_names_the_sweep_and_undo_restores(store, library):
    before = library.load(SLUG)
    result = result_of([1, 2, 3])
    choices = sv.adoption_choices(result)
    # the better ones first; never an order diagnostic, whose option ids are renamed to set the order
    assert list(choices) == [sv.BEST, "no_instructions:urgent", "written:team"]
    assert choices[sv.BEST] == "Composed best schema (held-out accuracy 0.780 [0.690, 0.860])"
    assert sv.adopt_question(library, result, sv.BEST) == (
        f"The composed best schema becomes version 2 of {SLUG}.json, its history naming sweep #7 and its figures. "
        "The library's support-ticket-routing.json is at version 1 now; the sweep ran version 2. You can undo this.")

    adopted, message = sv.adopt(library, result, sv.BEST)
    assert message == f"Adopted as version 2 of {SLUG}.json (Schemas page → History)."
    assert adopted == sv.Adopted(SLUG, 2, 1)
    now = library.load(SLUG)
    assert now.questions == PLAIN["questions"]  # the sweep's questions ...
    assert (now.name, now.description, now.examples) == (before.name, before.description, before.examples)
    latest = store.list_schema_versions(SLUG)[0]
    assert (latest["number"], latest["action"]) == (2, "adopt")
    assert latest["note"] == ("sweep #7 (Tickets, 40 cases, clef-demo): composed best schema, held-out accuracy "
                              "0.780 [0.690, 0.860] vs base 0.700 [0.600, 0.800] (5-fold)")

    assert sv.adopt(library, result, sv.BEST) == (
        None, f"Not adopted: version 2 of {SLUG}.json already has these questions.")
    assert sv.undo_adoption(library, adopted) == (
        f"Undone: version 1 of {SLUG}.json is current again (as version 3).")
    assert library.load(SLUG).questions == before.questions
    assert [(v["number"], v["action"]) for v in store.list_schema_versions(SLUG)] == [
        (3, "restore"), (2, "adopt"), (1, "on disk")]
    assert store.list_schema_versions(SLUG)[0]["note"] == "undid the adoption of version 2: version 1 restored"

    variant, _ = sv.adopt(library, result, "written:team")
    assert variant is not None and library.load(SLUG).questions["team"]["instructions"] == "Which queue owns it?"
    assert store.list_schema_versions(SLUG)[0]["note"] == (
        "sweep #7 (Tickets, 40 cases, clef-demo): variant “written:team”, accuracy 0.720 [0.620, 0.810], change "
        "vs base +0.020 [-0.030, +0.070] (no clear difference)")


def test_adopt_into_a_schema_deleted_since_says_so_and_writes_nothing(store, library):
    library.delete(SLUG)
    assert sv.adopt(library, result_of([1, 2, 3]), sv.BEST) == (
        None, f"Not adopted: the library has no schema {SLUG!r} any more (deleted or renamed); restore it on the "
              "Schemas page first.")
    assert not library.exists(SLUG)
    assert json.dumps(store.list_schema_versions(SLUG)[0]["schema"]["questions"]) != json.dumps(PLAIN["questions"])


# -- a real sweep on the tiny release -------------------------------------------------------------------------------


def test_a_sweep_starts_in_the_background_resumes_and_its_cases_open_in_decide(store, library, tiny_engine):
    set_id = store.create_case_set("Tickets", schema_name=SLUG)
    case_ids = store.add_cases(set_id, [{"state": text, "expected": {"team": team}} for text, team in (
        ("I was charged twice for March.", "billing"), ("The app crashes when I open settings.", "technical_support"),
        ("Someone logged into my account from Brazil.", "account_security"), ("Hello", "none_of_these"))])
    schema, problem = sv.library_schema(library, SLUG)
    assert problem is None and "examples" not in schema
    worded, _ = sv.written_alternative("team", schema["questions"]["team"], "Which queue owns this ticket?",
                                       sv.alternative_editor(schema["questions"]["team"]).options)
    variants, line = sv.planned_variants(schema, ["no_instructions"], [("team", worded), ("team", worded)])
    assert [v.name for v in variants] == ["base", *(f"no_instructions:{q}" for q in schema["questions"]),
                                          "written:team", "written 2:team"]
    assert line == f"{len(variants)} variants, the base included, on every labelled case." and sv.can_start(variants)
    assert sv.planned_variants(schema, [], [])[1] == (
        "Tick an automatic variant or write an alternative: the base alone is no sweep.")
    gone = sv.planned_variants(schema, ["no_instructions"], [("moved", worded)])  # the question was renamed since
    assert gone == ([sweeps.base_variant(schema)], "Remove the alternatives that no longer fit the schema: your "
                    "alternatives: entry 1 ('written:moved'), field \"questions\": 'moved' not in the base schema "
                    f"(its questions: {', '.join(schema['questions'])})")
    assert not sv.can_start(gone[0])

    runner = SweepRunner(store)
    sweep_id, message = sv.start_sweep(store, runner, tiny_engine, "tiny", set_id, SLUG, variants, folds=2)
    assert message == f"Started sweep #{sweep_id}: {len(variants)} variants."
    assert runner.wait(sweep_id, timeout=600)
    shown = sv.progress_shown(runner, sv.sweep_row(store, sweep_id))
    assert shown == sv.ProgressShown(1.0, "4 / 4 cases · status **finished**", False, None)
    result = sweeps.load_sweep(store, sweep_id, threshold=0.1)
    assert result.settings["schema_slug"] == SLUG and result.state_prefills == 4
    assert sv.leaderboard_caption(result).startswith(
        f"4 of 4 labelled cases of “Tickets” on tiny, 4 state(s) prefilled for {len(variants)} variants.")

    # a sweep that stopped before its cases were done (here: never started) says so, and resumes with them
    stopped = sweeps.start_sweep(store, set_id, schema, variants[:2], model_id="tiny", folds=2,
                                 settings={"schema_slug": SLUG})
    shown = sv.progress_shown(runner, sv.sweep_row(store, stopped))
    assert (shown.text, shown.live) == ("0 / 4 cases · status **pending**", False)
    assert shown.problem == (f"Sweep #{stopped} stopped with 4 of 4 cases left (cancelled, or the workbench stopped "
                             "while it ran): resume it to compute only those.")
    models = SimpleNamespace(get={"tiny": tiny_engine}.__getitem__)  # as ModelManager.get: KeyError when not loaded
    assert sv.resume_sweep(runner, models, {"id": stopped, "model_id": "gone"})[0] == "error"
    assert sv.resume_sweep(runner, models, sv.sweep_row(store, stopped)) == ("info", f"Resumed sweep #{stopped}.")
    assert runner.wait(stopped, timeout=600)
    assert sv.progress_shown(runner, sv.sweep_row(store, stopped)).text == "4 / 4 cases · status **finished**"

    # a case of the sweep opens in Decide with the variant's questions
    url = links.sweep_decide_url(sweep_id, "written:team", case_ids[0])
    params = dict(parse_qsl(url.removeprefix("/?")))
    draft, note = links.sweep_case_draft(store, library, *links.linked_sweep_case(params))
    assert note == (f"Case #{case_ids[0]} of sweep #{sweep_id} (Tickets) with the questions of its variant "
                    "“written:team”: Run asks them again.")
    assert draft["state_text"] == "I was charged twice for March."
    assert [row["instructions"] for row in draft["rows"]][0] == "Which queue owns this ticket?"
    assert draft["loaded_slug"] is None  # not the library's questions: saving cannot overwrite the schema
    assert links.sweep_case_draft(store, library, sweep_id, "base", case_ids[0])[0]["loaded_slug"] == SLUG
    assert links.sweep_case_draft(store, library, sweep_id, "nope", case_ids[0]) == (
        None, f"Sweep #{sweep_id} has no variant “nope”.")


def test_the_page_scores_a_sweep_again_only_when_what_is_stored_changes(store, library, monkeypatch):
    """Scoring takes seconds (bootstrap intervals) and the page runs again at every click: the same stored sweep
    and threshold are scored once; a new threshold, status or sweep is scored anew."""
    one_question_schema(library)
    schema = library.load("ticket-team").to_dict()
    set_id = store.create_case_set("Tickets")
    store.add_cases(set_id, [{"state": f"ticket {i}", "expected": {"team": "billing"}} for i in range(4)])
    sweep_id = seeded_sweep(store, set_id, schema, "ticket-team")
    scored: list[int] = []
    load_sweep = sweeps.load_sweep
    monkeypatch.setattr(sweeps, "load_sweep", lambda *a, **k: scored.append(a[1]) or load_sweep(*a, **k))

    first = sv.scored_sweep(store, sweep_id, 0.1)
    assert sv.scored_sweep(store, sweep_id, 0.1) is first and scored == [sweep_id]
    assert sweeps.leaderboard(first).equals(sweeps.leaderboard(load_sweep(store, sweep_id, threshold=0.1)))
    sv.scored_sweep(store, sweep_id, 0.3)
    assert scored == [sweep_id, sweep_id]
    store.set_sweep_status(sweep_id, "cancelled")
    assert sv.scored_sweep(store, sweep_id, 0.1).status == "cancelled" and len(scored) == 3
    other = seeded_sweep(store, set_id, schema, "ticket-team")
    assert sv.scored_sweep(store, other, 0.1).id == other and scored[-1] == other
