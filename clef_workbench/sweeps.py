"""Schema sweeps: many versions of a schema scored on a labelled case set at the cost of one state per case.
docs/workbench.md "Schema sweeps" says what a sweep builds, scores and stores; the choices behind the code:

- intervals are percentile bootstraps over cases (`stats.bootstrap_interval`, seeded), and the predicted answer,
  confidence and ECE are `stats.py`'s, so the numbers match a run's;
- the model reads a choice question's options sorted by id (the caller's order never reaches it), so an order is
  imposed by numbering the ids (`o01_billing`, …); answers are mapped back to the base's ids before scoring;
- the held-out check runs the composed schemas (`best`) rather than inferring them from the variants' answers,
  since the joint head reads every question;
- execution is case-major (`run_sweep`): one worker call per case continues every variant from its state
  (`Engine.decide_variants`), and each case's answers are stored in one transaction, so a killed sweep resumes
  without computing a finished case again.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import pandas as pd
from scipy.stats import binomtest

from clef_workbench import stats
from clef_workbench.casesets import build_request
from clef_workbench.schemas import Schema, SchemaError, way_out_options
from clef_workbench.stats import bootstrap_interval, ece_statistic, mean
from clef_workbench.store import Answered, Response, RunSettings, Store, Sweep, SweepAnswer, SweepVariant

MAX_VARIANTS = 64  # a sweep's variants, the base included
HELDOUT_CASES_PER_CALL = 32  # a held-out check's cases, one request each, decided together: one pack, not 32
DEFAULT_FOLDS = 5
DEFAULT_SEED = 0
ECE_BINS = 10
LOG_LOSS_FLOOR = 5e-5  # stored probabilities are rounded to 4 decimals: a 0 was below half of the last digit
AUTO_KINDS = ("no_descriptions", "no_instructions", "reversed", "shuffled", "unknown_added", "unknown_removed")
ORDER_KINDS = ("reversed", "shuffled")  # the options' order only: compared with the "relabelled" variant
VARIANT_KINDS = ("base", *AUTO_KINDS, "relabelled", "custom")
NOT_CANDIDATES = ("relabelled", *ORDER_KINDS)  # diagnostics: their option ids are numbered, not the analyst's
UNKNOWN_OPTION = ("unknown", "None of the other options fits, or the state does not say.")


class SweepError(ValueError):
    """A sweep cannot be built or started as asked; the message says what and where."""


@dataclass(frozen=True)
class Variant:
    """One version of the schema a sweep scores. `schema` is a whole schema dict (name, version, questions);
    `kind` one of VARIANT_KINDS; `question` the question it changes (None for the base, or a custom variant that
    changes several). `relabel`: per question whose option ids it renamed, {its id: the base's id}."""

    name: str
    schema: dict[str, Any]
    kind: str
    question: str | None = None
    relabel: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Metric:
    """A number with its 95% bootstrap interval; None where there is nothing to measure (no labelled answers)."""

    value: float | None
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class QuestionScore:
    """One variant's answers to one question against the gold labels, and against the base schema's answers."""

    question: str
    n: int  # cases with a gold label for the question and an answer from the variant and the base
    accuracy: Metric
    macro_f1: Metric
    log_loss: Metric
    ece: Metric
    flips: list[int]  # case ids whose predicted answer differs from the base's
    accuracy_change: Metric  # variant − base, paired bootstrap over the same cases
    mcnemar_p: float | None  # exact McNemar (two-sided) on right/wrong vs the base; None for the base itself
    better: bool  # accuracy_change's interval lies entirely above zero


@dataclass(frozen=True)
class VariantScore:
    """A variant's scores: per question, and overall (every labelled answer pooled; the interval resamples cases)."""

    variant: Variant
    accuracy: Metric
    accuracy_change: Metric
    questions: dict[str, QuestionScore]
    flips_vs_base: list[int]  # case ids where any question's answer differs from the base's
    order_sensitivity: float | None  # order variants: share of cases whose answer to `question` changed; else None

    @property
    def better(self) -> bool:
        return self.accuracy_change.low is not None and self.accuracy_change.low > 0


@dataclass(frozen=True)
class BestSchema:
    """The composed best schema and what it scores where it was not chosen.

    `schema`: each question worded as the variant best on all cases words it (`choices`: that variant's name).
    `heldout_accuracy`: per fold, the schema composed of each question's best wording on the other folds, run on
    this fold's cases (after every case of the sweep is done), pooled over folds, with a bootstrap interval over
    cases; None until it has run. `base_heldout_accuracy`: the base on the same cases, for comparison."""

    schema: dict[str, Any]
    choices: dict[str, str]
    folds: int
    heldout_accuracy: Metric
    base_heldout_accuracy: Metric
    cases: int  # the held-out cases the composed schemas answered
    state_prefills: int  # states prefilled for them (those still in the state cache are continued)


@dataclass(frozen=True)
class SweepProgress:
    """Where a sweep stands; rate and ETA are None until measured."""

    sweep_id: int
    done: int
    total: int
    status: str
    computed: int = 0  # cases computed by this call of run_sweep
    rate_per_s: float | None = None
    eta_s: float | None = None
    state_prefills: int = 0


@dataclass(frozen=True)
class SweepResult:
    """A stored sweep and its scores (`load_sweep`). `variants[0]` is the base. `order_sensitivity`: per question,
    the share of cases whose answer changes under an order-only variant (questions without one are absent);
    `flagged`: the questions above `threshold`."""

    id: int
    status: str
    case_set_id: int
    case_set_name: str
    base_schema: dict[str, Any]
    model_id: str
    settings: dict[str, Any]
    created_at: str
    cases: int  # labelled cases in the sweep
    done: int  # cases with an answer for every variant
    state_prefills: int  # states prefilled for the done cases' answers and the held-out check's
    variants: list[VariantScore]
    order_sensitivity: dict[str, float]
    threshold: float | None
    flagged: list[str]
    best: BestSchema | None
    errors: list[dict[str, Any]] = field(default_factory=list)  # {case_id, variant, error} of failed answers

    def to_json(self) -> dict[str, Any]:
        """The CLI's --json document (docs/workbench.md "Schema sweeps")."""
        def metric(name: str, value: Metric, ci: str | None = None) -> dict[str, Any]:
            return {name: value.value, ci or f"{name}_ci": [value.low, value.high]}

        variants = []
        for score in self.variants:
            variant = score.variant
            variants.append({
                "name": variant.name, "kind": variant.kind, "question": variant.question,
                **metric("accuracy", score.accuracy), **metric("accuracy_change", score.accuracy_change),
                "better": score.better, "flips_vs_base": score.flips_vs_base,
                "order_sensitivity": score.order_sensitivity,
                "questions": {q: {"n": s.n, **metric("accuracy", s.accuracy), **metric("macro_f1", s.macro_f1),
                                  **metric("log_loss", s.log_loss), **metric("ece", s.ece),
                                  **metric("accuracy_change", s.accuracy_change), "mcnemar_p": s.mcnemar_p,
                                  "better": s.better, "flips": s.flips}
                              for q, s in score.questions.items()},
            })
        best = None
        if self.best is not None:
            best = {"schema": self.best.schema, "choices": self.best.choices, "folds": self.best.folds,
                    "heldout_cases": self.best.cases, "state_prefills": self.best.state_prefills,
                    **metric("heldout_accuracy", self.best.heldout_accuracy, "heldout_ci"),
                    **metric("base_heldout_accuracy", self.best.base_heldout_accuracy, "base_heldout_ci")}
        return {"sweep": self.id, "status": self.status, "case_set": self.case_set_name,
                "schema": self.base_schema.get("name"), "model": self.model_id,
                "precision": self.settings.get("precision"), "cases": self.cases, "done": self.done,
                "state_prefills": self.state_prefills, "variants": variants,
                "order_sensitivity": self.order_sensitivity, "order_threshold": self.threshold,
                "order_sensitive": self.flagged, "best": best, "errors": self.errors}


ProgressCallback = Callable[[SweepProgress], None]


def base_variant(schema: dict[str, Any]) -> Variant:
    return Variant("base", schema, "base", None)


def _numbered(order: list[str]) -> dict[str, str]:
    """{numbered id: base id} putting the options in `order` (the model reads them sorted by id)."""
    return {f"o{position:02d}_{option}": option for position, option in enumerate(order, 1)}


def _question_variants(question_id: str, question: dict[str, Any], kinds: Sequence[str],
                       rng: np.random.Generator) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(kind, changed question, relabel) of every kind that applies to the question."""
    out: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    criteria: Any = question.get("criteria")
    choice = question["type"] == "choice" and isinstance(criteria, dict)
    if "no_descriptions" in kinds:
        if choice and any(v is not None for v in criteria.values()):
            out.append(("no_descriptions", {**question, "criteria": dict.fromkeys(criteria)}, {}))
        elif question["type"] == "noul" and criteria is not None:
            out.append(("no_descriptions", {**question, "criteria": None}, {}))
    if "no_instructions" in kinds and question.get("instructions"):
        out.append(("no_instructions", {**question, "instructions": ""}, {}))
    if choice and len(criteria) >= 2 and any(kind in kinds for kind in ORDER_KINDS):
        model_order = sorted(criteria)
        orders = {"relabelled": model_order, "reversed": model_order[::-1]}
        if "shuffled" in kinds and len(criteria) >= 3:
            shuffled = list(model_order)
            while shuffled in (model_order, model_order[::-1]):
                shuffled = [model_order[i] for i in rng.permutation(len(model_order))]
            orders["shuffled"] = shuffled
        for kind, order in orders.items():
            if kind == "relabelled" or kind in kinds:
                relabel = _numbered(order)
                out.append((kind, {**question, "criteria": {new: criteria[old] for new, old in relabel.items()}},
                            relabel))
    if choice:
        way_out = way_out_options(criteria)
        if "unknown_added" in kinds and not way_out and UNKNOWN_OPTION[0] not in criteria:
            out.append(("unknown_added", {**question, "criteria": {**criteria, UNKNOWN_OPTION[0]: UNKNOWN_OPTION[1]}},
                        {}))
        if "unknown_removed" in kinds and way_out and len(criteria) - len(way_out) >= 2:
            kept = {k: v for k, v in criteria.items() if k not in way_out}
            out.append(("unknown_removed", {**question, "criteria": kept}, {}))
    return out


def auto_variants(schema: dict[str, Any], kinds: Sequence[str] = AUTO_KINDS, *,
                  seed: int = DEFAULT_SEED) -> list[Variant]:
    """The automatic variants of `schema` of the given kinds, one per question where the kind applies: option
    descriptions removed (choice, and noul with criteria), instructions removed (every question that has them),
    options reversed or shuffled (choice, with their "relabelled" control, see the module docstring; shuffled needs
    three options), "unknown" added where a choice question offers no way out and removed where one does. Shuffles
    are seeded. The base is not included. Names are "KIND:QUESTION"."""
    unknown = set(kinds) - set(AUTO_KINDS)
    if unknown:
        raise SweepError(f"unknown kind(s) of automatic variant: {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(AUTO_KINDS)})")
    rng = np.random.default_rng(seed)
    variants = []
    for question_id, question in schema["questions"].items():
        for kind, changed, relabel in _question_variants(question_id, question, kinds, rng):
            changed_schema = {**schema, "questions": {**schema["questions"], question_id: changed}}
            variants.append(Variant(f"{kind}:{question_id}", changed_schema, kind, question_id,
                                    {question_id: relabel} if relabel else {}))
    return variants


def changed_questions(schema: dict[str, Any], base: dict[str, Any]) -> list[str]:
    return [q for q in base["questions"] if schema["questions"].get(q) != base["questions"][q]]


def variants_from_json(text: str, base: dict[str, Any], *, source: str = "variants") -> list[Variant]:
    """The analyst's variants from a JSON document: a list of {"name", "questions"} (questions: a map of question
    id → question replacing the base's; the other questions keep the base's wording). Raises SweepError naming the
    entry and field of every problem."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SweepError(f"{source}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(entries, list) or not entries:
        raise SweepError(f'{source}: must hold a non-empty JSON list of {{"name", "questions"}} objects')
    problems, variants = [], []
    for number, entry in enumerate(entries, 1):
        where = f"{source}: entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].strip():
            problems.append(f'{where}: must be an object with a non-empty "name"')
            continue
        where += f" ({entry['name']!r})"
        questions = entry.get("questions")
        if not isinstance(questions, dict) or not questions:
            problems.append(f'{where}, field "questions": must map question ids of the base schema to questions')
            continue
        strange = [q for q in questions if q not in base["questions"]]
        if strange:
            problems.append(f'{where}, field "questions": {", ".join(map(repr, strange))} not in the base schema '
                            f"(its questions: {', '.join(base['questions'])})")
            continue
        schema = {**base, "questions": {q: questions.get(q, v) for q, v in base["questions"].items()}}
        try:
            Schema.from_dict(schema, source=where)
        except SchemaError as exc:
            problems.append(str(exc))
            continue
        retyped = [q for q in questions if questions[q].get("type") != base["questions"][q]["type"]]
        if retyped:
            problems.append(f'{where}, field "questions": {", ".join(map(repr, retyped))} changes the question type; '
                            "a sweep compares answers of the same type")
            continue
        changed = changed_questions(schema, base)
        variants.append(Variant(entry["name"].strip(), schema, "custom", changed[0] if len(changed) == 1 else None))
    if problems:
        raise SweepError("; ".join(problems))
    return variants


