"""What the Sweeps page shows and does, without Streamlit; the sweep itself is clef_workbench.sweeps'."""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import Any

import pandas as pd

from clef_workbench import sweeps
from clef_workbench.casesets import plain_label, state_text
from clef_workbench.jobs import JobAlreadyRunningError
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema, SchemaError
from clef_workbench.sweep_runner import SweepRunner
from workbench_ui import links, schema_rows, units

_SCORING = threading.Lock()  # sessions run on threads of their own: one scores, the others reuse its result


def scored_sweep(store: Any, sweep_id: int, threshold: float) -> sweeps.SweepResult:
    """`sweeps.load_sweep`, scored again only when its answers change (the bootstrap takes seconds)."""
    sweep = store.get_sweep(sweep_id)
    with _SCORING:
        return _scored(store, sweep_id, threshold, (sweep["created_at"], sweep["status"],
                                                    store.count_sweep_answers(sweep_id)))


@functools.lru_cache(maxsize=8)
def _scored(store: Any, sweep_id: int, threshold: float, version: tuple) -> sweeps.SweepResult:
    return sweeps.load_sweep(store, sweep_id, threshold=threshold)


@dataclass(frozen=True)
class AlternativeEditor:
    """A question's editor text for an alternative: its instructions, and its options as text."""

    instructions: str
    options: str
    options_help: str


def alternative_editor(question: dict[str, Any]) -> AlternativeEditor:
    row = schema_rows.question_to_row("q", question)
    if row["type"] == "score":
        return AlternativeEditor(row["instructions"], schema_rows.levels_to_text(row["levels"]),
                                 "One level per line, the lowest first.")
    if row["type"] == "choice":
        return AlternativeEditor(row["instructions"], schema_rows.options_to_text(row["options"]),
                                 "One option per line: `id: description` (or just `id`). Add, remove or reword "
                                 "options; the model reads them sorted by id, whatever their order here.")
    sides = [{"id": side, "description": row[side]} for side in ("true", "false") if row[side]]
    return AlternativeEditor(row["instructions"], schema_rows.options_to_text(sides),
                             "What `true` and `false` mean, `true: …` and `false: …`, or nothing.")


