"""What the Runs page shows, without Streamlit; the numbers come from clef_workbench.stats."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pandas as pd

from clef_engine.errors import ClefError
from clef_workbench import calibration, casesets, stats
from clef_workbench.run_status import FINISHED_WITH_ERRORS, status_label
from clef_workbench.store import Run, RunSettings, StoreError, Sweep
from workbench_ui import links, units
from workbench_ui.cases_view import ExportFiles, export_stem, when

STATUS_ICONS = {"pending": "⏳", "running": "▶️", "cancelled": "⏹️", "finished": "✅", FINISHED_WITH_ERRORS: "⚠️",
                "failed": "❌"}


def run_label(run: dict) -> str:
    """A run in the selector; a running run's label names no count (it would go stale beside the bar)."""
    label = status_label(run)
    counts = "running" if label == "running" else f"{run['done']}/{run['total']} · {label}"
    return (f"#{run['id']} {STATUS_ICONS.get(label, '')} {run['case_set_name']} · {run['schema_name']} "
            f"v{run['schema_version']} · {run['model_id']} · {counts}")


def surfaces_stale(drawn_label: str | None, drawn_running: list[int] | None, run_now: dict,
                   running_now: list[int]) -> bool:
    """Whether the selector's or the sidebar's status no longer matches the database (the page is drawn again)."""
    return (drawn_label is not None and drawn_label != status_label(run_now)) or \
        (drawn_running is not None and drawn_running != running_now)


def schema_over_budget(engine: Any, questions: dict, max_length: int) -> str | None:
    """Why a run would refuse every case (the schema alone is over max_length); None when it fits."""
    try:
        counts = engine.count_tokens({"state": "", "questions": questions}, max_length=max_length)
    except ClefError as exc:
        return f"The engine refuses this schema: {exc}"
    if not counts or not counts["fixed_tokens_over"]:
        return None
    fixed = counts["total"] - counts["state"]
    return (f"The schema alone takes {fixed:,} tokens with an empty state, more than max_length {max_length:,}: "
            f"every case would be refused. Raise max_length above {fixed:,} (or shorten the questions) to start.")


def comparison_baselines(runs: list[dict], run: dict) -> tuple[list[dict], int]:
    """The other runs of the set with answers, newest first, and how many were left out (all failed)."""
    same_set = [r for r in runs if r["case_set_id"] == run["case_set_id"] and r["id"] != run["id"] and r["done"]]
    usable = [r for r in same_set if r["done"] > r["errors"]]
    return usable, len(same_set) - len(usable)


def model_button(label: str, models_busy: bool) -> tuple[str, bool]:
    """A button that runs on a model, as (label, disabled): "Model loading…" while a model loads."""
    return ("Model loading…", True) if models_busy else (label, False)


def run_engine(models: Any, model_id: str) -> tuple[Any, str | None]:
    """The engine a run resumes on (the model it started on), or None and why."""
    try:
        return models.get(model_id), None
    except KeyError as exc:
        return None, (f"This run was started on the model {model_id!r}, which is not loaded: {exc.args[0]}. Add it "
                      "in the sidebar (Add a model), then try again.")


def create_run(store: Any, case_set_id: int, schema: dict, schema_slug: str, model_id: str, engine_info: dict,
               *, chunk_size: int, max_length: int, overflow: str) -> int:
    schema = {k: v for k, v in schema.items() if k != "examples"}
    return store.create_run(case_set_id, schema=schema, model_id=model_id, model_revision=engine_info.get("revision"),
                            settings=RunSettings(chunk_size=chunk_size, max_length=max_length, overflow=overflow,
                                                 schema_slug=schema_slug, device=engine_info.get("device"),
                                                 dtype=engine_info.get("dtype"),
                                                 precision=engine_info.get("precision")))


def sweep_rows(sweeps: list[Sweep]) -> list[dict[str, Any]]:
    return [{"sweep": s["id"], "status": s["status"], "case set": s["case_set_name"], "schema": s["schema_name"],
             "variants": s["variant_count"], "done": s["done"], "total": s["total"], "model": s["model_id"],
             "created": when(s["created_at"]), "open": links.sweep_url(s["id"])} for s in sweeps]


def settings_caption(run: Run) -> str:
    settings = run["settings"]
    return (f"Schema **{run['schema_name']} v{run['schema_version']}** · model **{run['model_id']}**"
            f"{' @ ' + run['model_revision'] if run['model_revision'] else ''} · batch "
            f"{settings.chunk_size or '?'} · max_length {settings.max_length or '?'} "
            f"({settings.overflow}) · started {(run['started_at'] or '–')[:19]}")


def error_rows(results: list[dict]) -> list[dict]:
    return [{"case": r["case_id"], "error": r["error"]} for r in results if r.get("error")]


def answers(results: list[dict], schema: dict) -> tuple[pd.DataFrame, dict]:
    frame = stats.answer_frame(results, schema)
    return frame, stats.coverage(results, frame)


@dataclass(frozen=True)
class Browse:
    table: pd.DataFrame  # every answer, with links to open its case in Decide and in Review
    tags: list[str]  # the tags the filter offers


def browse(run_id: int, results: list[dict], schema: dict) -> Browse:
    table = stats.browse_table(results, schema)
    table = table.assign(decide=[links.decide_url(run_id, case) for case in table["case"]],
                         review=[links.review_url(run_id, case, question)
                                 for case, question in zip(table["case"], table["question"], strict=True)])
    return Browse(table, sorted({t for r in results for t in (r.get("tags") or [])}))