def check_sweep(store: Store, case_set_id: int, schema: dict[str, Any], variants: Sequence[Variant], *,
                folds: int = DEFAULT_FOLDS) -> tuple[list[Variant], list[int]]:
    """The variants a sweep would hold (the base first, added when `variants` lacks it) and the labelled case ids it
    would run; raises SweepError when the case set has no labelled case, a variant's schema is invalid or its
    question ids differ from the base's, names repeat, there are more than MAX_VARIANTS, or folds < 2."""
    if folds < 2:
        raise SweepError(f"folds must be at least 2 (got {folds}): the best variant is chosen on some cases and "
                         "scored on others")
    chosen = list(variants)
    if not chosen or chosen[0].kind != "base":
        chosen.insert(0, base_variant(schema))
    if len(chosen) > MAX_VARIANTS:
        raise SweepError(f"{len(chosen)} variants (the base included): a sweep holds at most {MAX_VARIANTS}; tick "
                         "fewer kinds of automatic variant or write fewer")
    names = [v.name for v in chosen]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SweepError(f"variant names must be unique: {', '.join(map(repr, repeated))} appear more than once")
    for variant in chosen:
        if list(variant.schema["questions"]) != list(schema["questions"]):
            raise SweepError(f"variant {variant.name!r}: its questions ({', '.join(variant.schema['questions'])}) "
                             f"must be the base's, in order ({', '.join(schema['questions'])})")
        try:
            Schema.from_dict(variant.schema, source=f"variant {variant.name!r}")
        except SchemaError as exc:
            raise SweepError(str(exc)) from None
    case_ids = [case["id"] for case in store.list_cases(case_set_id)
                if any((case["expected"] or {}).get(q) is not None for q in schema["questions"])]
    if not case_ids:
        name = store.get_case_set(case_set_id)["name"]
        raise SweepError(f"case set {name!r} has no case with an expected answer to a question of schema "
                         f"{schema.get('name')!r} ({', '.join(schema['questions'])}): label cases in Review, or "
                         "import them with a column expected_<question>")
    return chosen, case_ids


