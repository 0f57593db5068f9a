"""Compare two or more runs of one case set: different models, schema versions, or a local and a remote model.

The questions analysts bring: "is Flash good enough for this schema?", "did my new wording help?", "does our local
Clef agree with the hosted service?". Everything here is a plain function of runs as the store returns them
(`Store.get_run` + `Store.list_results`, bundled as `RunData`); `load_runs` fetches them. Definitions of the
predicted answer, confidence, accuracy, ECE and Brier are `stats.py`'s, so the numbers match the run page.

- `agreement`: per question and pair of runs, how often they give the same answer, with the flipped case ids;
- `flips`: one row per case and question where a pair of runs disagrees, and whether the change fixed or broke it;
- `metrics`: accuracy, ECE and Brier per run and question, latency per run, each with a bootstrap interval and n;
- `differences`: the same metrics as run − baseline with a paired bootstrap interval (same cases resampled in both);
- `case_matrix`: cases × (question, run) to browse, the expected answer beside the runs' answers;
- `start_runs`: "run this schema on this case set with these models" as one action.

Intervals are percentile bootstrap intervals over cases (a case is the unit that was sampled, not a (case,
question) pair), seeded so the same runs give the same numbers. Cases a run has no successful result for are left
out of that run's numbers and of every pair it is in; `n` says how many cases each number rests on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

from clef_workbench import stats

DEFAULT_BOOTSTRAP = 1000
DEFAULT_LEVEL = 0.95
QUALITY_METRICS = ("accuracy", "ece", "brier")
LATENCY_METRICS = ("latency_p50_ms", "latency_mean_ms")


@dataclass(frozen=True)
class RunData:
    """One run as the store gives it: `run` from Store.get_run, `results` from Store.list_results."""

    run: dict
    results: list[dict]

    @property
    def id(self) -> int:
        return int(self.run["id"])

    @property
    def label(self) -> str:
        """Short and unique among runs: `#id model · schema vN`."""
        model = str(self.run.get("model_id") or "?").rstrip("/").rsplit("/", 1)[-1] or "?"
        return f"#{self.id} {model} · {self.run.get('schema_name') or 'schema'} v{self.run.get('schema_version', '?')}"


def load_runs(store: Any, run_ids: Sequence[int]) -> list[RunData]:
    """Runs and their results from the store, checked to be comparable (see `check_comparable`)."""
    runs = [RunData(store.get_run(run_id), store.list_results(run_id)) for run_id in run_ids]
    check_comparable(runs)
    return runs


def start_runs(store: Any, runner: Any, case_set_id: int, schema: dict, engines: Mapping[str, Any], *,
               settings: dict | None = None) -> list[int]:
    """One run of `schema` on the case set per engine (a local Engine or a RemoteEngine), named by its key (the run's
    model_id, also the `model` its requests carry), all started on `runner` (a jobs.JobRunner) at once: each runs
    in its own thread, so a remote endpoint answers while the local GPU works. Returns the run ids, in order."""
    if not engines:
        raise ValueError("pick at least one model to run")
    run_ids = [store.create_run(case_set_id, schema=schema, model_id=name,
                                model_revision=(engine.info() or {}).get("revision"), settings=settings)
               for name, engine in engines.items()]
    for run_id, engine in zip(run_ids, engines.values(), strict=True):
        runner.start(run_id, engine)
    return run_ids


def check_comparable(runs: Sequence[RunData]) -> None:
    """Two or more distinct runs of one case set; raises ValueError saying which runs differ."""
    if len(runs) < 2:
        raise ValueError(f"pick at least two runs to compare (got {len(runs)})")
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a run is listed twice: {ids}")
    case_sets = {r.run.get("case_set_id") for r in runs}
    if len(case_sets) > 1:
        detail = ", ".join(f"run {r.id} → case set {r.run.get('case_set_id')}" for r in runs)
        raise ValueError(f"runs of different case sets cannot be compared case by case ({detail})")


def answers(runs: Sequence[RunData]) -> pd.DataFrame:
    """`stats.answer_frame` of every run, stacked, with `run_id` and `run` (label) columns and a per-row `brier`
    (noul: (P(true) − y)²; choice and score: Σ_k (p_k − y_k)²; NaN without an expected answer)."""
    frames = []
    for run in runs:
        frame = stats.answer_frame(run.results, run.run["schema"])
        frame.insert(0, "run", run.label)
        frame.insert(0, "run_id", run.id)
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    frame["brier"] = [_brier(t, d, e) for t, d, e in zip(frame["question_type"], frame["distribution"],
                                                           frame["expected"], strict=True)]
    return frame


def _brier(question_type: str, distribution: dict[str, float], expected: str | None) -> float:
    if expected is None:
        return np.nan
    if question_type == "noul":
        return (distribution["true"] - (1.0 if expected == "true" else 0.0)) ** 2
    return float(sum((p - (1.0 if option == expected else 0.0)) ** 2 for option, p in distribution.items()))


# ---- bootstrap ----------------------------------------------------------------------------------------------------


def bootstrap_interval(columns: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], *,
                       n_boot: int = DEFAULT_BOOTSTRAP, level: float = DEFAULT_LEVEL,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over rows: every column is resampled with the same row indices
    (paired). `statistic` takes the resampled columns as (n_boot, n) arrays and returns n_boot values.
    (NaN, NaN) when there are no rows."""
    n = len(columns[0])
    if n == 0:
        return np.nan, np.nan
    index = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    values = statistic(*(np.asarray(c, dtype=float)[index] for c in columns))
    low, high = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(low), float(high)


