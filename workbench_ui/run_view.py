"""What the Runs page shows about runs, as text and choices (no Streamlit here): the run selector's labels, the
baselines a run can be compared with, and durations in a unit a person reads at a glance."""

from __future__ import annotations

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


def has_answers(run: dict) -> bool:
    return run["done"] > run["errors"]


def comparison_baselines(runs: list[dict], run: dict) -> tuple[list[dict], int]:
    """The runs `run` can be compared with: the other runs of its case set that have at least one answer, newest
    first (the first is the default); and how many were left out because every case of theirs failed."""
    same_set = [r for r in runs if r["case_set_id"] == run["case_set_id"] and r["id"] != run["id"] and r["done"]]
    usable = [r for r in same_set if has_answers(r)]
    return usable, len(same_set) - len(usable)