def browsed(table: pd.DataFrame, **filters: Any) -> tuple[pd.DataFrame, str, str]:
    """The rows the filters keep, the caption, and a digest of them for the table's key."""
    shown = stats.filter_browse(table, **filters)
    caption = (f"{len(shown)} of {len(table)} answers. Select a row to open its case in Decide (its state and this "
               "run's questions, to ask again) or in Review; “Open” does the same in a new tab, and the links can be "
               "sent.")
    return shown, caption, hashlib.sha1("\n".join(shown["review"]).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Metric:
    label: str
    value: str
    help: str | None = None


COMPUTE_HELP = ("A record's compute: the time of the engine batch it ran in, times its share of that batch's tokens "
                "(the engine's x_compute_ms). Waiting behind earlier batches is not in it.")
QUEUE_HELP = ("How long a record's batch waited in the engine's queue before it started (behind this run's previous "
              "batch, other runs, or Decide requests): the engine's x_queue_ms.")


@dataclass(frozen=True)
class Speed:
    latency: list[Metric]
    latency_notes: list[str]
    throughput: list[Metric]
    throughput_note: str


def speed(results: list[dict], question_count: int) -> Speed:
    latency = stats.latency_stats(results)
    rates = stats.throughput(results, question_count)
    batches = len({(r["started_at"], r["finished_at"]) for r in results if not r.get("error")})
    tokens = ("–" if rates["tokens_per_record_mean"] is None else f"{rates['tokens_per_record_mean']:,.0f} "
              f"(median {rates['tokens_per_record_median']:,.0f})")
    return Speed(
        [*(Metric(f"{name} compute per record", units.duration(latency[key]), COMPUTE_HELP)
           for name, key in (("p50", "p50"), ("p95", "p95"), ("p99", "p99"), ("max", "max"))),
         Metric("p50 queue wait", units.duration(latency["queue_p50"]), QUEUE_HELP),
         Metric("samples", f"{latency['count']}", f"{latency['errors']} error results excluded")],
        [f"n = {latency['count']} records in {batches} batch(es); {latency['errors']} failed cases left out. Compute "
         "per record = its batch's time split by the records' token shares; queue wait (max "
         f"{units.duration(latency['queue_max'])}) is shown apart. Runs recorded before the engine reported compute "
         "show each record's time from submission to answer instead.",
         f"Window {str(latency['window_start'])[:19]} → {str(latency['window_end'])[:19]} UTC "
         f"({latency['window_s']:.1f} s); percentiles use linear interpolation (numpy 'linear')."],
        [Metric("records/s", units.rate(rates["records_per_s"], "rec")),
         Metric("decisions/s", units.rate(rates["decisions_per_s"], "dec")),
         Metric("tokens/s", units.rate(rates["tokens_per_s"], "tok")),
         Metric("tokens per record", tokens)],
        f"Throughput over {rates['busy_s']:.1f} s of busy time (pauses between cancel and resume excluded).")


@dataclass(frozen=True)
class Quality:
    accuracy: pd.DataFrame  # per question
    accuracy_rows: int  # the questions with an accuracy (the chart's rows)
    score_mae: pd.DataFrame  # empty without score questions
    confusions: list[tuple[str, pd.DataFrame]]  # (choice question, its matrix): only those with expected answers
    choice_questions: int
    calibration: pd.DataFrame  # ECE and Brier per question
    reliability: list[tuple[str, pd.DataFrame]]  # (question, its bins)


def quality(frame: pd.DataFrame, questions: dict[str, dict]) -> Quality:
    accuracy = stats.accuracy_by_question(frame)
    choices = [q for q, spec in questions.items() if spec["type"] == "choice"]
    confusions = [(q, stats.confusion_matrix(frame, q, labels=casesets.option_ids(questions[q]))) for q in choices]
    summary = stats.calibration_summary(frame)
    return Quality(accuracy, int(accuracy["accuracy"].notna().sum()), stats.score_mae(frame),
                   [(q, matrix) for q, matrix in confusions if matrix.to_numpy().sum()], len(choices), summary,
                   [(q, stats.calibration(frame, q)["bins"]) for q in summary["question_id"]])


def extremes(results: list[dict], frame: pd.DataFrame, count: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    return stats.slowest_cases(results, count), stats.least_confident(frame, count)


def fit_calibration(store: Any, run_id: int) -> tuple[str | None, tuple[str, list] | None]:
    """Fit a calibration on the run's labelled cases: (why not, None), or (None, (its name, the reports))."""
    try:
        calibration_id, reports = calibration.calibrate_run(store, run_id)
    except (calibration.CalibrationRefused, StoreError) as exc:
        return f"Not calibrated: {exc}", None
    return None, (store.get_calibration(calibration_id)["name"], reports)


def export(store: Any, run: dict, result_count: int, live: bool) -> ExportFiles:
    still_going = f" The run is still going: the files hold the {result_count} case(s) answered so far." if live else ""
    return ExportFiles(export_stem(f"run-{run['id']}-{run['case_set_name']}"),
                       casesets.export_results_jsonl(store, run["id"]), casesets.export_results_csv(store, run["id"]),
                       "One row per case × question; a failed case is one row with its error." + still_going)

