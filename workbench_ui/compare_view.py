"""What the Compare page shows, without Streamlit; the numbers come from clef_workbench.compare."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from clef_engine import DEFAULT_MAX_LENGTH
from clef_workbench import compare
from clef_workbench.casesets import plain_label
from clef_workbench.compare import CompareView, ModelChoice
from clef_workbench.jobs import EngineUnreachableError
from clef_workbench.run_status import status_label
from clef_workbench.store import Run, RunSettings
from workbench_ui import links, units
from workbench_ui.answers import distribution_table

# The one action runs as the Runs page would with its defaults.
START_SETTINGS = RunSettings(chunk_size=8, max_length=DEFAULT_MAX_LENGTH)


def missing_for_start(case_sets: list, slugs: list, models: Any, *, needs: str = "Needs",
                      case_set: str = "a case set") -> str | None:
    """What starting (the one action, or a sweep) needs that is not there yet, and where to get it."""
    missing = [what for what, there in ((f"{case_set} (Case sets page)", case_sets), ("a schema (Schemas page)", slugs),
                                        ("a loaded model (sidebar)", models)) if not there]
    return f"{needs} {' and '.join(missing)}." if missing else None


def proposed_schema(case_set: dict, slugs: list[str]) -> str:
    """The schema the one action proposes for a case set: the one it was made for, else the library's first."""
    return case_set["schema_name"] if case_set.get("schema_name") in slugs else slugs[0]


def matrix_key(disagreements_only: bool) -> str:
    """The matrix's key, one per filter: a click on the filtered grid is never lost as the old grid's selection."""
    return f"matrix.{'disagree' if disagreements_only else 'all'}"


CELL_CHAR_PX = 7  # an average character of the grid's 14 px font
CELL_PADDING_PX = 16  # the grid's cell padding, both sides


def matrix_widths(matrix: pd.DataFrame, headers: Mapping[str, str]) -> dict[str, int]:
    """Each answer column's width: its longest cell or header, so no answer is cut."""
    return {name: CELL_PADDING_PX + CELL_CHAR_PX * max([len(name), *(len(str(v)) for v in matrix[name].dropna())])
            for name in headers}

log = logging.getLogger(__name__)


def start_comparison(store: Any, runner: Any, models: list[ModelChoice], set_id: int, slug: str, number: int,
                     names: list[str]) -> tuple[list[int], str]:
    """The one action: a run of the schema version per model; the runs started (oldest first) and the message."""
    choices = {c.name: c.engine for c in models}
    engines = {name: choices[name] for name in names if name in choices}
    if not engines:
        return [], "Pick at least one loaded model."
    try:
        schema = dict(store.get_schema_version_number(slug, number)["schema"])
    except KeyError as exc:
        return [], f"Not started: {exc}"
    schema.pop("examples", None)  # as the Runs page keeps it
    try:
        run_ids = compare.start_runs(store, runner, set_id, schema, engines,
                                     settings=replace(START_SETTINGS, schema_slug=slug))
    except EngineUnreachableError as exc:  # checked before any run is recorded: none is left pending
        return [], str(exc)
    except Exception as exc:  # noqa: BLE001 — any other failure: a message, no traceback
        log.exception("the comparison's runs did not start")
        return [], f"Not started: {type(exc).__name__}: {exc}"
    return run_ids, f"Started run(s) {', '.join(f'#{r}' for r in run_ids)}."


def started_run_line(run: Run) -> str:
    return (f"Run [#{run['id']}](/runs?run={run['id']}) · {run['model_id']} · {status_label(run)} · "
            f"{run['done']}/{run['total']} cases")


def is_unfinished(run: Run) -> bool:
    return run["status"] in ("pending", "running")


def missing_runs(linked: list[int], all_runs: Mapping[int, Run]) -> links.Missing | None:
    """The "not found" of a link to runs that are not here, with the runs there are; None when all are here."""
    gone = [r for r in linked if r not in all_runs]
    if not gone:
        return None
    return links.missing("run(s)", ", ".join(f"#{r}" for r in gone), sorted(all_runs),
                         lambda r: f"#{r} {all_runs[r]['case_set_name']} · {all_runs[r]['model_id']}", param="runs")


def case_set_label(group: list[Run]) -> str:
    return f"{group[0]['case_set_name']} ({len(group)} runs)"


def run_label(run: Run) -> str:
    """A run in the selector; "(unsaved)" when it ran a schema that is not a saved version."""
    return (f"#{run['id']} {run['model_id']} · {run['schema_name']} v{run['schema_version']}"
            + ("" if run["schema_version_id"] else " (unsaved)") + f" · {status_label(run)}")


def default_runs(linked: list[int], run_ids: Sequence[int]) -> list[int]:
    """The runs that open first: those the link names, else the newest two, oldest first."""
    return [r for r in linked if r in run_ids] or sorted(run_ids)[-2:]


@dataclass(frozen=True)
class AnswerShown:
    question_id: str
    text: str  # "`team`: **billing** (0.913)"
    chart: pd.DataFrame  # answers.distribution_table's rows, for answers.probability_chart


@dataclass(frozen=True)
class RunColumn:
    title: str
    error: str | None
    answers: list[AnswerShown]
    latency: str | None  # "compute 412.0 ms"; None when the run recorded none


@dataclass(frozen=True)
class CaseShown:
    case_id: int
    state: Any
    expected: str | None  # "Expected: team = billing, urgent = true"; None without expected answers
    runs: list[RunColumn]


def case_shown(view: CompareView, case_id: int) -> CaseShown | None:
    """One case as every run answered it; None when no run of the comparison has a result for it."""
    detail = compare.case_detail(view, case_id)
    if detail is None:
        return None
    questions_of = {run.label: run.run["schema"]["questions"] for run in view.runs}
    columns = []
    for run in detail["runs"]:
        answers = [AnswerShown(question_id,
                               f"`{question_id}`: **{plain_label(answer['predicted'])}** ({answer['confidence']:.3f})",
                               distribution_table(questions_of[run["run"]].get(question_id, {}),
                                                  answer["probabilities"], answer["predicted"]))
                   for question_id, answer in run["answers"].items()]
        latency = None if run["latency_ms"] is None else f"compute {units.duration(run['latency_ms'])}"
        columns.append(RunColumn(run["run"], run["error"], answers, latency))
    expected = ("Expected: " + ", ".join(f"{q} = {plain_label(v)}" for q, v in detail["expected"].items())
                if detail["expected"] else None)
    return CaseShown(case_id, detail["state"], expected, columns)


def no_result_message(case_id: int) -> str:
    return f"Case {case_id} has no result in these runs."
