"""Statistics of a run: latency, throughput, accuracy, confusion, calibration, and run-to-run comparison.

Definitions used throughout (shown in the UI next to the numbers):

* **Percentiles** use linear interpolation between closest ranks (numpy's default ``method="linear"``,
  Hyndman & Fan type 7, the same as ``pandas.Series.quantile``): for sorted samples x_0..x_{n-1} the q-quantile
  is x_i + (h - i)(x_{i+1} - x_i) with h = (n - 1) q and i = floor(h).
* **Predicted answer** of a question: the option with the highest probability (noul: ``true`` when
  P(true) >= 0.5; score: the most probable level, i.e. the mode, not the rounded expected value).
* **Confidence** = probability of the predicted answer (top-1 probability; for noul max(p, 1 - p)). This is the
  release code's ``confidence`` for choice and score, not TypeSafe's rescaled or Workers AI's Σp² variants.
* **Margin** = top-1 probability minus top-2 probability (for noul |2p - 1|).
* **Calibration** bins confidence into ``bins`` equal-width bins on [0, 1] (the last bin includes 1.0);
  ECE = Σ_b (n_b / N) · |accuracy_b - mean confidence_b| over non-empty bins.
* **Brier score**: noul uses the binary form mean (P(true) - y)²; choice and score use the multi-class form
  mean Σ_k (p_k - y_k)² over all of the question's options (Brier 1950), with y the one-hot expected answer.
* **Throughput** divides by *busy time*: the union of the [started, finished] intervals of the chunks that
  produced results, so the pause between a cancelled run and its resumption does not count.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

from clef_workbench.store import Answered, Result

PERCENTILE_METHOD: Final = "linear"
DEFAULT_BOOTSTRAP = 1000
DEFAULT_LEVEL = 0.95


def state_text(state: Any) -> str:
    """A case's state as text: a text as it is, anything else as JSON."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def _label_key(value: Any) -> str | None:
    """Expected answers as distribution keys: bools and yes/no → 'true'/'false', ints → '2', strings as is."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def distribution_of(question_type: str, answer: Mapping[str, Any]) -> dict[str, float]:
    """Every option's probability from one System One answer, keyed like expected answers."""
    if question_type == "noul":
        p_true = float(answer["noul"])
        return {"true": p_true, "false": 1.0 - p_true}
    return {str(k): float(v) for k, v in answer["probabilities"].items()}


def predict(question_type: str, distribution: dict[str, float]) -> tuple[str, float, float]:
    """(predicted option, its probability, margin over the runner-up); ties go to the first option listed, and a
    noul answer of p = 0.5 exactly counts as true, as documented."""
    ordered = sorted(distribution.items(), key=lambda kv: -kv[1])
    best, p_best = ordered[0]
    p_second = ordered[1][1] if len(ordered) > 1 else 0.0
    if question_type == "noul":
        best = "true" if distribution["true"] >= 0.5 else "false"
    return best, p_best, p_best - p_second


def answer_frame(results: Sequence[Answered], schema: dict) -> pd.DataFrame:
    """One row per (case, question) of the successful results of a run: the answer's distribution, predicted
    option, confidence and margin, the expected key (None without one), correct (NaN without one), and for score
    questions the score Σ i·p_i and the expected level."""
    questions = schema["questions"]
    rows = []
    for result in results:
        response = result.get("response")
        if not response or result.get("error"):
            continue
        expected = result.get("expected") or {}
        for question_id, question in questions.items():
            answer = response.get("answers", {}).get(question_id)
            if answer is None:
                continue
            qtype = question["type"]
            distribution = distribution_of(qtype, answer)
            predicted, confidence, margin = predict(qtype, distribution)
            expected_key = _label_key(expected.get(question_id))
            if qtype == "noul" and expected_key is not None:
                expected_key = {"yes": "true", "no": "false", "1": "true", "0": "false"}.get(
                    expected_key.lower(), expected_key.lower())
            rows.append({
                "case_id": result["case_id"], "position": result.get("position"), "question_id": question_id,
                "question_type": qtype, "predicted": predicted, "confidence": confidence, "margin": margin,
                "distribution": distribution, "expected": expected_key,
                "correct": np.nan if expected_key is None else float(predicted == expected_key),
                "score": float(answer["score"]) if qtype == "score" else np.nan,
                "expected_level": float(expected_key) if qtype == "score" and expected_key is not None else np.nan,
                "latency_ms": result.get("latency_ms"), "input_tokens": result.get("input_tokens")})
    columns = ["case_id", "position", "question_id", "question_type", "predicted", "confidence", "margin",
               "distribution", "expected", "correct", "score", "expected_level", "latency_ms", "input_tokens"]
    frame = pd.DataFrame(rows, columns=columns)
    # pandas turns None into NaN in some column mixes; keep "no expected answer" as None for every consumer
    frame["expected"] = frame["expected"].astype(object).where(frame["expected"].notna(), None)
    return frame


