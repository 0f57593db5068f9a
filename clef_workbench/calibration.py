"""How sure: calibrate a run's probabilities on its labelled cases, and say honestly whether that helped
(docs/workbench.md "Confidence" says what the person sees).

Per question, one map from the model's distribution to a calibrated one (`clef_engine.calibrated` applies it): Platt
scaling on the log-odds for ``noul``, a temperature for ``choice`` and ``score`` (it keeps the options' ranking and so
the predicted answer), each fitted by minimising the negative log-likelihood of the expected answers. Whether it helps
is measured on cases the map did not see (``k_folds``), with bootstrap intervals over cases; the stored map is then
fitted on every labelled case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import minimize, minimize_scalar

from clef_engine.calibrated import QuestionMap, calibrated_answer
from clef_workbench import stats
from clef_workbench.store import Calibration, Response, Result, Run, Store

MIN_LABELLED = 30
PLATT_BOUND = 50.0  # |a|, |b| of a Platt fit
LOG_TEMPERATURE_BOUND = 3.0  # |log T| of a temperature fit: T between 1/20.09 and 20.09
FOLDS = 5
_EPS = 1e-12


@dataclass(frozen=True)
class QuestionCalibration:
    """The fitted map of one question: `method` is "platt" (noul: `a`, `b`) or "temperature" (`temperature`)."""

    question_id: str
    question_type: str
    method: str
    a: float = 1.0
    b: float = 0.0
    temperature: float = 1.0

    def apply(self, distribution: dict[str, float]) -> dict[str, float]:
        """The calibrated distribution (same keys, summing to 1): the arithmetic the HTTP API applies too."""
        return QuestionMap(self.question_type, self.method, self.a, self.b, self.temperature).apply(distribution)


@dataclass
class Interval:
    value: float
    low: float
    high: float


@dataclass
class QuestionReport:
    """Before/after of one question on held-out cases; `refused` says why a question was not fitted."""

    question_id: str
    question_type: str
    n: int
    refused: str | None = None
    calibration: QuestionCalibration | None = None
    ece_before: Interval | None = None
    ece_after: Interval | None = None
    brier_before: Interval | None = None
    brier_after: Interval | None = None
    ece_reduction: Interval | None = None
    bins_before: pd.DataFrame | None = field(default=None, repr=False)
    bins_after: pd.DataFrame | None = field(default=None, repr=False)


def _labelled(frame: pd.DataFrame, question_id: str) -> pd.DataFrame:
    rows = frame[(frame["question_id"] == question_id) & frame["expected"].notna()]
    # an expected answer that is not one of the question's options cannot be scored
    return rows[[expected in distribution for expected, distribution in
                 zip(rows["expected"], rows["distribution"], strict=True)]].reset_index(drop=True)


def _negative_log_likelihood(question: QuestionCalibration, rows: pd.DataFrame) -> float:
    return -sum(np.log(max(question.apply(distribution)[expected], _EPS))
                for distribution, expected in zip(rows["distribution"], rows["expected"], strict=True))


def fit_question(rows: pd.DataFrame) -> QuestionCalibration:
    """The map of one question fitted on `rows` (its labelled rows of an answer frame)."""
    question_id, question_type = rows["question_id"].iloc[0], rows["question_type"].iloc[0]
    if question_type == "noul":
        def platt_loss(params: np.ndarray) -> float:
            return _negative_log_likelihood(
                QuestionCalibration(question_id, question_type, "platt", a=params[0], b=params[1]), rows)

        best = minimize(platt_loss, x0=np.array([1.0, 0.0]), method="L-BFGS-B",
                        bounds=[(-PLATT_BOUND, PLATT_BOUND)] * 2)
        return QuestionCalibration(question_id, question_type, "platt", a=float(best.x[0]), b=float(best.x[1]))

    def temperature_loss(log_t: float) -> float:
        return _negative_log_likelihood(
            QuestionCalibration(question_id, question_type, "temperature", temperature=float(np.exp(log_t))), rows)

    # a temperature between 1/20 and 20: beyond them the answers are already one-hot or uniform
    best = minimize_scalar(temperature_loss, bounds=(-LOG_TEMPERATURE_BOUND, LOG_TEMPERATURE_BOUND), method="bounded")
    return QuestionCalibration(question_id, question_type, "temperature", temperature=float(np.exp(best.x)))


def with_distributions(rows: pd.DataFrame, distributions: list[dict[str, float]]) -> pd.DataFrame:
    """`rows` with each distribution replaced, and what follows from it (prediction, confidence, margin, correct)."""
    out = rows.copy()
    out["distribution"] = distributions
    predicted = [stats.predict(qtype, d) for qtype, d in zip(out["question_type"], distributions, strict=True)]
    out["predicted"], out["confidence"], out["margin"] = ([p[i] for p in predicted] for i in range(3))
    out["correct"] = [np.nan if expected is None else float(predicted == expected)
                      for predicted, expected in zip(out["predicted"], out["expected"], strict=True)]
    return out


def _bootstrap(before: pd.DataFrame, after: pd.DataFrame, bins: int, seed: int) -> dict[str, Interval]:
    """ECE and Brier before and after, and what the fit bought (the ECE reduction), each with its percentile
    interval; every interval resamples the same cases (one seed), so before and after stay paired."""
    ece = stats.ece_statistic(bins)

    def reduction(*columns: np.ndarray) -> np.ndarray:
        return ece(*columns[:2]) - ece(*columns[2:])

    ece_before, ece_after = ([rows["confidence"].to_numpy(float), rows["correct"].to_numpy(float)]
                             for rows in (before, after))
    measures: dict[str, tuple[list[np.ndarray], Callable[..., np.ndarray]]] = {
        "ece_before": (ece_before, ece), "brier_before": ([stats.brier_terms(before)], stats.mean),
        "ece_after": (ece_after, ece), "brier_after": ([stats.brier_terms(after)], stats.mean),
        "ece_reduction": (ece_before + ece_after, reduction)}
    out = {}
    for name, (columns, statistic) in measures.items():
        low, high = stats.bootstrap_interval(columns, statistic, seed=seed)
        out[name] = Interval(float(statistic(*columns)), low, high)
    return out


def calibrate(frame: pd.DataFrame, *, min_labelled: int = MIN_LABELLED, folds: int = FOLDS, bins: int = 10,
              seed: int = 0) -> list[QuestionReport]:
    """One report per question of `frame` (a run's `stats.answer_frame`): fitted on all its labelled cases, judged on
    held-out ones (`verdict`), or refused with the reason."""
    reports = []
    for question_id in dict.fromkeys(frame["question_id"]):
        qtype = frame.loc[frame["question_id"] == question_id, "question_type"].iloc[0]
        rows = _labelled(frame, question_id)
        if len(rows) < min_labelled:
            reports.append(QuestionReport(question_id, qtype, len(rows), refused=(
                f"{len(rows)} labelled case(s) with an expected answer among the options; calibrating needs at least "
                f"{min_labelled}")))
            continue
        held_out: list[dict[str, float]] = [{}] * len(rows)
        for train, test in k_folds(len(rows), min(folds, len(rows)), seed):
            fitted = fit_question(rows.iloc[train])
            for i in test:
                held_out[i] = fitted.apply(rows["distribution"].iloc[i])
        after = with_distributions(rows, held_out)
        report = QuestionReport(question_id, qtype, len(rows), calibration=fit_question(rows),
                                bins_before=stats.calibration(rows, question_id, bins)["bins"],
                                bins_after=stats.calibration(after, question_id, bins)["bins"])
        for name, interval in _bootstrap(rows, after, bins, seed).items():  # ece_before, …, ece_reduction
            setattr(report, name, interval)
        reports.append(report)
    return reports


def k_folds(count: int, folds: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index arrays of `folds` folds over `count` shuffled cases: the folds scikit-learn's
    ``KFold(folds, shuffle=True, random_state=seed)`` makes (same permutation, same sizes, indices ascending). Not
    scikit-learn itself: once it is installed, transformers imports it when the engine loads its model class, about
    2 s of every engine process's start for this one function."""
    order = np.arange(count)
    np.random.RandomState(seed).shuffle(order)
    for test in np.array_split(order, folds):
        held_out = np.zeros(count, dtype=bool)
        held_out[test] = True
        yield np.flatnonzero(~held_out), np.flatnonzero(held_out)


@dataclass(frozen=True)
class Verdict:
    """Whether a question's fitted map is applied unless asked otherwise, and why, in words."""

    applied: bool
    reason: str


AT_BOUND = 1e-3  # a fitted parameter this close to its bound stopped there: the best fit lies beyond it


def at_bound(question: QuestionCalibration) -> str | None:
    """In words, the fitted parameter that stopped at the bound of what the fit tries; None when none did."""
    if question.method == "temperature":
        log_t = float(np.log(question.temperature))
        if abs(log_t) < LOG_TEMPERATURE_BOUND - AT_BOUND:
            return None
        if log_t > 0:
            return (f"the temperature {question.temperature:.2f} is the largest the fit tries: it flattens every "
                    "answer to about 1/k (all options nearly equally likely)")
        return (f"the temperature {question.temperature:.3f} is the smallest the fit tries: it makes every answer "
                "all-or-nothing")
    for name in ("a", "b"):
        value = getattr(question, name)
        if abs(value) >= PLATT_BOUND - AT_BOUND:
            return f"the Platt parameter {name} = {value:g} is at the bound the fit tries (±{PLATT_BOUND:g})"
    return None


def verdict(question: QuestionCalibration, reduction: Interval | None) -> Verdict:
    """A map is applied when the interval of its held-out ECE reduction lies above zero and no parameter stopped at
    its bound. A map kept without held-out figures (none measured) is applied unless it is at a bound."""
    bound = at_bound(question)
    if reduction is None:
        return Verdict(False, f"not applied: {bound}") if bound else \
            Verdict(True, "applied: no held-out figures were kept with it")
    effect = (f"held-out ECE reduction {reduction.value:+.3f} [{reduction.low:+.3f}, {reduction.high:+.3f}], "
              f"{stats.DEFAULT_LEVEL:.0%} interval")
    if bound:
        return Verdict(False, f"not applied: {bound} ({effect})")
    if reduction.low <= 0:
        return Verdict(False, f"not applied: it may not help — {effect} includes no improvement")
    return Verdict(True, f"applied: {effect}")


def verdicts(payload: dict[str, Any]) -> dict[str, Verdict]:
    """The verdict on each map of a stored calibration's payload, by question."""
    reductions = {r["question_id"]: r.get("ece_reduction") for r in payload.get("report") or []}
    return {question_id: verdict(question, Interval(**reductions[question_id]) if reductions.get(question_id)
                                 else None)
            for question_id, question in maps_from_payload(payload).items()}


def verdicts_text(payload: dict[str, Any]) -> str:
    """Each question's verdict as a Markdown list, shown next to every control that chooses calibrated numbers."""
    return "\n".join(f"- **{question_id}** — {judged.reason}" for question_id, judged in verdicts(payload).items())


def applied_maps(payload: dict[str, Any], *, every_question: bool = False) -> dict[str, QuestionCalibration]:
    """The maps a stored calibration applies: those whose verdict says so, or with `every_question` all of them."""
    judged = verdicts(payload)
    return {question_id: question for question_id, question in maps_from_payload(payload).items()
            if every_question or judged[question_id].applied}


def summary_table(reports: list[QuestionReport]) -> pd.DataFrame:
    """The before/after table the CLI prints and the Runs page shows."""
    def cell(interval: Interval | None) -> str:
        return "" if interval is None else f"{interval.value:.3f} [{interval.low:.3f}, {interval.high:.3f}]"

    return pd.DataFrame([{
        "question": r.question_id, "n": r.n,
        "method": "" if r.calibration is None else r.calibration.method,
        "ECE before": cell(r.ece_before), "ECE after (held out)": cell(r.ece_after),
        "ECE reduction": cell(r.ece_reduction),
        "Brier before": cell(r.brier_before), "Brier after (held out)": cell(r.brier_after),
        "note": r.refused or ("" if r.calibration is None else verdict(r.calibration, r.ece_reduction).reason),
    } for r in reports])


def calibration_payload(reports: list[QuestionReport]) -> dict[str, Any]:
    """What the store keeps: the fitted maps by question, and the before/after figures."""
    return {
        "questions": {r.question_id: asdict(r.calibration) for r in reports if r.calibration is not None},
        "report": [{"question_id": r.question_id, "question_type": r.question_type, "n": r.n, "refused": r.refused,
                    **{name: None if getattr(r, name) is None else asdict(getattr(r, name))
                       for name in ("ece_before", "ece_after", "brier_before", "brier_after", "ece_reduction")}}
                   for r in reports],
    }


def maps_from_payload(payload: dict[str, Any]) -> dict[str, QuestionCalibration]:
    return {question_id: QuestionCalibration(**params) for question_id, params in payload["questions"].items()}


def export_document(store: Store) -> dict[str, Any]:
    """Every stored calibration in the form `clef-engine serve --calibrations FILE` reads
    (`clef_engine.calibrated`): by name, its maps and what it was fitted on."""
    return {"calibrations": {
        stored["name"]: {"questions": {question_id: {key: params[key] for key in
                                                     ("question_type", "method", "a", "b", "temperature")}
                                       for question_id, params in stored["payload"]["questions"].items()},
                         "schema_name": stored["schema_name"], "model_id": stored["model_id"],
                         "run_id": stored["run_id"]}
        for stored in store.list_calibrations()}}


def for_run(store: Store, run: Run) -> Calibration | None:
    """The newest calibration fitted for the run's schema and model (a map only holds for that pair), or None."""
    return next(iter(store.list_calibrations(schema_name=run["schema_name"], model_id=run["model_id"])), None)


def calibrated_results(stored: Calibration, results: list[Result]) -> list[Result]:
    """A run's results (`Store.list_results`) with each answer the stored calibration has a map for replaced by its
    calibrated answer; the rest as they were."""
    maps = applied_maps(stored["payload"])
    return [{**result, "response": {**response, "answers": calibrated_answers(maps, response)}}
            if (response := result["response"]) else result for result in results]


def calibrated_answers(maps: dict[str, QuestionCalibration], response: Response) -> dict[str, dict[str, Any]]:
    """A System One response's answers, each one a map of the same question type has calibrated; the others raw."""
    return {qid: calibrated_answer(answer, question.apply(stats.distribution_of(question.question_type, answer)))
            if (question := maps.get(qid)) is not None and answer.get("type") == question.question_type else answer
            for qid, answer in response["answers"].items()}


class CalibrationRefused(Exception):
    """No question of the run could be calibrated; the message says why for each."""


def calibrate_run(store: Store, run_id: int, *, name: str | None = None, min_labelled: int = MIN_LABELLED,
                  folds: int = FOLDS) -> tuple[int, list[QuestionReport]]:
    """Fit and judge a calibration on a run's labelled cases and keep it in the store (id, reports). Labels are the
    cases' expected answers (imported, or set by review). Refused when no question has enough labelled cases."""
    run = store.get_run(run_id)
    frame = stats.answer_frame(store.list_results(run_id), run["schema"])
    if frame.empty:
        raise CalibrationRefused(f"run {run_id} has no answered case to calibrate on")
    reports = calibrate(frame, min_labelled=min_labelled, folds=folds)
    if not any(r.calibration for r in reports):
        raise CalibrationRefused("; ".join(f"{r.question_id}: {r.refused}" for r in reports))
    if name is None:  # a run calibrated again (other folds or labels since) gets the next free number
        taken = {c["name"] for c in store.list_calibrations()}
        base = f"{run['schema_name']} · {run['model_id']} · run {run_id}"
        name = next(candidate for candidate in (base, *(f"{base} ({n})" for n in range(2, len(taken) + 3)))
                    if candidate not in taken)
    return store.save_calibration(name, run, calibration_payload(reports)), reports


def calibrated_response(store: Store, name: str, response: Response, *, every_question: bool = False
                        ) -> tuple[Calibration, dict[str, Any]]:
    """(the stored calibration named `name`, the response's answers calibrated by it where it has a map that is
    applied (`applied_maps`), others as they were): what Decide, Runs and Review show when a calibration is chosen."""
    stored = store.get_calibration(name=name)
    return stored, calibrated_answers(applied_maps(stored["payload"], every_question=every_question), response)
