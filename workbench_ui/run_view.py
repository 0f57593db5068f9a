"""What the Runs page shows about runs, as text and choices (no Streamlit here): the run selector's labels, the
baselines a run can be compared with, and durations in a unit a person reads at a glance."""

from __future__ import annotations

from typing import Any

from clef_engine.errors import ClefError
from clef_workbench.run_status import FINISHED_WITH_ERRORS, status_label

STATUS_ICONS = {"pending": "⏳", "running": "▶️", "cancelled": "⏹️", "finished": "✅", FINISHED_WITH_ERRORS: "⚠️",
                "failed": "❌"}


def run_label(run: dict) -> str:
    """A run in the selector. The label is drawn with the page, while the progress bar beside it refreshes on its
    own: a running run's label names no count (which would go stale: "8/50" beside a bar at 40/50); an ended
    run's counts no longer change."""
    label = status_label(run)
    counts = "running" if label == "running" else f"{run['done']}/{run['total']} · {label}"
    return (f"#{run['id']} {STATUS_ICONS.get(label, '')} {run['case_set_name']} · {run['schema_name']} "
            f"v{run['schema_version']} · {run['model_id']} · {counts}")


def surfaces_stale(drawn_label: str | None, drawn_running: list[int] | None, run_now: dict,
                   running_now: list[int]) -> bool:
    """Whether what the page drew (the run selector's status of the run, the sidebar's running runs) no longer says
    what the database says: the run ended (a run refused case by case fails within a second) between their drawing
    and the progress check. The page is then drawn again, so every surface shows the same status."""
    return (drawn_label is not None and drawn_label != status_label(run_now)) or \
        (drawn_running is not None and drawn_running != running_now)


def schema_over_budget(engine: Any, questions: dict, max_length: int) -> str | None:
    """Said before a run starts whose schema alone (with an empty state) does not fit max_length: every case would
    be refused. None when it fits, or where the engine does not count tokens here (a remote endpoint)."""
    try:
        counts = engine.count_tokens({"state": "", "questions": questions}, max_length=max_length)
    except ClefError as exc:
        return f"The engine refuses this schema: {exc}"
    if not counts or not counts["fixed_tokens_over"]:
        return None
    fixed = counts["total"] - counts["state"]
    return (f"The schema alone takes {fixed:,} tokens with an empty state, more than max_length {max_length:,}: "
            f"every case would be refused. Raise max_length above {fixed:,} (or shorten the questions) to start.")


def has_answers(run: dict) -> bool:
    return run["done"] > run["errors"]


def comparison_baselines(runs: list[dict], run: dict) -> tuple[list[dict], int]:
    """The runs `run` can be compared with: the other runs of its case set that have at least one answer, newest
    first (the first is the default); and how many were left out because every case of theirs failed."""
    same_set = [r for r in runs if r["case_set_id"] == run["case_set_id"] and r["id"] != run["id"] and r["done"]]
    usable = [r for r in same_set if has_answers(r)]
    return usable, len(same_set) - len(usable)


