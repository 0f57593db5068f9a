"""Sweeps in the background: a process-wide SweepRunner owns one thread per running sweep, so a sweep goes on when
the person switches pages or reloads (as clef_workbench.jobs does for runs). The work is clef_workbench.sweeps'
`run_sweep`, which stores each case's answers as it finishes them: a sweep stopped here (cancel, a crash) resumes
with the cases left."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from clef_workbench import sweeps
from clef_workbench.jobs import BackgroundThreads, JobAlreadyRunningError, LiveThread
from clef_workbench.sweeps import SweepProgress

log = logging.getLogger(__name__)


@dataclass
class LiveSweep(LiveThread):
    progress: SweepProgress | None = None  # the last progress run_sweep reported
    error: str | None = None  # what stopped the thread, when run_sweep raised


class SweepRunner(BackgroundThreads[LiveSweep]):
    """Starts, cancels and reports on sweeps. Create one per process (the workbench caches it as a resource)."""

    def __init__(self, store: Any):
        super().__init__()
        self.store = store

    def start(self, sweep_id: int, engine: Any) -> None:
        """Run (or resume) the sweep's unfinished cases in a background thread."""
        with self._lock:
            if self.is_running(sweep_id):
                raise JobAlreadyRunningError(f"sweep #{sweep_id} is already running")
            thread = threading.Thread(target=self._work, args=(sweep_id, engine), name=f"clef-sweep-{sweep_id}",
                                      daemon=True)
            self._live[sweep_id] = LiveSweep(thread)
        thread.start()

    def live(self, sweep_id: int) -> LiveSweep | None:
        """The sweep's last thread here (its last progress, what stopped it); None when none was started here."""
        return self._live.get(sweep_id)

    def _work(self, sweep_id: int, engine: Any) -> None:
        live = self._live[sweep_id]

        def report(progress: SweepProgress) -> None:
            live.progress = progress

        try:
            sweeps.run_sweep(self.store, sweep_id, engine, progress=report, stop=live.cancel.is_set)
        except Exception as exc:  # noqa: BLE001 — the page says what stopped it; its finished cases are stored
            live.error = f"{type(exc).__name__}: {exc}"
            log.error("sweep %s stopped: %s", sweep_id, live.error, exc_info=exc)