def written_alternative(question_id: str, question: dict[str, Any], instructions: str,
                        options: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The alternative written for `question`, or None with what is wrong (the question as it is is no alternative)."""
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
    if errors := [p.msg for p in problems if p.severity == "error"]:
        return None, errors
    written = questions[question_id]
    if written == schema_rows.row_to_question(schema_rows.question_to_row(question_id, question)):
        return None, [f'question "{question_id}": the alternative is the question as it is; change its '
                      "instructions or options"]
    return written, []


AUTO_KIND_LABELS = {
    "no_descriptions": "Each option's description removed",
    "no_instructions": "The instructions removed",
    "reversed": "The options in reversed order",
    "shuffled": "The options in shuffled order",
    "unknown_added": "An “unknown” option added",
    "unknown_removed": "The “unknown” option removed",
}


def written_variants(schema: dict[str, Any], written: list[tuple[str, dict[str, Any]]]) -> list[sweeps.Variant]:
    """The alternatives as variants of `schema`, named "written:QUESTION" ("written 2:…" for a second)."""
    entries, numbers = [], {}
    for question_id, question in written:
        numbers[question_id] = numbers.get(question_id, 0) + 1
        number = "" if numbers[question_id] == 1 else f" {numbers[question_id]}"
        entries.append({"name": f"written{number}:{question_id}", "questions": {question_id: question}})
    return sweeps.variants_from_json(json.dumps(entries), schema, source="your alternatives") if entries else []


def planned_variants(schema: dict[str, Any], kinds: list[str],
                     written: list[tuple[str, dict[str, Any]]]) -> tuple[list[sweeps.Variant], str]:
    """The variants a sweep would score (the base first), and how many or why it cannot start."""
    try:
        variants = [sweeps.base_variant(schema), *sweeps.auto_variants(schema, kinds),
                    *written_variants(schema, written)]
    except sweeps.SweepError as exc:
        return [sweeps.base_variant(schema)], f"Remove the alternatives that no longer fit the schema: {exc}"
    if len(variants) > sweeps.MAX_VARIANTS:
        return variants, (f"{len(variants)} variants, the base included: a sweep holds at most "
                          f"{sweeps.MAX_VARIANTS}. Untick a kind or remove alternatives.")
    if len(variants) == 1:
        return variants, "Tick an automatic variant or write an alternative: the base alone is no sweep."
    return variants, f"{len(variants)} variants, the base included, on every labelled case."


def can_start(variants: list[sweeps.Variant]) -> bool:
    return 1 < len(variants) <= sweeps.MAX_VARIANTS


def start_sweep(store: Any, runner: SweepRunner, engine: Any, model_id: str, case_set_id: int, slug: str,
                variants: list[sweeps.Variant], *, folds: int) -> tuple[int | None, str]:
    base = variants[0].schema
    info = engine.info()
    settings = {"schema_slug": slug, "schema_version": base.get("version"), "device": info.get("device"),
                "precision": info.get("precision"), "dtype": info.get("dtype")}
    try:
        sweep_id = sweeps.start_sweep(store, case_set_id, base, variants, model_id=model_id,
                                      model_revision=info.get("revision"), settings=settings, folds=folds)
    except sweeps.SweepError as exc:
        return None, f"Not started: {exc}"
    runner.start(sweep_id, engine)
    return sweep_id, f"Started sweep #{sweep_id}: {len(variants)} variants."


def library_schema(library: SchemaLibrary, slug: str) -> tuple[dict[str, Any] | None, str | None]:
    """The library schema a sweep starts from (without examples), or why it does not load."""
    try:
        schema = library.load(slug).to_dict()
    except SchemaError as exc:
        return None, f"{slug}.json does not load: {exc}"
    schema.pop("examples", None)
    return schema, None


def sweep_row(store: Any, sweep_id: int) -> dict[str, Any]:
    return next(s for s in sweeps.list_sweeps(store) if s["id"] == sweep_id)


def sweep_label(sweep: dict[str, Any]) -> str:
    return (f"#{sweep['id']} {sweep['case_set_name']} · {sweep['schema_name']} · {sweep['variants']} variants · "
            f"{sweep['model_id']} · {sweep['status']}")


@dataclass(frozen=True)
class ProgressShown:
    fraction: float
    text: str  # "12 / 40 cases · 2.10 cases/s · ETA 14.3 s"
    live: bool  # a thread of this process works on it: the page follows it
    problem: str | None  # what stopped it, or that it was interrupted and can be resumed


def progress_shown(runner: SweepRunner, sweep: dict[str, Any]) -> ProgressShown:
    """Where a sweep (a list_sweeps row) stands: the live numbers of the thread running it here, if one does."""
    thread = runner.live(sweep["id"])
    running_here = runner.is_running(sweep["id"])
    live = thread.progress if thread and running_here else None
    done, total = (live.done, live.total) if live else (sweep["done"], sweep["total"])
    text = f"{done} / {total} cases · status **{'running' if running_here else sweep['status']}**"
    if running_here:
        rate = f"{live.rate_per_s:.2f} cases/s" if live and live.rate_per_s else "measuring…"
        eta = units.duration(live.eta_s * 1000) if live and live.eta_s is not None else "after the first case"
        text += f" · {rate} · ETA {eta}"
    problem = thread.error if thread and not running_here else None
    if problem is None and not running_here and sweep["status"] in ("running", "pending", "cancelled"):
        problem = (f"Sweep #{sweep['id']} stopped with {total - done} of {total} cases left (cancelled, or the "
                   "workbench stopped while it ran): resume it to compute only those.")
    return ProgressShown(done / max(total, 1), text, running_here, problem)


def resume_sweep(runner: SweepRunner, models: Any, sweep: dict[str, Any]) -> tuple[str, str]:
    """Resume a stopped sweep on the model it started on: the message's kind and text."""
    try:
        engine = models.get(sweep["model_id"])
    except KeyError:
        return "error", (f"Sweep #{sweep['id']} was started on the model {sweep['model_id']!r}, which is not loaded: "
                         "add it in the sidebar (Add a model), then resume.")
    try:
        runner.start(sweep["id"], engine)
    except JobAlreadyRunningError as exc:
        return "info", str(exc)
    return "info", f"Resumed sweep #{sweep['id']}."


def leaderboard_caption(result: sweeps.SweepResult) -> str:
    return (f"{result.done} of {result.cases} labelled cases of “{result.case_set_name}” on {result.model_id}, "
            f"{result.state_prefills} state(s) prefilled for {len(result.variants)} variants. Accuracy with its 95 % "
            "bootstrap interval over cases; a variant is better or worse than the base only when the paired "
            "interval of the change excludes zero.")


def metric_text(metric: sweeps.Metric, *, signed: bool = False) -> str:
    """"0.820 [0.710, 0.900]"; "–" where there is nothing to measure."""
    if metric.value is None:
        return "–"
    number = "{:+.3f}" if signed else "{:.3f}"
    interval = ("" if metric.low is None or metric.high is None
                else f" [{number.format(metric.low)}, {number.format(metric.high)}]")
    return number.format(metric.value) + interval


def chart_frame(result: sweeps.SweepResult) -> pd.DataFrame:
    rows = []
    for score in result.variants:
        scopes = [("overall", score.accuracy, score.accuracy_change)] + [
            (qid, q.accuracy, q.accuracy_change) for qid, q in score.questions.items()]
        for scope, accuracy, change in scopes:
            if accuracy.value is not None:
                rows.append({"variant": score.variant.name, "scope": scope, "accuracy": accuracy.value,
                             "low": accuracy.low, "high": accuracy.high,
                             "against the base": better_text(score.variant, change)})
    return pd.DataFrame(rows, columns=["variant", "scope", "accuracy", "low", "high", "against the base"])


def better_text(variant: sweeps.Variant, change: sweeps.Metric) -> str:
    """How a variant compares with the base: better or worse only when the change's interval excludes zero."""
    if variant.kind == "base":
        return "base"
    if change.low is not None and change.low > 0:
        return "better"
    if change.high is not None and change.high < 0:
        return "worse"
    return "no clear difference"


def leaderboard_table(result: sweeps.SweepResult) -> pd.DataFrame:
    """One row per variant, best accuracy first, with its change against the base."""
    questions = list(result.base_schema["questions"])
    rows = []
    for name in sweeps.leaderboard(result)["variant"]:
        score = variant_score(result, name)
        rows.append({"variant": score.variant.name, "kind": score.variant.kind,
                     "accuracy": metric_text(score.accuracy),
                     "change vs base": "" if score.variant.kind == "base" else metric_text(score.accuracy_change,
                                                                                           signed=True),
                     "against the base": better_text(score.variant, score.accuracy_change),
                     "flipped cases": len(score.flips_vs_base),
                     "order sensitivity": ("" if score.order_sensitivity is None
                                           else f"{score.order_sensitivity:.0%}"),
                     **{qid: metric_text(score.questions[qid].accuracy) if qid in score.questions else "–"
                        for qid in questions}})
    return pd.DataFrame(rows)


def order_sensitivity_lines(result: sweeps.SweepResult) -> list[tuple[bool, str]]:
    """Per question with an order-only variant: (flagged, its line)."""
    limit = "" if result.threshold is None else f" (threshold {result.threshold:.0%})"
    return [(qid in result.flagged, f"`{qid}`: {share:.0%} of cases change their answer when only the options' "
                                    f"order changes" + (f" — above the threshold{limit}" if qid in result.flagged
                                                        else ""))
            for qid, share in result.order_sensitivity.items()]


def best_text(result: sweeps.SweepResult) -> str | None:
    """The composed best schema: what each question takes and how it scores on cases its choice did not see."""
    best = result.best
    if best is None:
        return None
    choices = ", ".join(f"`{qid}` from “{name}”" for qid, name in best.choices.items())
    if not composed_differs(result):
        return f"**Composed best schema**: the base as it is ({choices}); nothing to adopt from it."
    if best.heldout_accuracy.value is None:
        return (f"**Composed best schema** ({choices}): its held-out accuracy is measured when every case is done "
                f"({best.folds}-fold: each fold's cases answered by the schema composed on the other folds).")
    return (f"**Composed best schema** ({choices}): held-out accuracy {metric_text(best.heldout_accuracy)} against "
            f"the base's {metric_text(best.base_heldout_accuracy)} on the same {best.cases} cases ({best.folds}-fold: "
            "each fold's cases answered by the schema of each question's best wording on the other folds).")


def variant_score(result: sweeps.SweepResult, name: str) -> sweeps.VariantScore:
    return next(score for score in result.variants if score.variant.name == name)


def flipped_cases(store: Any, result: sweeps.SweepResult, name: str) -> pd.DataFrame:
    """The cases where variant `name` answers otherwise than the base, with a link to open each in Decide."""
    score = variant_score(result, name)
    rows = []
    for qid, question in score.questions.items():
        for case_id in question.flips:
            case = store.get_case(case_id, with_media=False)
            rows.append({"case": case_id, "question": qid,
                         "expected": plain_label(case["expected"].get(qid)) if qid in case["expected"] else "",
                         "state": state_text(case["state"]).strip().splitlines()[0][:120] if case["state"] else "",
                         "decide": links.sweep_decide_url(result.id, name, case_id)})
    return pd.DataFrame(rows, columns=["case", "question", "expected", "state", "decide"])


def review_params(store: Any, result: sweeps.SweepResult, name: str, case_id: int, question: str) -> dict[str, str]:
    """Review's query parameters for a flipped case, its variant's answers as a run (made on first use)."""
    return {"run": str(sweeps.variant_run(store, result.id, name)), "case": str(case_id), "question": question}


BEST = "best"  # the adoption choice of the composed best schema


def composed_differs(result: sweeps.SweepResult) -> bool:
    return result.best is not None and result.best.schema["questions"] != result.base_schema["questions"]


def adoption_choices(result: sweeps.SweepResult) -> dict[str, str]:
    """What can be adopted: the composed best, then the variants (not the order diagnostics)."""
    choices = {}
    if composed_differs(result):
        choices[BEST] = f"Composed best schema (held-out accuracy {metric_text(result.best.heldout_accuracy)})"
    scores = sorted((s for s in result.variants if s.variant.kind not in ("base", *sweeps.NOT_CANDIDATES)),
                    key=lambda s: (better_text(s.variant, s.accuracy_change) != "better", -(s.accuracy.value or 0)))
    for score in scores:
        choices[score.variant.name] = (f"{score.variant.name} (accuracy {metric_text(score.accuracy)}, "
                                       f"{better_text(score.variant, score.accuracy_change)})")
    return choices


def adopted_questions(result: sweeps.SweepResult, choice: str) -> dict[str, Any]:
    if choice == BEST and result.best is not None:
        return result.best.schema["questions"]
    return variant_score(result, choice).variant.schema["questions"]


def adoption_note(result: sweeps.SweepResult, choice: str) -> str:
    """What the new version's history says: the sweep, and the figures the choice was made on."""
    where = f"sweep #{result.id} ({result.case_set_name}, {result.cases} cases, {result.model_id})"
    if choice == BEST and result.best is not None:
        return (f"{where}: composed best schema, held-out accuracy {metric_text(result.best.heldout_accuracy)} vs "
                f"base {metric_text(result.best.base_heldout_accuracy)} ({result.best.folds}-fold)")
    score = variant_score(result, choice)
    return (f"{where}: variant “{choice}”, accuracy {metric_text(score.accuracy)}, change vs base "
            f"{metric_text(score.accuracy_change, signed=True)} ({better_text(score.variant, score.accuracy_change)})")


def adopt_question(library: SchemaLibrary, result: sweeps.SweepResult, choice: str) -> str:
    slug = result.settings.get("schema_slug")
    current = library.load(slug).version if slug and library.exists(slug) else None
    what = "The composed best schema" if choice == BEST else f"Variant “{choice}”"
    ran = result.settings.get("schema_version")
    changed = (f" The library's {slug}.json is at version {current} now; the sweep ran version {ran}." if ran
               and current is not None and current != ran else "")
    return (f"{what} becomes version {(current or 0) + 1} of {slug}.json, its history naming sweep "
            f"#{result.id} and its figures.{changed} You can undo this.")


@dataclass(frozen=True)
class Adopted:
    slug: str
    number: int  # the version adoption wrote
    previous: int  # the version it replaced: Undo restores it


def adopt(library: SchemaLibrary, result: sweeps.SweepResult, choice: str) -> tuple[Adopted | None, str]:
    """Make the chosen schema the library schema's new version; what was done (None and why not)."""
    slug = result.settings.get("schema_slug")
    if not slug or not library.exists(slug):
        return None, (f"Not adopted: the library has no schema {slug!r} any more (deleted or renamed); restore it "
                      "on the Schemas page first.")
    try:
        current = library.load(slug)
        candidate = Schema(name=current.name, questions=adopted_questions(result, choice), version=current.version,
                           description=current.description, examples=current.examples)
        saved = library.update(slug, candidate, action="adopt", note=adoption_note(result, choice))
    except SchemaError as exc:
        return None, f"Not adopted: {exc}"
    if saved.version == current.version:
        return None, f"Not adopted: version {current.version} of {slug}.json already has these questions."
    return Adopted(slug, saved.version, current.version), (
        f"Adopted as version {saved.version} of {slug}.json (Schemas page → History).")


def undo_adoption(library: SchemaLibrary, adopted: Adopted) -> str:
    """Undo an adoption: the version it replaced becomes the current one again, as a new version (nothing lost)."""
    try:
        restored = library.restore(adopted.slug, adopted.previous,
                                   note=f"undid the adoption of version {adopted.number}: version {adopted.previous} "
                                        "restored")
    except SchemaError as exc:
        return f"Not undone: {exc}"
    return (f"Undone: version {adopted.previous} of {adopted.slug}.json is current again (as version "
            f"{restored.version}).")