def _mean(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=-1)


def _ece(bins: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """ECE as stats.calibration defines it, over the last axis: Σ_b |Σ_{i∈b} (correct_i − confidence_i)| / N."""
    def ece(confidence: np.ndarray, correct: np.ndarray) -> np.ndarray:
        index = np.clip(np.floor(np.round(confidence * bins, 9)).astype(int), 0, bins - 1)
        gap = correct - confidence
        per_bin = [np.where(index == b, gap, 0.0).sum(axis=-1) for b in range(bins)]
        return np.abs(np.stack(per_bin)).sum(axis=0) / confidence.shape[-1]
    return ece


def _p50(values: np.ndarray) -> np.ndarray:
    return np.percentile(values, 50, axis=-1, method=stats.PERCENTILE_METHOD)


def _metric_columns(rows: pd.DataFrame, metric: str, bins: int) -> tuple[list[np.ndarray], Callable]:
    """The per-case columns a quality metric is computed from, and the statistic over them."""
    if metric == "accuracy":
        return [rows["correct"].to_numpy(float)], _mean
    if metric == "brier":
        return [rows["brier"].to_numpy(float)], _mean
    return [rows["confidence"].to_numpy(float), rows["correct"].to_numpy(float)], _ece(bins)


def _latencies(run: RunData) -> pd.Series:
    """Latency of each successful result, indexed by case id."""
    ok = [r for r in run.results if not r.get("error") and r.get("response") and r.get("latency_ms") is not None]
    return pd.Series([float(r["latency_ms"]) for r in ok], index=[r["case_id"] for r in ok], dtype=float)


# ---- the comparisons ----------------------------------------------------------------------------------------------


def _pairs(frame: pd.DataFrame, runs: Sequence[RunData]):
    """(run a, run b, their answers joined on case and question), for every pair, questions of the same type only
    (a question whose type changed between schema versions has no comparable answer)."""
    for a, b in combinations(runs, 2):
        joined = frame[frame["run_id"] == a.id].merge(frame[frame["run_id"] == b.id],
                                                      on=["case_id", "question_id"], suffixes=("_a", "_b"))
        yield a, b, joined[joined["question_type_a"] == joined["question_type_b"]]


def agreement(runs: Sequence[RunData], *, n_boot: int = DEFAULT_BOOTSTRAP, level: float = DEFAULT_LEVEL,
              seed: int = 0) -> pd.DataFrame:
    """Per question and pair of runs: n (cases both answered), agreements, agreement rate with its bootstrap
    interval (low, high), flips and the flipped case ids (in case-set order)."""
    check_comparable(runs)
    frame = answers(runs)
    rows = []
    for a, b, joined in _pairs(frame, runs):
        for question_id, group in joined.groupby("question_id", sort=False):
            group = group.sort_values("position_a", kind="stable")
            same = (group["predicted_a"] == group["predicted_b"]).to_numpy(float)
            low, high = bootstrap_interval([same], _mean, n_boot=n_boot, level=level, seed=seed)
            rows.append({"question_id": question_id, "run_a": a.label, "run_b": b.label, "run_a_id": a.id,
                         "run_b_id": b.id, "n": len(group), "agreements": int(same.sum()),
                         "agreement": float(same.mean()), "low": low, "high": high,
                         "flips": int(len(group) - same.sum()),
                         "flipped_case_ids": group.loc[same == 0, "case_id"].tolist()})
    columns = ["question_id", "run_a", "run_b", "run_a_id", "run_b_id", "n", "agreements", "agreement", "low",
               "high", "flips", "flipped_case_ids"]
    return pd.DataFrame(rows, columns=columns)


def _change(correct_a: float, correct_b: float) -> str:
    if np.isnan(correct_a) or np.isnan(correct_b):
        return "no expected answer"
    return {(0, 1): "fixed", (1, 0): "broken"}.get((int(correct_a), int(correct_b)), "both wrong")


def flips(runs: Sequence[RunData]) -> pd.DataFrame:
    """Every (pair of runs, question, case) where the two runs' answers differ: both answers and confidences, the
    expected answer, and the change from run a to run b: fixed, broken, both wrong, or no expected answer."""
    check_comparable(runs)
    frame = answers(runs)
    parts = []
    for a, b, joined in _pairs(frame, runs):
        flipped = joined[joined["predicted_a"] != joined["predicted_b"]].copy()
        flipped["run_a"], flipped["run_b"], flipped["run_a_id"], flipped["run_b_id"] = a.label, b.label, a.id, b.id
        flipped["change"] = [_change(x, y) for x, y in zip(flipped["correct_a"], flipped["correct_b"], strict=True)]
        parts.append(flipped.sort_values(["question_id", "position_a"], kind="stable"))
    columns = ["run_a", "run_b", "run_a_id", "run_b_id", "question_id", "case_id", "position", "expected",
               "predicted_a", "predicted_b", "confidence_a", "confidence_b", "change"]
    if not parts:
        return pd.DataFrame(columns=columns)
    out = pd.concat(parts, ignore_index=True).rename(columns={"position_a": "position", "expected_a": "expected"})
    return out[columns]


def metrics(runs: Sequence[RunData], *, bins: int = 10, n_boot: int = DEFAULT_BOOTSTRAP,
            level: float = DEFAULT_LEVEL, seed: int = 0) -> pd.DataFrame:
    """Side by side, one row per (run, question, metric): value, bootstrap interval (low, high) and n.
    Quality metrics (accuracy, ece, brier) per question over the cases with an expected answer; latency (p50 and
    mean, ms, as each run recorded it) per run over its successful results, with question_id None."""
    check_comparable(runs)
    frame = answers(runs)
    rows = []
    for run in runs:
        mine = frame[(frame["run_id"] == run.id) & frame["expected"].notna()]
        for question_id, group in mine.groupby("question_id", sort=False):
            for metric in QUALITY_METRICS:
                columns, statistic = _metric_columns(group, metric, bins)
                value = float(statistic(*columns))
                low, high = bootstrap_interval(columns, statistic, n_boot=n_boot, level=level, seed=seed)
                rows.append({"run_id": run.id, "run": run.label, "question_id": question_id, "metric": metric,
                             "value": value, "low": low, "high": high, "n": len(group)})
        latency = _latencies(run).to_numpy()
        for metric, statistic in zip(LATENCY_METRICS, (_p50, _mean), strict=True):
            value = float(statistic(latency)) if latency.size else np.nan
            low, high = bootstrap_interval([latency], statistic, n_boot=n_boot, level=level, seed=seed)
            rows.append({"run_id": run.id, "run": run.label, "question_id": None, "metric": metric,
                         "value": value, "low": low, "high": high, "n": int(latency.size)})
    return pd.DataFrame(rows, columns=["run_id", "run", "question_id", "metric", "value", "low", "high", "n"])


def differences(runs: Sequence[RunData], *, baseline: int = 0, bins: int = 10, n_boot: int = DEFAULT_BOOTSTRAP,
                level: float = DEFAULT_LEVEL, seed: int = 0) -> pd.DataFrame:
    """Each run against `runs[baseline]`: difference (run − baseline) of every quality metric per question and of
    latency per run, over the cases both have, with a paired bootstrap interval (the same cases drawn for both
    runs, so case difficulty cancels out). Positive accuracy differences are better; positive ECE, Brier and
    latency differences are worse."""
    check_comparable(runs)
    frame = answers(runs)
    base = runs[baseline]
    rows = []
    for run in runs:
        if run.id == base.id:
            continue
        _, _, joined = next(_pairs(frame, [base, run]))
        joined = joined[joined["expected_a"].notna()]
        for question_id, group in joined.groupby("question_id", sort=False):
            for metric in QUALITY_METRICS:
                columns_a, statistic = _metric_columns(group.rename(columns=lambda c: c.removesuffix("_a")),
                                                       metric, bins)
                columns_b, _ = _metric_columns(group.rename(columns=lambda c: c.removesuffix("_b")), metric, bins)
                k = len(columns_a)

                def paired(*columns: np.ndarray, statistic=statistic, k=k) -> np.ndarray:
                    return statistic(*columns[k:]) - statistic(*columns[:k])

                value = float(paired(*columns_a, *columns_b))
                low, high = bootstrap_interval(columns_a + columns_b, paired, n_boot=n_boot, level=level, seed=seed)
                rows.append({"run_id": run.id, "run": run.label, "baseline": base.label, "question_id": question_id,
                             "metric": metric, "difference": value, "low": low, "high": high, "n": len(group)})
        both = pd.concat([_latencies(base), _latencies(run)], axis=1, join="inner").to_numpy().T
        for metric, statistic in zip(LATENCY_METRICS, (_p50, _mean), strict=True):
            def paired_latency(a: np.ndarray, b: np.ndarray, statistic=statistic) -> np.ndarray:
                return statistic(b) - statistic(a)

            value = float(paired_latency(both[0], both[1])) if both.shape[1] else np.nan
            low, high = bootstrap_interval([both[0], both[1]], paired_latency, n_boot=n_boot, level=level, seed=seed)
            rows.append({"run_id": run.id, "run": run.label, "baseline": base.label, "question_id": None,
                         "metric": metric, "difference": value, "low": low, "high": high, "n": int(both.shape[1])})
    return pd.DataFrame(rows, columns=["run_id", "run", "baseline", "question_id", "metric", "difference", "low",
                                       "high", "n"])


MATRIX_VALUES = ("predicted", "confidence", "correct")


def case_matrix(runs: Sequence[RunData], *, value: str = "predicted", question_ids: Sequence[str] | None = None,
                disagreements_only: bool = False) -> pd.DataFrame:
    """Cases × runs to browse: index case_id (case-set order), a `position` column, then columns
    (question_id, "expected") and (question_id, run label) for every run, holding the run's `value`
    (predicted answer, its confidence, or whether it was right). A case a run failed on shows `error: …` as its
    predicted answer (NaN for the numbers); a case not run yet shows None, and so does the expected answer of a case
    no run answered. `disagreements_only` keeps the cases where two runs' answers (or an answer and a failure) to
    some shown question differ."""
    if value not in MATRIX_VALUES:
        raise ValueError(f"value must be one of {MATRIX_VALUES}, not {value!r}")
    check_comparable(runs)
    frame = answers(runs)
    questions: list[str] = list(question_ids) if question_ids is not None else list(
        dict.fromkeys(q for run in runs for q in run.run["schema"]["questions"]))
    cases: dict[int, dict] = {}
    for run in runs:
        for result in run.results:
            case = cases.setdefault(result["case_id"], {"position": result.get("position")})
            if result.get("error") and value == "predicted":
                for question_id in run.run["schema"]["questions"]:
                    case[(question_id, run.label)] = f"error: {result['error']}"
    for row in frame[frame["question_id"].isin(questions)].itertuples(index=False):
        cases[row.case_id][(row.question_id, row.run)] = getattr(row, value)
        cases[row.case_id][(row.question_id, "expected")] = row.expected
    columns = [("position", "")] + [(q, label) for q in questions for label in ["expected"] + [r.label for r in runs]]
    matrix = pd.DataFrame(
        [[case.get("position")] + [case.get(column) for column in columns[1:]] for case in cases.values()],
        index=pd.Index(list(cases), name="case_id"), columns=pd.MultiIndex.from_tuples(columns))
    matrix = matrix.sort_values(("position", ""), kind="stable")
    if disagreements_only:
        predicted = case_matrix(runs, question_ids=questions) if value != "predicted" else matrix
        labels = [r.label for r in runs]
        differ = pd.Series(False, index=predicted.index)
        for question_id in questions:
            answered = predicted[[(question_id, label) for label in labels]]
            differ |= answered.nunique(axis=1) > 1
        matrix = matrix[differ.reindex(matrix.index)]
    return matrix

