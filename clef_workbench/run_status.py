"""What a run's status means to a person: `failed` when every case failed, `finished with errors` when some did,
with the count, the first error and which cases to retry. The store keeps the bare status (pending, running,
cancelled, finished, failed); the part a page must not get wrong — a run whose every case failed never reads as a
success — is decided here, from the run's counts and its error results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clef_workbench.store import Result, Run

FINISHED_WITH_ERRORS = "finished with errors"
TONES = {"failed": "error", FINISHED_WITH_ERRORS: "warning", "finished": "success"}  # any other status: "info"


@dataclass(frozen=True)
class RunOutcome:
    """A run's status as shown: `label` (pending, running, cancelled, finished, finished with errors, failed), `tone`
    (the kind of notice: info, success, warning, error), the error count, the first error, the case ids whose result
    is an error (what "Retry failed cases" sends again) and a sentence saying what happened."""

    label: str
    tone: str
    errors: int
    first_error: str | None
    failed_case_ids: list[int] = field(default_factory=list)
    message: str = ""

    @property
    def can_retry(self) -> bool:
        return bool(self.failed_case_ids) and self.label in ("failed", FINISHED_WITH_ERRORS, "cancelled")


def every_case_failed_message(errors: int, first_error: str) -> str:
    """The run's error when no case got an answer (the store's `error` of a failed run)."""
    return f"every case failed ({errors} of {errors}); the first error: {first_error}"


def status_label(run: Run) -> str:
    """The status as shown, from a run's row alone (its status and counts): a finished run whose every case failed
    reads `failed`, one with some failed cases `finished with errors`."""
    if run["status"] == "finished" and run["errors"]:
        return "failed" if run["errors"] == run["done"] else FINISHED_WITH_ERRORS
    return run["status"]


def run_outcome(run: Run, results: Sequence[Result]) -> RunOutcome:
    """The outcome of `run` (a Store.get_run row) given its results (Store.list_results rows, in case order)."""
    failed = [r for r in results if r["error"]]
    first_error = failed[0]["error"] if failed else None
    status, done, total, message = run["status"], run["done"], run["total"], ""
    if status == "failed":
        reason = run["error"] or first_error or "no reason was recorded"
        message = f"The run failed: {reason}. {done - len(failed)} of {total} cases have answers."
    elif status == "finished" and failed and len(failed) == done:
        # recorded as finished (by an older workbench, or a sweep's variant run): no case has an answer, so it failed
        status = "failed"
        message = f"The run failed: {every_case_failed_message(len(failed), str(first_error))}."
    elif status == "finished" and failed:
        status = FINISHED_WITH_ERRORS
        message = (f"Finished with errors: {len(failed)} of {total} cases failed; the first error: {first_error}. "
                   f"Statistics below use the {done - len(failed)} cases with answers.")
    elif status == "finished":
        message = f"Finished: all {total} cases have answers."
    elif status == "cancelled":
        errors = f" {len(failed)} failed; the first error: {first_error}." if failed else ""
        message = f"Cancelled with {total - done} of {total} cases left.{errors}"
    return RunOutcome(status, TONES.get(status, "info"), len(failed), first_error, [r["case_id"] for r in failed],
                      message)