def start_sweep(store: Store, case_set_id: int, schema: dict[str, Any], variants: Sequence[Variant], *,
                model_id: str, model_revision: str | None = None, settings: dict[str, Any] | None = None,
                folds: int = DEFAULT_FOLDS) -> int:
    """Record a pending sweep of the case set's labelled cases (`check_sweep` says what is refused); its id.
    `settings`: what the answers depend on besides the schema (max_length, overflow, precision…)."""
    chosen, case_ids = check_sweep(store, case_set_id, schema, variants, folds=folds)
    return int(store.create_sweep(
        case_set_id, schema=schema, case_ids=case_ids, model_id=model_id, model_revision=model_revision,
        settings={**(settings or {}), "folds": folds},
        variants=[cast(SweepVariant, asdict(v)) for v in chosen]))


def _computed(store: Store, sweep: Sweep, case_ids: list[int], schemas: Callable[[int], list[dict[str, Any]]],
              engine: Any, stop: Callable[[], bool],
              cases_per_call: int = 1) -> Iterator[tuple[int, tuple[list[tuple[Any, str | None]], int]]]:
    """(case id, `distributed.decide_case`'s outcome for the case under `schemas(case id)`) of each case, in
    process (`cases_per_call` cases in one engine call), or on Ray's replicas when `engine` is a
    distributed.ReplicaPool (each replica doing all schemas of its cases)."""
    def requests(case_id: int) -> list[dict]:
        case = store.get_case(case_id)
        return [build_request(case, schema, model=sweep["model_id"]) for schema in schemas(case_id)]

    from clef_workbench.distributed import ReplicaPool, on_replicas

    if isinstance(engine, ReplicaPool):
        yield from on_replicas(engine, iter(case_ids), lambda actor, case_id: actor.decide_variants.remote(
            requests(case_id), sweep["settings"]), stop)
        return
    calls = [case_ids[start: start + cases_per_call] for start in range(0, len(case_ids), cases_per_call)]
    # two calls in flight: the next one is validated and encoded while the GPU runs this one (one after the
    # other, the GPU waited on the host between every two cases)
    in_flight: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="sweep-case") as pool:
        for call in calls:
            if stop():
                break
            in_flight.append(pool.submit(_decide_together, engine, [(c, requests(c)) for c in call],
                                         sweep["settings"]))
            if len(in_flight) == 2:
                yield from in_flight.popleft().result()
        for outcome in in_flight:
            yield from outcome.result()


