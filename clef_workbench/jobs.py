"""Background batch runs. A process-wide JobRunner owns one thread per running run, so a run keeps going when
the user switches pages or reloads; every chunk's results are committed as they arrive, so a crash loses at most
the chunk in flight and a restart resumes with the cases that have no result yet.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from clef_engine.errors import BusyError, ClefError
from clef_workbench.casesets import build_request
from clef_workbench.store import Store, now_iso

DEFAULT_CHUNK_SIZE = 8
BUSY_RETRIES = 20  # BusyError (queue full) is retried with backoff; other engine errors are per-case errors


class DecisionEngine(Protocol):
    """The part of clef_engine.Engine a batch run uses."""

    def validate(self, request: dict) -> None: ...

    def decide_many(self, requests: list[dict], *, max_length: int | None = None, overflow: str = "refuse",
                    priority: str = "bulk") -> list[dict]: ...


@dataclass
class _LiveJob:
    thread: threading.Thread
    cancel: threading.Event = field(default_factory=threading.Event)
    session_started: float = field(default_factory=time.monotonic)
    processed: int = 0  # cases finished by this thread (for the rate; earlier sessions are not counted)
    last_error: str | None = None


class JobAlreadyRunningError(RuntimeError):
    """The run already has a live job in this process."""


class JobRunner:
    """Starts, cancels and reports on batch runs. Create one per process (the UI caches it as a resource)."""

    def __init__(self, store: Store, *, chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.store = store
        self.chunk_size = chunk_size
        self._jobs: dict[int, _LiveJob] = {}
        self._lock = threading.Lock()

    def start(self, run_id: int, engine: DecisionEngine) -> None:
        """Start (or resume) a run in a background thread; only cases without a result are sent."""
        self.store.get_run(run_id)  # raises NotFoundError for a bad id before any thread starts
        with self._lock:
            job = self._jobs.get(run_id)
            if job is not None and job.thread.is_alive():
                raise JobAlreadyRunningError(f"run {run_id} is already running")
            thread = threading.Thread(target=self._work, args=(run_id, engine), name=f"clef-run-{run_id}",
                                      daemon=True)
            self._jobs[run_id] = _LiveJob(thread=thread)
        self.store.set_run_status(run_id, "running")
        thread.start()

    def cancel(self, run_id: int) -> bool:
        """Ask a live run to stop after the chunk in flight; returns False if it is not running here."""
        job = self._jobs.get(run_id)
        if job is None or not job.thread.is_alive():
            return False
        job.cancel.set()
        return True

    def is_running(self, run_id: int) -> bool:
        job = self._jobs.get(run_id)
        return job is not None and job.thread.is_alive()

    def wait(self, run_id: int, timeout: float | None = None) -> bool:
        """Block until the run's thread ends; returns True if it has ended."""
        job = self._jobs.get(run_id)
        if job is None:
            return True
        job.thread.join(timeout)
        return not job.thread.is_alive()

    def progress(self, run_id: int) -> dict[str, Any]:
        """Status from the database plus live numbers: total, done, errors, remaining, rate (cases/s in this
        session), eta_s, live (a thread in this process is working on it), interrupted (the database says
        running but no thread here is: the process that ran it stopped — resume it)."""
        run = self.store.get_run(run_id)
        job = self._jobs.get(run_id)
        live = job is not None and job.thread.is_alive()
        remaining = run["total"] - run["done"]
        rate = eta = None
        if live and job.processed:
            rate = job.processed / max(time.monotonic() - job.session_started, 1e-9)
            eta = remaining / rate
        return {
            "run_id": run_id, "status": run["status"], "total": run["total"], "done": run["done"],
            "errors": run["errors"], "remaining": remaining, "rate_per_s": rate, "eta_s": eta, "live": live,
            "cancelling": live and job.cancel.is_set(),
            "interrupted": run["status"] == "running" and not live,
            "error": run["error"] or (job.last_error if job else None),
        }

    # -- the worker thread -------------------------------------------------------------------------------------

    def _work(self, run_id: int, engine: DecisionEngine) -> None:
        job = self._jobs[run_id]
        try:
            run = self.store.get_run(run_id)
            settings = run["settings"] or {}
            chunk_size = int(settings.get("chunk_size") or self.chunk_size)
            pending = self.store.unfinished_case_ids(run_id)
            for start in range(0, len(pending), chunk_size):
                if job.cancel.is_set():
                    break
                chunk = pending[start:start + chunk_size]
                results = self._run_chunk(run, chunk, engine, settings, job)
                self.store.record_results(run_id, results)
                job.processed += len(results)
            left = self.store.unfinished_case_ids(run_id)
            self.store.set_run_status(run_id, "cancelled" if left else "finished")
        except Exception as exc:  # noqa: BLE001 — the run stops, its finished results stay; the message goes to the run page
            job.last_error = f"{type(exc).__name__}: {exc}"
            self.store.set_run_status(run_id, "failed", error=job.last_error)

    def _run_chunk(self, run: dict, case_ids: list[int], engine: DecisionEngine, settings: dict,
                   job: _LiveJob) -> list[dict]:
        started_at = now_iso()
        results: list[dict] = []
        valid: list[tuple[int, dict]] = []
        for case in self.store.get_cases(case_ids):
            request = build_request(case, run["schema"], model=run["model_id"])
            try:
                engine.validate(request)
            except ClefError as exc:  # a bad case is recorded as an error result, the run goes on
                results.append({"case_id": case["id"], "error": f"{type(exc).__name__}: {exc}",
                                "started_at": started_at, "finished_at": now_iso()})
                continue
            valid.append((case["id"], request))
        if valid:
            results.extend(self._decide(valid, engine, settings, started_at, job))
        return results

    def _decide(self, valid: list[tuple[int, dict]], engine: DecisionEngine, settings: dict, started_at: str,
                job: _LiveJob) -> list[dict]:
        options = {"max_length": settings.get("max_length"), "overflow": settings.get("overflow", "refuse")}
        began = time.perf_counter()
        try:
            responses = self._with_busy_retry(lambda: engine.decide_many([r for _, r in valid], priority="bulk",
                                                                         **options), job)
        except ClefError as exc:
            if len(valid) == 1:
                return [{"case_id": valid[0][0], "error": f"{type(exc).__name__}: {exc}",
                         "started_at": started_at, "finished_at": now_iso()}]
            # one bad record (e.g. over the token budget) fails the whole call: retry one by one to isolate it
            return [result for item in valid for result in self._decide([item], engine, settings, now_iso(), job)]
        finished_at = now_iso()
        wall_ms = (time.perf_counter() - began) * 1000
        out = []
        for (case_id, _), response in zip(valid, responses, strict=True):
            out.append({
                "case_id": case_id, "response": response,
                # the engine's own per-record latency; without it, the chunk's wall time shared equally
                "latency_ms": response.get("x_latency_ms", wall_ms / len(valid)),
                "input_tokens": (response.get("usage") or {}).get("input_tokens"),
                "token_counts": response.get("x_token_counts"),
                "started_at": started_at, "finished_at": finished_at,
            })
        return out

    @staticmethod
    def _with_busy_retry(call: Any, job: _LiveJob) -> Any:
        for attempt in range(BUSY_RETRIES):
            try:
                return call()
            except BusyError:
                if job.cancel.is_set() or attempt == BUSY_RETRIES - 1:
                    raise
                time.sleep(min(0.1 * 2 ** attempt, 5.0))
        raise AssertionError("unreachable")