def coverage(results: Sequence[Result], frame: pd.DataFrame) -> dict[str, Any]:
    """What the statistics of a run rest on (failed results are left out of every statistic, accuracy and
    calibration use the answered cases with an expected answer), in counts and a sentence."""
    failed = sum(1 for r in results if r.get("error"))
    answered = len(results) - failed
    with_expected = int(frame.loc[frame["expected"].notna(), "case_id"].nunique()) if not frame.empty else 0
    if not answered:
        sentence = (f"No case has an answer: all {failed} failed, so there is nothing to measure. Their errors are "
                    "listed at the top and in the exports.")
    elif not with_expected:
        sentence = (f"None of the {answered} answered cases has an expected answer, so accuracy and calibration "
                    "cannot be computed" + (f" ({failed} failed cases left out)." if failed else "."))
    else:
        sentence = (f"Accuracy and calibration use the {with_expected} answered cases with expected answers"
                    + (f"; {answered - with_expected} answered cases without them" if answered > with_expected
                       else "") + (f"; {failed} failed cases are left out" if failed else "") + ".")
    return {"results": len(results), "failed": failed, "answered": answered, "with_expected": with_expected,
            "sentence": sentence}


def _results_frame(results: Sequence[Result]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every result, and the successful ones."""
    frame = pd.DataFrame(results) if results else pd.DataFrame(
        columns=["case_id", "latency_ms", "input_tokens", "error", "started_at", "finished_at"])
    return frame, frame[frame["error"].isna()]


def latency_stats(results: Sequence[Result]) -> dict[str, Any]:
    """p50 / p95 / p99 / max / mean latency in ms over successful results, the sample count, and the time window
    (first chunk start to last result, ISO strings, plus its length in seconds)."""
    frame, ok = _results_frame(results)
    latency = pd.to_numeric(ok["latency_ms"], errors="coerce").dropna()
    # the wait before a record's batch started (the engine's x_queue_ms), apart from its compute
    queue = pd.Series([response.get("x_queue_ms") for r in results
                       if not r.get("error") and (response := r.get("response"))], dtype=float).dropna()
    def quantile(values: pd.Series, q: float) -> float | None:  # pandas' default is PERCENTILE_METHOD's
        return float(values.quantile(q)) if values.size else None

    out: dict[str, Any] = {
        "count": int(latency.size), "errors": int(len(frame) - len(ok)), "p50": quantile(latency, 0.5),
        "p95": quantile(latency, 0.95), "p99": quantile(latency, 0.99), "max": quantile(latency, 1.0),
        "mean": float(latency.mean()) if latency.size else None, "queue_count": int(queue.size),
        "queue_p50": quantile(queue, 0.5), "queue_max": quantile(queue, 1.0)}
    if len(frame):
        start = pd.to_datetime(frame["started_at"], utc=True, format="ISO8601").min()
        end = pd.to_datetime(frame["finished_at"], utc=True, format="ISO8601").max()
        out.update(window_start=start.isoformat(), window_end=end.isoformat(),
                   window_s=(end - start).total_seconds())
    else:
        out.update(window_start=None, window_end=None, window_s=0.0)
    return out


def busy_seconds(results: Sequence[Result]) -> float:
    """Length of the union of the results' [started_at, finished_at] intervals, in seconds."""
    frame, _ = _results_frame(results)
    spans = pd.DataFrame({"start": pd.to_datetime(frame["started_at"], utc=True, format="ISO8601"),
                          "end": pd.to_datetime(frame["finished_at"], utc=True, format="ISO8601")})
    spans = spans.sort_values(["start", "end"])
    # a busy stretch ends where the next interval starts after every earlier one has finished
    stretch = (spans["start"] > spans["end"].cummax().shift()).cumsum()
    merged = spans.groupby(stretch).agg(start=("start", "min"), end=("end", "max"))
    return float((merged["end"] - merged["start"]).dt.total_seconds().sum())


def throughput(results: Sequence[Result], n_questions: int) -> dict[str, float | None]:
    """records/s, decisions/s (records × questions), input tokens/s over busy time; tokens per record (mean and
    median over successful results)."""
    _, ok = _results_frame(results)
    busy = busy_seconds(results)
    tokens = pd.to_numeric(ok["input_tokens"], errors="coerce").dropna()
    records = len(ok)
    return {
        "busy_s": busy,
        "records_per_s": records / busy if busy > 0 else None,
        "decisions_per_s": records * n_questions / busy if busy > 0 else None,
        "tokens_per_s": float(tokens.sum()) / busy if busy > 0 else None,
        "tokens_per_record_mean": float(tokens.mean()) if tokens.size else None,
        "tokens_per_record_median": float(tokens.median()) if tokens.size else None,
    }


def accuracy_by_question(frame: pd.DataFrame) -> pd.DataFrame:
    """Per question: cases with an expected answer, how many the model got right, accuracy (NaN if none)."""
    if frame.empty:
        return pd.DataFrame(columns=["question_id", "n_expected", "n_correct", "accuracy"])
    grouped = frame.groupby("question_id", sort=False)["correct"]
    return pd.DataFrame({"n_expected": grouped.count(), "n_correct": grouped.sum().astype(int),
                         "accuracy": grouped.mean()}).reset_index()


def confusion_matrix(frame: pd.DataFrame, question_id: str, labels: list[str] | None = None) -> pd.DataFrame:
    """Counts with expected answers as rows and predicted answers as columns, over cases with an expected answer.
    `labels` (e.g. the schema's option ids) fixes the order and includes options never seen."""
    rows = frame[(frame["question_id"] == question_id) & frame["expected"].notna()]
    seen = list(dict.fromkeys(list(rows["expected"]) + list(rows["predicted"])))
    order = list(labels or []) + [x for x in seen if x not in (labels or [])]
    table = pd.crosstab(rows["expected"], rows["predicted"]) if len(rows) else pd.DataFrame()
    table = table.reindex(index=order, columns=order, fill_value=0).fillna(0).astype(int)
    table.index.name, table.columns.name = "expected", "predicted"
    return table


def score_mae(frame: pd.DataFrame) -> pd.DataFrame:
    """Per score question: mean |Σ i·p_i − expected level| over cases with an expected level."""
    rows = frame[(frame["question_type"] == "score") & frame["expected_level"].notna()]
    if rows.empty:
        return pd.DataFrame(columns=["question_id", "n_expected", "mae"])
    errors = (rows["score"] - rows["expected_level"]).abs()
    out = errors.groupby(rows["question_id"], sort=False).agg(["count", "mean"])
    return out.rename(columns={"count": "n_expected", "mean": "mae"}).reset_index()


def confidence_bins(confidence: np.ndarray, bins: int) -> np.ndarray:
    """The bin of each confidence: bin b holds [b/bins, (b+1)/bins), 1.0 goes into the last. Rounding first keeps
    0.7 (stored as 0.69999…) in the 0.7 bin rather than the one below."""
    return np.clip(np.floor(np.round(confidence * bins, 9)).astype(int), 0, bins - 1)


def brier_term(question_type: str, distribution: dict[str, float], expected: str | None) -> float:
    """One answer's Brier term: noul (P(true) − y)², choice and score Σ_k (p_k − y_k)²; NaN without an expected
    answer."""
    if expected is None:
        return np.nan
    if question_type == "noul":
        return (distribution["true"] - (expected == "true")) ** 2
    return float(sum((p - (option == expected)) ** 2 for option, p in distribution.items()))


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


def mean(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=-1)


def ece_statistic(bins: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """ECE as stats.calibration defines it, over the last axis: Σ_b |Σ_{i∈b} (correct_i − confidence_i)| / N."""
    def ece(confidence: np.ndarray, correct: np.ndarray) -> np.ndarray:
        index = confidence_bins(confidence, bins)
        gap = correct - confidence
        per_bin = [np.where(index == b, gap, 0.0).sum(axis=-1) for b in range(bins)]
        return np.abs(np.stack(per_bin)).sum(axis=0) / confidence.shape[-1]
    return ece


def brier_terms(rows: pd.DataFrame) -> np.ndarray:
    """Each row's Brier term (`brier_term`) of an answer frame."""
    return np.array([brier_term(t, d, e) for t, d, e in
                     zip(rows["question_type"], rows["distribution"], rows["expected"], strict=True)], dtype=float)


def calibration(frame: pd.DataFrame, question_id: str, bins: int = 10) -> dict[str, Any]:
    """Reliability bins, ECE and Brier score of one question over cases with an expected answer."""
    rows = frame[(frame["question_id"] == question_id) & frame["expected"].notna()]
    edges = np.round(np.linspace(0.0, 1.0, bins + 1), 10)  # 0.7, not 0.7000000000000001, in the table
    table = pd.DataFrame({"bin_low": edges[:-1], "bin_high": edges[1:], "count": 0,
                          "mean_confidence": np.nan, "accuracy": np.nan})
    if rows.empty:
        return {"bins": table, "ece": None, "brier": None, "n": 0}
    confidence = rows["confidence"].to_numpy(dtype=float)
    grouped = rows.groupby(confidence_bins(confidence, bins))
    table.update(pd.DataFrame({"count": grouped.size(), "mean_confidence": grouped["confidence"].mean(),
                               "accuracy": grouped["correct"].mean()}))
    table["count"] = table["count"].astype(int)
    filled = table[table["count"] > 0]
    ece = float((filled["count"] / len(rows) * (filled["accuracy"] - filled["mean_confidence"]).abs()).sum())
    return {"bins": table, "ece": ece, "brier": float(brier_terms(rows).mean()), "n": len(rows)}


def calibration_summary(frame: pd.DataFrame, bins: int = 10) -> pd.DataFrame:
    """ECE, Brier and sample count for every question that has expected answers."""
    rows = []
    for question_id in dict.fromkeys(frame["question_id"]):
        result = calibration(frame, question_id, bins)
        if result["n"]:
            rows.append({"question_id": question_id, "n": result["n"], "ece": result["ece"],
                         "brier": result["brier"]})
    return pd.DataFrame(rows, columns=["question_id", "n", "ece", "brier"])


def slowest_cases(results: Sequence[Result], n: int = 10) -> pd.DataFrame:
    """The n successful results with the highest latency, slowest first."""
    _, ok = _results_frame(results)
    columns = [c for c in ("case_id", "position", "latency_ms", "input_tokens") if c in ok]
    return ok.sort_values("latency_ms", ascending=False, kind="stable").head(n)[columns].reset_index(drop=True)


def least_confident(frame: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The n (case, question) answers with the smallest margin, then lowest confidence."""
    columns = ["case_id", "position", "question_id", "predicted", "confidence", "margin", "expected"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    return frame.sort_values(["margin", "confidence"], kind="stable").head(n)[columns].reset_index(drop=True)


# -- browsing a run's results -------------------------------------------------------------------------------------


def browse_table(results: Sequence[Result], schema: dict) -> pd.DataFrame:
    """One row per (case, question) for reading a run, the state as text and every option's probability as a short
    "option p" list."""
    frame = answer_frame(results, schema)
    by_case = {r["case_id"]: r for r in results}
    rows = []
    for row in frame.itertuples(index=False):
        result = by_case[row.case_id]
        rows.append({
            "case": int(row.case_id), "source id": result.get("source_id"), "question": row.question_id,
            "state": state_text(result.get("state")),
            "expected": row.expected, "predicted": row.predicted, "confidence": round(float(row.confidence), 4),
            "margin": round(float(row.margin), 4), "correct": None if pd.isna(row.correct) else bool(row.correct),
            "tags": ", ".join(result.get("tags") or []),
            "probabilities": " · ".join(f"{option} {p:.2f}" for option, p in row.distribution.items()),
        })
    return pd.DataFrame(rows, columns=["case", "source id", "question", "state", "expected", "predicted", "confidence",
                                       "margin", "correct", "tags", "probabilities"])


def filter_browse(table: pd.DataFrame, *, wrong_only: bool = False, confidence_below: float | None = None,
                  questions: list[str] | None = None, tags: list[str] | None = None, search: str = "") -> pd.DataFrame:
    """The rows of browse_table that pass every filter: answers that disagree with the expected one, confidence
    below a threshold, some questions, cases carrying any of some tags, and a case-insensitive text search over
    the source id, the state, the answers and the tags."""
    if table.empty:
        return table
    keep = pd.Series(True, index=table.index)
    if wrong_only:
        keep &= table["correct"].eq(False)
    if confidence_below is not None:
        keep &= table["confidence"] < confidence_below
    if questions:
        keep &= table["question"].isin(questions)
    if tags:
        wanted = set(tags)
        keep &= table["tags"].map(lambda text: bool(wanted & {t.strip() for t in text.split(",") if t.strip()}))
    if search.strip():
        needle = search.strip().lower()
        haystack = table[["source id", "state", "expected", "predicted", "tags", "question"]].map(
            lambda value: "" if value is None else str(value).lower())
        keep &= haystack.apply(lambda row: needle in " ".join(row), axis=1)
    return table[keep]