def _decide_together(engine: Any, cases: list[tuple[int, list[dict]]],
                     settings: dict[str, Any]) -> list[tuple[int, tuple[list[tuple[Any, str | None]], int]]]:
    """`decide_case` of several cases' requests in one call (a held-out check's one request per case: their
    continuations run as packs, not one forward each), split back per case; each case alone again when the call
    answered none (a case over the token budget fails the whole call), so that its error is not the others'."""
    from clef_workbench.distributed import decide_case, state_prefills

    answers, _ = decide_case(engine, [request for _, requests in cases for request in requests], settings)
    if len(cases) > 1 and all(response is None for response, _ in answers):
        return [(case_id, decide_case(engine, requests, settings)) for case_id, requests in cases]
    outcomes, start = [], 0
    for case_id, requests in cases:
        mine, start = answers[start: start + len(requests)], start + len(requests)
        outcomes.append((case_id, (mine, state_prefills(mine))))
    return outcomes


def _run_heldout(store: Store, sweep_id: int, engine: Any, stop: Callable[[], bool]) -> tuple[int, bool]:
    """Run the held-out check of a sweep whose cases are all done: per fold, the schema composed of each question's
    best wording on the other folds (added as a "composed" variant once) answers this fold's cases, continuing
    their states; the cases last computed first, as their states are the likeliest to be in the state cache.
    Returns the states prefilled and whether every case has its answer."""
    sweep = store.get_sweep(sweep_id)
    own = [v for v in sweep["variants"] if v["kind"] != "composed"]
    frames = answer_frames({**sweep, "variants": own}, store.list_sweep_answers(sweep_id))
    if len(own) == len(sweep["variants"]):
        store.add_sweep_variants(sweep_id, _heldout_variants(sweep, frames))
        sweep = store.get_sweep(sweep_id)
    fold_of = _fold_of(sweep, frames[0])
    answers = store.list_sweep_answers(sweep_id)  # in the sweep's order of cases
    answered = {(a["case_id"], a["variant"]) for a in answers}
    position = {case_id: len(own) + fold for case_id, fold in fold_of.items()}
    left = [c for c in reversed(dict.fromkeys(a["case_id"] for a in answers)) if c in position
            and (c, position[c]) not in answered]
    prefills = computed = 0
    for case_id, (outcome, case_prefills) in _computed(
            store, sweep, left, lambda c: [sweep["variants"][position[c]]["schema"]], engine, stop,
            HELDOUT_CASES_PER_CALL):
        store.record_sweep_answers(sweep_id, case_id, [(position[case_id], *outcome[0])])
        prefills += case_prefills
        computed += 1
    return prefills, computed == len(left)


