"""Compare two or more runs of one case set: different models, schema versions, or a local and a remote model.

The questions analysts bring: "is Flash good enough for this schema?", "did my new wording help?", "does our local
Clef agree with the hosted service?". Everything here is a plain function of runs as the store returns them
(`Store.get_run` + `Store.list_results`, bundled as `RunData`); `load_runs` fetches them. Definitions of the
predicted answer, confidence, accuracy, ECE and Brier are `stats.py`'s, so the numbers match the run page.

Intervals are percentile bootstrap intervals over cases (a case is the unit that was sampled, not a (case,
question) pair), seeded so the same runs give the same numbers. Cases a run has no successful result for are left
out of that run's numbers and of every pair it is in; `n` says how many cases each number rests on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

from clef_workbench import calibration, schema_diff, stats
from clef_workbench.jobs import EngineUnreachableError, check_engine
from clef_workbench.stats import DEFAULT_BOOTSTRAP, DEFAULT_LEVEL, bootstrap_interval, ece_statistic, mean
from clef_workbench.store import Result, Run, RunSettings

QUALITY_METRICS = ("accuracy", "ece", "brier")
LATENCY_METRICS = ("latency_p50_ms", "latency_mean_ms")
Statistic = Callable[..., np.ndarray]  # per-case columns → the statistic (bootstrapped along the last axis)


@dataclass(frozen=True)
class RunData:
    """One run as the store gives it: `run` from Store.get_run, `results` from Store.list_results."""

    run: Run
    results: list[Result]

    @property
    def id(self) -> int:
        return self.run["id"]

    @property
    def label(self) -> str:
        """Short and unique among runs: `#id model · schema vN`."""
        model = self.run["model_id"].rstrip("/").rsplit("/", 1)[-1] or "?"
        # a run from the store whose schema content was never saved in the library links no version
        unsaved = " (unsaved)" if "schema_version_id" in self.run and self.run["schema_version_id"] is None else ""
        return f"#{self.id} {model} · {self.run['schema_name']} v{self.run['schema_version']}{unsaved}"


def load_runs(store: Any, run_ids: Sequence[int]) -> list[RunData]:
    """Runs and their results from the store, checked to be comparable (see `check_comparable`)."""
    runs = [RunData(store.get_run(run_id), store.list_results(run_id)) for run_id in run_ids]
    check_comparable(runs)
    return runs


def start_runs(store: Any, runner: Any, case_set_id: int, schema: dict, engines: Mapping[str, Any], *,
               settings: RunSettings = RunSettings()) -> list[int]:
    """One run of `schema` on the case set per engine, its key the run's model_id, all started on `runner` at once
    (each in its own thread: a remote endpoint answers while the local GPU works); the run ids, in order. Every
    remote endpoint is checked before any run is recorded: one that does not answer raises EngineUnreachableError
    naming its model, and no run is started, so the comparison asked for is not half made."""
    if not engines:
        raise ValueError("pick at least one model to run")
    for name, engine in engines.items():
        try:
            check_engine(engine)
        except EngineUnreachableError as exc:
            raise EngineUnreachableError(f"No run was started: the endpoint of {name} did not answer a check "
                                         f"request ({exc.__cause__ or exc}).") from exc
    run_ids = [store.create_run(case_set_id, schema=schema, model_id=name,
                                model_revision=(engine.info() or {}).get("revision"), settings=settings)
               for name, engine in engines.items()]
    for run_id, engine in zip(run_ids, engines.values(), strict=True):
        runner.start(run_id, engine, check=False)  # checked above, before the runs were recorded
    return run_ids


def check_comparable(runs: Sequence[RunData]) -> None:
    """Two or more distinct runs of one case set; raises ValueError saying which runs differ."""
    if len(runs) < 2:
        raise ValueError(f"pick at least two runs to compare (got {len(runs)})")
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a run is listed twice: {ids}")
    case_sets = {r.run["case_set_id"] for r in runs}
    if len(case_sets) > 1:
        detail = ", ".join(f"run {r.id} → case set {r.run['case_set_id']}" for r in runs)
        raise ValueError(f"runs of different case sets cannot be compared case by case ({detail})")


def answers(runs: Sequence[RunData]) -> pd.DataFrame:
    """`stats.answer_frame` of every run, stacked, with `run_id`, `run` (label) and `brier` columns."""
    frames = []
    for run in runs:
        frame = stats.answer_frame(run.results, run.run["schema"])
        frame.insert(0, "run", run.label)
        frame.insert(0, "run_id", run.id)
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    frame["brier"] = stats.brier_terms(frame)
    return frame


def _p50(values: np.ndarray) -> np.ndarray:
    return np.percentile(values, 50, axis=-1, method=stats.PERCENTILE_METHOD)


def _metric_columns(rows: pd.DataFrame, metric: str, bins: int) -> tuple[list[np.ndarray], Statistic]:
    """The per-case columns a quality metric is computed from, and the statistic over them."""
    if metric == "accuracy":
        return [rows["correct"].to_numpy(float)], mean
    if metric == "brier":
        return [rows["brier"].to_numpy(float)], mean
    return [rows["confidence"].to_numpy(float), rows["correct"].to_numpy(float)], ece_statistic(bins)


# ---- the comparisons ----------------------------------------------------------------------------------------------


def _pairs(frame: pd.DataFrame, runs: Sequence[RunData]) -> Iterator[tuple[RunData, RunData, pd.DataFrame]]:
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
            low, high = bootstrap_interval([same], mean, n_boot=n_boot, level=level, seed=seed)
            rows.append({"question_id": question_id, "run_a": a.label, "run_b": b.label, "run_a_id": a.id,
                         "run_b_id": b.id, "n": len(group), "agreements": int(same.sum()),
                         "agreement": float(same.mean()), "low": low, "high": high,
                         "flips": int(len(group) - same.sum()),
                         "flipped_case_ids": group.loc[same == 0, "case_id"].tolist()})
    columns = ["question_id", "run_a", "run_b", "run_a_id", "run_b_id", "n", "agreements", "agreement", "low",
               "high", "flips", "flipped_case_ids"]
    return pd.DataFrame(rows, columns=columns)


def flips(runs: Sequence[RunData]) -> pd.DataFrame:
    """Every (pair of runs, question, case) where the two runs' answers differ: both answers and confidences, the
    expected answer, and the change from run a to run b: fixed, broken, both wrong, or no expected answer."""
    check_comparable(runs)
    frame = answers(runs)
    parts = []
    for a, b, joined in _pairs(frame, runs):
        flipped = joined[joined["predicted_a"] != joined["predicted_b"]].copy()
        flipped["run_a"], flipped["run_b"], flipped["run_a_id"], flipped["run_b_id"] = a.label, b.label, a.id, b.id
        flipped["change"] = ["no expected answer" if np.isnan(x) or np.isnan(y) else
                             {(0, 1): "fixed", (1, 0): "broken"}.get((int(x), int(y)), "both wrong")
                             for x, y in zip(flipped["correct_a"], flipped["correct_b"], strict=True)]
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

    def add(run: RunData, question_id: str | None, metric: str, columns: list[np.ndarray],
            statistic: Statistic) -> None:
        n = len(columns[0])
        low, high = bootstrap_interval(columns, statistic, n_boot=n_boot, level=level, seed=seed)
        rows.append({"run_id": run.id, "run": run.label, "question_id": question_id, "metric": metric,
                     "value": float(statistic(*columns)) if n else np.nan, "low": low, "high": high, "n": n})

    for run in runs:
        mine = frame[(frame["run_id"] == run.id) & frame["expected"].notna()]
        for question_id, group in mine.groupby("question_id", sort=False):
            for metric in QUALITY_METRICS:
                add(run, str(question_id), metric, *_metric_columns(group, metric, bins))
        latency = np.array([r["latency_ms"] for r in run.results
                            if not r["error"] and r["response"] and r["latency_ms"] is not None], dtype=float)
        for metric, statistic in zip(LATENCY_METRICS, (_p50, mean), strict=True):
            add(run, None, metric, [latency], statistic)
    return pd.DataFrame(rows, columns=["run_id", "run", "question_id", "metric", "value", "low", "high", "n"])


MATRIX_VALUES = ("predicted", "confidence", "correct")


def case_matrix(runs: Sequence[RunData], *, value: str = "predicted", question_ids: Sequence[str] | None = None,
                disagreements_only: bool = False) -> pd.DataFrame:
    """Cases × runs to browse, in case-set order: per question the expected answer and each run's `value` (predicted
    answer, its confidence, or whether it was right). A failed case shows `error: …` as its answer (NaN for the
    numbers), a case not run yet None. `disagreements_only` keeps the cases where two runs' answers (or an answer
    and a failure) to some shown question differ."""
    if value not in MATRIX_VALUES:
        raise ValueError(f"value must be one of {MATRIX_VALUES}, not {value!r}")
    check_comparable(runs)
    frame = answers(runs)
    questions: list[str] = list(question_ids) if question_ids is not None else list(
        dict.fromkeys(q for run in runs for q in run.run["schema"]["questions"]))
    cases: dict[int, dict] = {}
    for run in runs:
        for result in run.results:
            case = cases.setdefault(result["case_id"], {"position": result["position"]})
            if result["error"] and value == "predicted":
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


# ---- the Compare page's view-model ---------------------------------------------------------------------------------

COMPARE_PAGE = "/compare"


def compare_link(run_ids: Sequence[int], case_id: int | None = None) -> str:
    """The Compare page showing these runs (and one case opened): a link to send."""
    link = f"{COMPARE_PAGE}?runs={','.join(str(r) for r in run_ids)}"
    return link if case_id is None else f"{link}&case={case_id}"


def parse_run_ids(text: str | None) -> list[int]:
    """Run ids from a URL parameter ("3,4"); anything that is not a number is left out."""
    return [int(part) for part in (text or "").split(",") if part.strip().isdigit()]


def runs_by_case_set(runs: Sequence[Run]) -> dict[int, list[Run]]:
    """Runs (Store.list_runs, newest first) grouped by case set, only case sets with two runs or more."""
    grouped: dict[int, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run["case_set_id"], []).append(run)
    return {set_id: group for set_id, group in grouped.items() if len(group) >= 2}


@dataclass(frozen=True)
class ModelChoice:
    name: str  # the runs' model_id and the requests' `model`
    label: str
    engine: Any
    is_demo: bool


def model_choices(manager: Any) -> list[ModelChoice]:
    """The models this process holds (a model_loader.ModelManager's), to run a case set on."""
    return [ModelChoice(m.name, m.label, m.engine, bool(m.is_demo)) for m in manager.loaded() if m.engine is not None]


def side_by_side(table: pd.DataFrame) -> pd.DataFrame:
    """`metrics` as one row per (question, metric) and one column per run, each cell "value [low, high] n=…"."""
    if table.empty:
        return pd.DataFrame()
    cells = table.assign(
        question=table["question_id"].fillna("(all)"),
        cell=[f"– (n={n})" if np.isnan(v) else f"{v:.{d}f} [{lo:.{d}f}, {hi:.{d}f}] n={n}"
              for v, lo, hi, n, d in zip(table["value"], table["low"], table["high"], table["n"],
                                         [1 if m in LATENCY_METRICS else 3 for m in table["metric"]], strict=True)])
    wide = cells.pivot_table(index=["question", "metric"], columns="run", values="cell", aggfunc="first", sort=False)
    return wide[[label for label in dict.fromkeys(table["run"]) if label in wide.columns]].reset_index()


@dataclass(frozen=True)
class CompareView:
    """What the Compare page shows, computed once per choice of runs."""

    runs: list[RunData]
    agreement: pd.DataFrame  # per question and pair: n, agreement, its interval, flips, the flipped cases
    flips: pd.DataFrame  # one row per flipped (pair, question, case), with a link opening the case
    metrics: pd.DataFrame  # side by side: (question, metric) × runs
    matrix: pd.DataFrame  # cases × (question · run): a summary of the state, "answer (confidence)", a link
    verdicts: pd.DataFrame  # the matrix's shape: "pass" / "fail" for answers with an expected one, else None
    headers: dict[str, str]  # a compact column name ("team · #12") -> the run it shows, in full
    schema_changes: list[tuple[str, str, str]]  # (run a, run b, readable diff) where their schemas differ
    # with calibrated probabilities: run label → the calibration applied to it (None: none fits, shown raw)
    calibrations: dict[str, str | None] = field(default_factory=dict)

    @property
    def run_ids(self) -> list[int]:
        return [run.id for run in self.runs]


def build_view(store: Any, run_ids: Sequence[int], *, n_boot: int = DEFAULT_BOOTSTRAP, level: float = DEFAULT_LEVEL,
               disagreements_only: bool = False, calibrated: bool = False) -> CompareView:
    """The comparison of runs from the store (ValueError when they cannot be compared: fewer than two, or of
    different case sets). `calibrated`: each run's probabilities as the newest calibration fitted for its schema and
    model maps them (a run without one stays raw), so agreement, metrics, the matrix and the case all read them."""
    runs = load_runs(store, run_ids)
    applied: dict[str, str | None] = {}
    if calibrated:
        mapped = []
        for run in runs:
            stored = calibration.for_run(store, run.run)
            applied[run.label] = None if stored is None else stored["name"]
            mapped.append(run if stored is None else RunData(run.run, calibration.calibrated_results(stored,
                                                                                                  run.results)))
        runs = mapped
    ids = [run.id for run in runs]
    agree = agreement(runs, n_boot=n_boot, level=level)
    agree = agree.assign(
        interval=[f"[{lo:.2f}, {hi:.2f}]" for lo, hi in zip(agree["low"], agree["high"], strict=True)],
        flipped=[", ".join(f"#{c}" for c in cases) for cases in agree["flipped_case_ids"]],
    )[["question_id", "run_a", "run_b", "n", "agreement", "interval", "flips", "flipped"]]
    flipped = flips(runs)
    flipped = flipped.assign(open=[compare_link(ids, c) for c in flipped["case_id"]])
    flat, verdicts, headers = matrix_table(runs, disagreements_only=disagreements_only)
    flat["open"] = [compare_link(ids, c) for c in flat["case"]]
    verdicts["open"] = None
    changes = []
    for a, b in combinations(runs, 2):
        diff = schema_diff.diff_schemas(a.run["schema"], b.run["schema"])
        if diff:
            changes.append((a.label, b.label, schema_diff.diff_text(diff)))
    return CompareView(runs, agree, flipped, side_by_side(metrics(runs, n_boot=n_boot, level=level)), flat,
                       verdicts, headers, changes, applied)


STATE_LINE_CHARS = 80
VERDICT_STYLES = {"pass": "background-color: #d9f2e3", "fail": "background-color: #fbdada"}


def _cut(text: str, chars: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= chars else line[: chars - 1].rstrip() + "…"


def state_summary(state: Any) -> str:
    """A case's state as one short line for a table row: a text's first line; a record's values in order, each cut
    to its share of the line (a long first field must not fill it), its ids left out (they name the case, the case
    column does that)."""
    if isinstance(state, str):
        return _cut(next((part for part in state.splitlines() if part.strip()), ""), STATE_LINE_CHARS)
    if not isinstance(state, dict):
        return _cut(json.dumps(state, ensure_ascii=False), STATE_LINE_CHARS)
    values = [value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
              for name, value in state.items()
              if not (str(name).lower() == "id" or str(name).lower().endswith(("_id", "-id", " id")))
              and value not in ("", None)]
    share = max(24, STATE_LINE_CHARS // max(1, len(values)))
    return _cut(" · ".join(_cut(value, share) for value in values), STATE_LINE_CHARS)


def matrix_table(runs: Sequence[RunData], *, disagreements_only: bool = False
                 ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, str]]:
    """The cases × runs grid as promptfoo draws it: per row the case, its position and a summary of its state;
    per question the expected answer and each run's "answer (confidence)" under a compact header (`team · #12`);
    beside it the verdict of each cell (pass / fail against the expected answer, None without one or for a
    failed case) and the full run label of each compact header."""
    predicted = case_matrix(runs, disagreements_only=disagreements_only)
    confidence = case_matrix(runs, value="confidence", disagreements_only=disagreements_only)
    correct = case_matrix(runs, value="correct", disagreements_only=disagreements_only)
    states = {r["case_id"]: r["state"] for run in runs for r in run.results}
    table = pd.DataFrame({"case": list(predicted.index), "position": predicted[("position", "")].tolist(),
                          "state": [state_summary(states.get(c, "")) for c in predicted.index]})
    verdicts = pd.DataFrame(None, index=table.index, columns=table.columns, dtype=object)
    labels = {run.label: run for run in runs}
    headers: dict[str, str] = {}
    for question_id, column in predicted.columns[1:]:
        run = labels.get(column)
        name = f"{question_id} · {'expected' if run is None else f'#{run.id}'}"
        headers[name] = "the case set's expected answer" if run is None else run.label
        answers_ = predicted[(question_id, column)].tolist()
        if run is not None:
            answers_ = [answer if pd.isna(p) or answer is None else f"{answer} ({p:.2f})"
                        for answer, p in zip(answers_, confidence[(question_id, column)].tolist(), strict=True)]
            verdicts[name] = [None if pd.isna(v) else "pass" if v else "fail"
                              for v in correct[(question_id, column)].tolist()]
        else:
            verdicts[name] = None
        table[name] = answers_
    return table, verdicts, headers


def matrix_styles(matrix: pd.DataFrame, verdicts: pd.DataFrame) -> pd.DataFrame:
    """CSS per cell of the matrix, for pandas' Styler.apply(axis=None, verdicts=…): green a pass, red a fail."""
    return verdicts.reindex(index=matrix.index, columns=matrix.columns).apply(
        lambda column: column.map(lambda v: VERDICT_STYLES.get(v, "")))


def case_detail(view: CompareView, case_id: int) -> dict | None:
    """One case as every run answered it: state, expected answers, and per run its answers (predicted,
    confidence, probabilities) or error and latency. None when no run has a result for the case."""
    per_run: list[dict] = []
    case: dict | None = None
    for run in view.runs:
        result = next((r for r in run.results if r["case_id"] == case_id), None)
        if result is None:
            per_run.append({"run": run.label, "error": "no result yet", "answers": {}, "latency_ms": None})
            continue
        case = case or {"case_id": case_id, "state": result["state"], "expected": result["expected"],
                        "tags": result.get("tags") or []}
        frame = stats.answer_frame([result], run.run["schema"])
        answers_ = {row.question_id: {"predicted": row.predicted, "confidence": float(row.confidence),
                                      "probabilities": row.distribution} for row in frame.itertuples()}
        per_run.append({"run": run.label, "error": result["error"], "answers": answers_,
                        "latency_ms": result["latency_ms"]})
    if case is None:
        return None
    return {**case, "runs": per_run}