def run_sweep(store: Store, sweep_id: int, engine: Any, *, progress: ProgressCallback | None = None,
              stop: Callable[[], bool] | None = None) -> SweepProgress:
    """Compute the sweep's cases that have no answers yet, case-major (`_computed`), each case's answers stored in
    one transaction, so a kill loses at most the cases in flight and a later call resumes with the rest; then the
    held-out check (`_run_heldout`), resumable the same way. `progress` is called after each case; `stop()` true
    ends the sweep as cancelled after the cases in flight. Any other exception marks the sweep failed and is
    raised. Returns the final progress."""
    sweep = store.get_sweep(sweep_id)
    own = [v["schema"] for v in sweep["variants"] if v["kind"] != "composed"]
    left = store.sweep_cases_left(sweep_id)
    total, done = sweep["total"], sweep["total"] - len(left)
    store.set_sweep_status(sweep_id, "running")
    started, computed, prefills = time.monotonic(), 0, 0
    stopped = stop or (lambda: False)

    def report(status: str) -> SweepProgress:
        elapsed = time.monotonic() - started
        rate = computed / elapsed if computed and elapsed > 0 else None
        return SweepProgress(sweep_id, done + computed, total, status, computed, rate,
                             (len(left) - computed) / rate if rate else None, prefills)

    try:
        began = time.perf_counter()
        for case_id, (answers, case_prefills) in _computed(store, sweep, left, lambda _: own, engine, stopped):
            store.record_sweep_case(sweep_id, case_id, [(i, r, e) for i, (r, e) in enumerate(answers)],
                                    state_prefills=case_prefills, compute_ms=(time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            prefills += case_prefills
            computed += 1
            if progress is not None:
                progress(report("running"))
        finished = computed == len(left)
        if finished:
            heldout_prefills, finished = _run_heldout(store, sweep_id, engine, stopped)
            prefills += heldout_prefills
    except BaseException as exc:
        store.set_sweep_status(sweep_id, "failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    status = "finished" if finished else "cancelled"
    store.set_sweep_status(sweep_id, status)
    final = report(status)
    if progress is not None:
        progress(final)
    return final


def _to_base_ids(response: Response, relabel: dict[str, dict[str, str]]) -> Response:
    """A relabelled variant's response with its answers' option ids mapped back to the base's."""
    answers = dict(response.get("answers") or {})
    for question_id, names in relabel.items():
        answer = answers.get(question_id)
        if answer is not None:
            answers[question_id] = {**answer, "choice": names.get(answer["choice"], answer["choice"]),
                                    "probabilities": {names.get(k, k): p for k, p in answer["probabilities"].items()}}
    return {**response, "answers": answers}


def answer_frames(sweep: Sweep, answers: list[SweepAnswer]) -> list[pd.DataFrame]:
    """Per variant, `stats.answer_frame` of its answers in the base's terms (option ids mapped back), with
    `log_loss` (−ln of the gold option's probability, floored at LOG_LOSS_FLOOR) per labelled row."""
    frames = []
    for position, variant in enumerate(sweep["variants"]):
        results = [Answered(case_id=a["case_id"], position=a["position"], expected=a["expected"], error=a["error"],
                            response=_to_base_ids(a["response"], variant["relabel"]) if a["response"] else None,
                            latency_ms=None, input_tokens=None)
                   for a in answers if a["variant"] == position]
        frame = stats.answer_frame(results, sweep["schema"])
        frame["log_loss"] = [np.nan if e is None else -math.log(max(d.get(e, 0.0), LOG_LOSS_FLOOR))
                             for d, e in zip(frame["distribution"], frame["expected"], strict=True)]
        frames.append(frame)
    return frames


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return numerator.sum(axis=-1) / np.maximum(denominator.sum(axis=-1), 1)


def _macro_f1(classes: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """Macro-F1 over the last axis of class codes, averaged over the classes present in the gold or predicted
    answers (scikit-learn's `f1_score(average="macro")`)."""
    def macro_f1(gold: np.ndarray, predicted: np.ndarray) -> np.ndarray:
        total, present = np.zeros(gold.shape[:-1]), np.zeros(gold.shape[:-1])
        for code in range(classes):
            is_gold, is_predicted = gold == code, predicted == code
            hits = (is_gold & is_predicted).sum(axis=-1)
            denominator = is_gold.sum(axis=-1) + is_predicted.sum(axis=-1)
            total += np.where(denominator > 0, 2 * hits / np.maximum(denominator, 1), 0.0)
            present += denominator > 0
        return total / np.maximum(present, 1)
    return macro_f1


def _metric(columns: list[np.ndarray], statistic: Callable[..., np.ndarray], seed: int) -> Metric:
    if len(columns[0]) == 0:
        return Metric(None)
    value = float(statistic(*(np.asarray(c, dtype=float) for c in columns)))
    low, high = bootstrap_interval(columns, statistic, seed=seed)
    return Metric(value, low, high)


def _mcnemar(base_correct: np.ndarray, variant_correct: np.ndarray) -> float:
    """Exact McNemar p-value (two-sided): the discordant pairs' split tested against 1/2."""
    fixed = int(((base_correct == 0) & (variant_correct == 1)).sum())
    broke = int(((base_correct == 1) & (variant_correct == 0)).sum())
    return 1.0 if fixed + broke == 0 else float(binomtest(fixed, fixed + broke, 0.5).pvalue)


def _question_score(question_id: str, rows: pd.DataFrame, base_rows: pd.DataFrame, *, is_base: bool,
                    seed: int) -> QuestionScore:
    """`rows` and `base_rows`: one question's answers of the variant and of the base."""
    joined = rows.merge(base_rows[["case_id", "predicted", "correct"]], on="case_id", suffixes=("", "_base"))
    flips = [int(c) for c in joined.loc[joined["predicted"] != joined["predicted_base"], "case_id"]]
    labelled = joined[joined["expected"].notna()]
    correct, base_correct = labelled["correct"].to_numpy(float), labelled["correct_base"].to_numpy(float)
    classes = sorted(set(labelled["expected"]) | set(labelled["predicted"]))
    codes = {c: i for i, c in enumerate(classes)}
    change = _metric([correct - base_correct], mean, seed)
    return QuestionScore(
        question=question_id, n=len(labelled),
        accuracy=_metric([correct], mean, seed),
        macro_f1=_metric([labelled["expected"].map(codes).to_numpy(float),
                          labelled["predicted"].map(codes).to_numpy(float)], _macro_f1(len(classes)), seed),
        log_loss=_metric([labelled["log_loss"].to_numpy(float)], mean, seed),
        ece=_metric([labelled["confidence"].to_numpy(float), correct], ece_statistic(ECE_BINS), seed),
        flips=flips, accuracy_change=change,
        mcnemar_p=None if is_base or not len(labelled) else _mcnemar(base_correct, correct),
        better=change.low is not None and change.low > 0)


def _per_case(frame: pd.DataFrame) -> pd.DataFrame:
    """Labelled answers per case: how many, how many right."""
    labelled = frame[frame["expected"].notna()]
    return labelled.groupby("case_id")["correct"].agg(right="sum", labelled="count")


def _pooled(cases: pd.DataFrame, seed: int) -> Metric:
    """Accuracy over every labelled answer of `cases` (`_per_case`'s), the interval resampling cases."""
    return _metric([cases["right"].to_numpy(float), cases["labelled"].to_numpy(float)], _ratio, seed)


def _order_sensitivity(variants: list[Variant], frames: list[pd.DataFrame]) -> dict[str, float]:
    """Per order variant's name: the share of cases whose answer to its question differs from the "relabelled" one's."""
    controls = {v.question: frames[i] for i, v in enumerate(variants) if v.kind == "relabelled"}
    out = {}
    for i, variant in enumerate(variants):
        if variant.kind in ORDER_KINDS and variant.question in controls:
            control = controls[variant.question]
            joined = frames[i][frames[i]["question_id"] == variant.question].merge(
                control[control["question_id"] == variant.question], on="case_id", suffixes=("", "_control"))
            if len(joined):
                out[variant.name] = float((joined["predicted"] != joined["predicted_control"]).mean())
    return out


def _question_accuracy(frame: pd.DataFrame, question_id: str, cases: set[int]) -> float:
    rows = frame[(frame["question_id"] == question_id) & frame["expected"].notna() & frame["case_id"].isin(cases)]
    return float(rows["correct"].mean()) if len(rows) else -math.inf


def _fold_of(sweep: Sweep, base: pd.DataFrame) -> dict[int, int]:
    """Each case the base (`base`: its frame) answered with a label → its fold of the sweep's seeded k-fold split
    (k at most the cases); empty below 2 cases."""
    case_ids = sorted(set(base.loc[base["expected"].notna(), "case_id"]))
    k = min(sweep["settings"].get("folds", DEFAULT_FOLDS), len(case_ids))
    return {} if k < 2 else dict(zip(np.random.default_rng(DEFAULT_SEED).permutation(case_ids).tolist(),
                                     [i % k for i in range(len(case_ids))], strict=True))


def _composed(base: dict[str, Any], variants: list[Variant], frames: list[pd.DataFrame],
              cases: set[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """The base with each question worded as its most accurate candidate on `cases` words it (a candidate: the
    base, or a variant changing the question that is not an order diagnostic); and per question that variant's name."""
    composed, choices = copy.deepcopy(base), {}
    for question_id in base["questions"]:
        candidates = [0] + [i for i, v in enumerate(variants) if i and v.kind not in NOT_CANDIDATES
                            and question_id in changed_questions(v.schema, base)]
        chosen = max(candidates, key=lambda i: _question_accuracy(frames[i], question_id, cases))
        composed["questions"][question_id] = copy.deepcopy(variants[chosen].schema["questions"][question_id])
        choices[question_id] = variants[chosen].name
    return composed, choices


def _heldout_variants(sweep: Sweep, frames: list[pd.DataFrame]) -> list[SweepVariant]:
    """Per fold, the composed schema chosen on the other folds' cases, as a variant that answers this fold's."""
    variants = [Variant(**v) for v in sweep["variants"]]
    fold_of = _fold_of(sweep, frames[0])
    return [{"name": f"composed:fold{fold + 1}", "kind": "composed", "question": None, "relabel": {},
             "schema": _composed(sweep["schema"], variants, frames, {c for c, f in fold_of.items() if f != fold})[0]}
            for fold in sorted(set(fold_of.values()))]


def _best(sweep: Sweep, variants: list[Variant], frames: list[pd.DataFrame], heldout: list[pd.DataFrame],
          state_prefills: int) -> BestSchema | None:
    """The composed schema chosen on all cases, and what the composed schemas chosen per fold scored where they
    ran: on their held-out fold's cases (`heldout`: their answers, one frame per fold; empty until run;
    `state_prefills`: the states prefilled for them)."""
    fold_of = _fold_of(sweep, frames[0])
    if not fold_of:
        return None
    schema, choices = _composed(sweep["schema"], variants, frames, set(fold_of))
    answered = pd.concat(heldout, ignore_index=True) if heldout else frames[0].iloc[:0]

    base = frames[0][frames[0]["case_id"].isin(answered["case_id"])]
    return BestSchema(schema, choices, len(set(fold_of.values())), _pooled(_per_case(answered), DEFAULT_SEED),
                      _pooled(_per_case(base), DEFAULT_SEED), answered["case_id"].nunique(), state_prefills)


def load_sweep(store: Store, sweep_id: int, *, threshold: float | None = None,
               seed: int = DEFAULT_SEED) -> SweepResult:
    """A stored sweep scored over the cases done so far; order sensitivity above `threshold` is flagged."""
    sweep = store.get_sweep(sweep_id)
    answers = store.list_sweep_answers(sweep_id)
    every = [Variant(**v) for v in sweep["variants"]]
    frames = answer_frames(sweep, answers)
    own = sum(v.kind != "composed" for v in every)  # the composed ones come last: the held-out check's
    variants, frames, heldout = every[:own], frames[:own], frames[own:]
    heldout_prefills = sum(1 for a in answers if a["variant"] >= own and a["response"]
                           and not a["response"].get("x_state_cached"))
    base_cases = _per_case(frames[0])
    sensitivity = _order_sensitivity(variants, frames)
    scores = []
    for i, (variant, frame) in enumerate(zip(variants, frames, strict=True)):
        questions = {q: _question_score(q, frame[frame["question_id"] == q],
                                        frames[0][frames[0]["question_id"] == q], is_base=i == 0, seed=seed)
                     for q in sweep["schema"]["questions"]}
        cases = _per_case(frame).join(base_cases.add_suffix("_base"), how="inner")
        scores.append(VariantScore(
            variant=variant,
            accuracy=_pooled(cases, seed),
            accuracy_change=_metric([(cases["right"] - cases["right_base"]).to_numpy(float),
                                     cases["labelled"].to_numpy(float)], _ratio, seed),
            questions=questions,
            flips_vs_base=sorted({c for s in questions.values() for c in s.flips}),
            order_sensitivity=sensitivity.get(variant.name)))
    by_question: dict[str, float] = {}
    for v in (v for v in variants if v.name in sensitivity):
        by_question[str(v.question)] = max(by_question.get(str(v.question), 0.0), sensitivity[v.name])
    flagged = [] if threshold is None else [q for q, share in by_question.items() if share > threshold]
    return SweepResult(
        id=sweep["id"], status=sweep["status"], case_set_id=sweep["case_set_id"],
        case_set_name=sweep["case_set_name"], base_schema=sweep["schema"], model_id=sweep["model_id"],
        settings=sweep["settings"], created_at=sweep["created_at"], cases=sweep["total"], done=sweep["done"],
        state_prefills=sweep["state_prefills"] + heldout_prefills, variants=scores, order_sensitivity=by_question,
        threshold=threshold, flagged=flagged, best=_best(sweep, variants, frames, heldout, heldout_prefills),
        errors=[{"case_id": a["case_id"], "variant": every[a["variant"]].name, "error": a["error"]}
                for a in answers if a["error"]])


def leaderboard(result: SweepResult) -> pd.DataFrame:
    """One row per variant, most accurate first: its overall accuracy and change vs the base with their intervals,
    whether it is better, how many cases flip, and its order sensitivity."""
    rows = [{"variant": s.variant.name, "kind": s.variant.kind, "question": s.variant.question,
             "accuracy": s.accuracy.value, "low": s.accuracy.low, "high": s.accuracy.high,
             "change": s.accuracy_change.value, "change_low": s.accuracy_change.low,
             "change_high": s.accuracy_change.high, "better": s.better, "flips": len(s.flips_vs_base),
             "order_sensitivity": s.order_sensitivity} for s in result.variants]
    frame = pd.DataFrame(rows, columns=["variant", "kind", "question", "accuracy", "low", "high", "change",
                                        "change_low", "change_high", "better", "flips", "order_sensitivity"])
    return frame.sort_values("accuracy", ascending=False, kind="stable", na_position="last").reset_index(drop=True)


def variant_run(store: Store, sweep_id: int, name: str) -> int:
    """A finished run holding variant `name`'s answers to the sweep's cases, option ids in the base's terms (its
    schema: the variant's, named "<base> · sweep #N · <variant>"), so that Review opens them as it opens a run's:
    made on first use, the same run after."""
    sweep = store.get_sweep(sweep_id)
    position = next((i for i, v in enumerate(sweep["variants"]) if v["name"] == name), None)
    if position is None:
        raise SweepError(f"sweep {sweep_id} has no variant {name!r}")
    variant = sweep["variants"][position]
    schema = {**copy.deepcopy(variant["schema"]), "name": f"{sweep['schema'].get('name')} · sweep #{sweep_id} · {name}"}
    for question_id, names in variant["relabel"].items():
        question = schema["questions"][question_id]
        question["criteria"] = {names[option]: text for option, text in question["criteria"].items()}
    made = [r["id"] for r in store.list_runs(sweep["case_set_id"]) if r["schema_name"] == schema["name"]]
    if made:
        return made[0]
    run_id = store.create_run(sweep["case_set_id"], schema=schema, model_id=sweep["model_id"],
                              settings=RunSettings(schema_slug=sweep["settings"].get("schema_slug")))
    store.record_results(run_id, [
        {"case_id": a["case_id"], "response": _to_base_ids(a["response"], variant["relabel"])} if a["response"]
        else {"case_id": a["case_id"], "error": a["error"] or "no answer"}
        for a in store.list_sweep_answers(sweep_id) if a["variant"] == position])
    store.set_run_status(run_id, "finished")
    return run_id


def list_sweeps(store: Store, case_set_id: int | None = None) -> list[dict[str, Any]]:
    """Sweeps, newest first (optionally of one case set), as a list shows them: `variants` is their count."""
    keys = ("id", "case_set_id", "case_set_name", "schema_name", "model_id", "status", "error", "done", "total",
            "state_prefills", "created_at")
    return [{**{k: v for k, v in sweep.items() if k in keys}, "variants": sweep["variant_count"]}
            for sweep in store.list_sweeps(case_set_id)]
