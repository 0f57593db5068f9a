"""Background batch runs. A process-wide JobRunner owns one thread per running run, so a run keeps going when
the user switches pages or reloads; every chunk's results are committed as they arrive, so a crash loses at most
the chunk in flight and a restart resumes with the cases that have no result yet.

The GPU is kept busy: a run's cases go in chunks sized by tokens (`chunk_tokens`, learnt from the tokens of the
cases already done; a run's `chunk_size` setting fixes a number of cases instead), and the next chunk is encoded
and queued on the engine while the one before it runs, its results written to the store while the next one runs.
The engine's scheduler splits bulk work into batches, so an interactive request waits for at most one of them.

A runner holds a lease on each run it works on (in the database, renewed by a heartbeat), so a second process
asked to run the same run is refused instead of computing every case again; once the first process stops (or is
killed), the lease is void and the second one resumes with the cases left.

A database that stops taking writes mid-run (read-only, disk full, locked past the busy timeout) ends the run: the
chunks on the engine are finished or cancelled, the run is marked failed with one message saying so, and resuming it
once the database is writable computes only the cases without a result. If not even the status can be written, the
run stays `running` under a lease that is never renewed again: once this process is gone (or the lease has expired)
`progress` reports it interrupted, the state the Runs page and `run --resume` resume from.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar

from clef_engine.errors import BusyError, ClefError
from clef_engine.interface import DecisionEngine, Request
from clef_engine.protocol import Question, ValidRequest, prepare_questions
from clef_engine.remote import RemoteEngine
from clef_workbench.casesets import build_request
from clef_workbench.run_status import every_case_failed_message
from clef_workbench.store import NewResult, Response, Run, RunSettings, Store, new_lease_owner, now_iso

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 8  # cases in the first chunk, before the run's tokens per case are known
DEFAULT_CHUNK_TOKENS = 16_384
BUSY_RETRIES = 20  # BusyError (queue full) is retried with backoff; other engine errors are per-case errors
# A lease not renewed for this long is void. The heartbeat renews it every third of that, whatever a chunk takes.
LEASE_TTL_S = 30.0


@dataclass
class LiveThread:
    """A thread working on one run or sweep, and the event that asks it to stop after the work in flight."""

    thread: threading.Thread
    cancel: threading.Event = field(default_factory=threading.Event)


Live = TypeVar("Live", bound=LiveThread)


class BackgroundThreads(Generic[Live]):
    """One background thread per run (or sweep) id, so that the work goes on when the person switches pages."""

    def __init__(self) -> None:
        self._live: dict[int, Live] = {}
        self._lock = threading.Lock()

    def cancel(self, key: int) -> bool:
        """Ask a live thread to stop after the work in flight; False when none runs here."""
        if not self.is_running(key):
            return False
        self._live[key].cancel.set()
        return True

    def is_running(self, key: int) -> bool:
        live = self._live.get(key)
        return live is not None and live.thread.is_alive()

    def wait(self, key: int, timeout: float | None = None) -> bool:
        """Block until the thread ends; True when it has (or none was started here)."""
        live = self._live.get(key)
        if live is not None:
            live.thread.join(timeout)
        return not self.is_running(key)


@dataclass
class _LiveJob(LiveThread):
    session_started: float = field(default_factory=time.monotonic)
    processed: int = 0  # cases finished by this thread (for the rate; earlier sessions are not counted)
    last_error: str | None = None
    lease_lost: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Chunk:
    """One chunk of a run between its submission to the engine and its results."""

    run_id: int
    started_at: str
    valid: list[tuple[int, ValidRequest]] = field(default_factory=list)  # (case id, request) sent to the engine
    errors: list[NewResult] = field(default_factory=list)  # cases refused before the engine
    future: Future | None = None
    began: float = 0.0


def error_result(case_id: int, error: Exception, started_at: str) -> NewResult:
    """A case's result when it got no answer: its error, by type and message."""
    return NewResult(case_id=case_id, error=f"{type(error).__name__}: {error}", started_at=started_at,
                     finished_at=now_iso())


def validated(engine: DecisionEngine, requests: Iterable[tuple[int, Request]], settings: RunSettings, started_at: str,
              questions: tuple[Question, ...] | None = None) -> tuple[list[tuple[int, ValidRequest]], list[NewResult]]:
    """The cases' requests validated, once: the engine encodes a ValidRequest under the run's budget as it is. A
    case it refuses becomes an error result, and the run goes on."""
    valid, errors = [], []
    for case_id, request in requests:
        try:
            valid.append((case_id, engine.validate(request, max_length=settings.max_length,
                                                   overflow=settings.overflow, questions=questions)))
        except ClefError as exc:
            errors.append(error_result(case_id, exc, started_at))
    return valid, errors


class RunProgress(TypedDict):
    """A run's status from the database plus live numbers (JobRunner.progress)."""

    run_id: int
    status: str
    total: int
    done: int
    errors: int
    remaining: int
    rate_per_s: float | None  # cases/s in this session
    eta_s: float | None
    live: bool  # a thread in this process is working on it
    cancelling: bool
    elsewhere: bool  # another process holds the run's lease and works on it
    interrupted: bool  # the database says running but no thread here is: the process that ran it stopped — resume it
    error: str | None


def fmt_seconds(value: float | None) -> str:
    """A duration (an ETA) as the command line and the Runs page say it."""
    if value is None:
        return "–"
    minutes, seconds = divmod(int(round(value)), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


class JobAlreadyRunningError(RuntimeError):
    """The run already has a live job in this process, or another process holds its lease."""


class EngineUnreachableError(RuntimeError):
    """The run's model is a remote endpoint that did not answer its check: the run is not started."""


def check_engine(engine: DecisionEngine | None) -> None:
    """Before a run starts: reach a remote endpoint with one small request (its model list), so that a stopped or
    refusing endpoint is reported at once instead of as one error per case minutes later. Local engines have
    nothing to check. Raises EngineUnreachableError with the endpoint's reason."""
    if not isinstance(engine, RemoteEngine):
        return
    try:
        engine.check()
    except ClefError as exc:
        raise EngineUnreachableError(f"Run not started: its model's endpoint did not answer a check "
                                     f"request ({exc})") from exc


class JobRunner(BackgroundThreads[_LiveJob]):
    """Starts, cancels and reports on batch runs. Create one per process (the UI caches it as a resource)."""

    def __init__(self, store: Store, *, chunk_size: int = DEFAULT_CHUNK_SIZE, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 lease_ttl_s: float = LEASE_TTL_S):
        super().__init__()
        self.store = store
        self.chunk_size = chunk_size
        self.chunk_tokens = chunk_tokens
        self.lease_ttl_s = lease_ttl_s
        self.owner = new_lease_owner()

    def start(self, run_id: int, engine: DecisionEngine | None, *, retry_failed: bool = False,
              check: bool = True) -> None:
        """Start (or resume) a run in a background thread; only cases without a result are sent. With
        retry_failed, the cases whose result is an error are sent again too (their errors are replaced, in the
        same run). A remote model is checked first (check_engine), unless the caller has just done so (check).
        `engine` is None only for a RayJobRunner given its replicas."""
        self.store.get_run(run_id)  # raises NotFoundError for a bad id before any thread starts
        if check:
            check_engine(engine)
        with self._lock:
            if self.is_running(run_id):
                raise JobAlreadyRunningError(f"run {run_id} is already running")
            holder = self.store.acquire_run_lease(run_id, self.owner, self.lease_ttl_s)
            if holder is not None:
                raise JobAlreadyRunningError(
                    f"run {run_id} is being run by another process ({holder}); it goes on there, and can be "
                    "resumed here once that process stops")
            if retry_failed:  # under the lease: no other process is working on the run meanwhile
                self.store.delete_error_results(run_id)
            thread = threading.Thread(target=self._work, args=(run_id, engine), name=f"clef-run-{run_id}",
                                      daemon=True)
            self._live[run_id] = _LiveJob(thread=thread)
        self.store.set_run_status(run_id, "running")
        thread.start()

    def progress(self, run_id: int) -> RunProgress:
        run = self.store.get_run(run_id)
        job = self._live.get(run_id)
        running = job if job is not None and job.thread.is_alive() else None
        live = running is not None
        remaining = run["total"] - run["done"]
        holder = self.store.run_lease_holder(run_id)
        elsewhere = not live and holder is not None and holder != self.owner  # ours: a lease we could not release
        rate = eta = None
        if running is not None and running.processed:
            rate = running.processed / max(time.monotonic() - running.session_started, 1e-9)
            eta = remaining / rate
        return RunProgress(
            run_id=run_id, status=run["status"], total=run["total"], done=run["done"], errors=run["errors"],
            remaining=remaining, rate_per_s=rate, eta_s=eta, live=live,
            cancelling=running is not None and running.cancel.is_set(), elsewhere=elsewhere,
            interrupted=run["status"] == "running" and not live and not elsewhere,
            error=run["error"] or (job.last_error if job else None))

    # -- the worker thread -------------------------------------------------------------------------------------

    def _heartbeat(self, run_id: int, job: _LiveJob) -> None:
        while not job.lease_lost.wait(self.lease_ttl_s / 3):
            if not job.thread.is_alive():
                return
            try:
                renewed = self.store.renew_run_lease(run_id, self.owner, self.lease_ttl_s)
            except sqlite3.Error:  # the database takes no writes: the work loop's next write stops the run
                continue
            if not renewed:
                job.lease_lost.set()  # taken over after we failed to renew in time: stop, the new holder goes on

    def _work(self, run_id: int, engine: DecisionEngine | None) -> None:
        job = self._live[run_id]
        threading.Thread(target=self._heartbeat, args=(run_id, job), name=f"clef-lease-{run_id}",
                         daemon=True).start()
        in_flight: deque[_Chunk] = deque()
        try:
            self._compute(run_id, engine, job, in_flight)
            self._end_run(run_id, job)
        except Exception as exc:  # noqa: BLE001 — the run stops, its finished results stay; the message goes to the run page
            self._drain(in_flight)
            self._fail_run(run_id, job, exc)
        finally:
            job.lease_lost.set()  # ends the heartbeat
            try:
                self.store.release_run_lease(run_id, self.owner)
            except sqlite3.Error:
                pass  # unwritable database: the lease lapses by itself (expiry, or this process gone)

    def _compute(self, run_id: int, engine: DecisionEngine | None, job: _LiveJob, in_flight: deque[_Chunk]) -> None:
        """Every case of the run without a result, in chunks, two in flight on the engine; until cancelled."""
        if engine is None:
            raise ValueError("a run in this process needs a loaded model: none was given")
        run = self.store.get_run(run_id)
        try:  # the schema validated once: its cases then validate only their evidence
            questions: tuple[Question, ...] | None = prepare_questions(run["schema"]["questions"])
        except ClefError:
            questions = None  # not valid: each case is validated whole and reports the problem as its error
        fixed_size = run["settings"].chunk_size
        chunk_tokens = run["settings"].chunk_tokens or self.chunk_tokens
        pending = deque(self.store.unfinished_case_ids(run_id))
        tokens_seen = cases_seen = 0
        while pending or in_flight:
            stop = job.cancel.is_set() or job.lease_lost.is_set()
            if pending and not stop:
                size = fixed_size or (max(1, chunk_tokens * cases_seen // tokens_seen) if tokens_seen
                                      else self.chunk_size)
                chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                in_flight.append(self._submit_chunk(run, chunk, engine, questions))
                if len(in_flight) < 2 and pending:
                    continue  # keep one chunk queued behind the one on the GPU
            elif stop:
                pending.clear()
            if not in_flight:
                break
            results = self._finish_chunk(in_flight.popleft(), engine, job)
            self.store.record_results(run_id, results)  # while the next chunk runs
            job.processed += len(results)
            counted = [tokens for r in results if (tokens := r.get("input_tokens"))]
            tokens_seen += sum(counted)
            cases_seen += len(counted)

    @staticmethod
    def _drain(in_flight: deque[_Chunk]) -> None:
        """After a failure: cancel the chunks queued on the engine and wait for the one it is running, so that no
        work of the failed run goes on behind it (nor holds the GPU while the process exits)."""
        futures = [chunk.future for chunk in in_flight if chunk.future is not None]
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # waits; its answers are not recorded, the resumed run computes them

    def _end_run(self, run_id: int, job: _LiveJob) -> None:
        """Finished, or cancelled with cases left; unless another process has taken the run over."""
        if job.lease_lost.is_set() and not job.cancel.is_set():
            return  # another process holds the run now; its status is its to write
        if self.store.unfinished_case_ids(run_id):
            self.store.set_run_status(run_id, "cancelled")
            return
        run = self.store.get_run(run_id)
        if run["done"] and run["errors"] == run["done"]:  # no case got an answer: the run failed
            first = next(r["error"] for r in self.store.list_results(run_id) if r["error"] is not None)
            self.store.set_run_status(run_id, "failed", error=every_case_failed_message(run["errors"], first))
        else:
            self.store.set_run_status(run_id, "finished")

    def _fail_run(self, run_id: int, job: _LiveJob, exc: Exception) -> None:
        job.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, sqlite3.Error):
            job.last_error = (f"the database {self.store.path} stopped taking writes ({exc}); the run stopped with "
                              "its finished results kept: resume it once the database is writable")
        # the run page shows the words; the operator's log gets the traceback
        log.error("batch run %s failed: %s", run_id, job.last_error, exc_info=exc)
        try:
            self.store.set_run_status(run_id, "failed", error=job.last_error)
        except sqlite3.Error:
            pass  # the run stays `running` under a lease nobody renews: progress() reports it interrupted

    def _submit_chunk(self, run: Run, case_ids: list[int], engine: DecisionEngine,
                      questions: tuple[Question, ...] | None) -> _Chunk:
        """Build and check the chunk's requests, then queue the valid ones on the engine (encoding them here)."""
        chunk = _Chunk(run_id=run["id"], started_at=now_iso())
        requests = ((case["id"], build_request(case, run["schema"], model=run["model_id"]))
                    for case in self.store.get_cases(case_ids))
        chunk.valid, chunk.errors = validated(engine, requests, run["settings"], chunk.started_at, questions)
        if not chunk.valid:
            return chunk
        chunk.began = time.perf_counter()
        chunk.future = self._submit(engine, chunk)
        return chunk

    @staticmethod
    def _submit(engine: DecisionEngine, chunk: _Chunk, only: list[int] | None = None) -> Future:
        """The requests queued on the engine: an answer or an error per request (a case over the token budget is
        an error result, and the rest of its chunk runs as it would have without it). A chunk the engine refuses
        whole (its queue full, an endpoint that stopped) gets that error for each case: _finish_chunk sends those
        that were too busy again."""
        requests = [r for _, r in chunk.valid] if only is None else [chunk.valid[i][1] for i in only]
        try:
            return engine.submit(requests, priority="bulk", errors="return")
        except ClefError as exc:
            if not isinstance(exc, BusyError):
                log.warning("run %s: the engine refused a chunk of %d cases", chunk.run_id, len(requests),
                            exc_info=exc)
            refused: Future = Future()
            refused.set_result([exc] * len(requests))
            return refused

    def _finish_chunk(self, chunk: _Chunk, engine: DecisionEngine, job: _LiveJob) -> list[NewResult]:
        """Wait for the chunk's answers; results in the form Store.record_results takes. Cases the engine was too
        busy for are sent again, with backoff."""
        if chunk.future is None:  # no valid case: nothing went to the engine
            return chunk.errors
        try:
            outcomes = chunk.future.result()
        except ClefError as exc:  # the whole chunk failed on the engine: each of its cases gets that error
            log.warning("a chunk of %d cases failed on the engine", len(chunk.valid), exc_info=exc)
            outcomes = [exc] * len(chunk.valid)
        for attempt in range(BUSY_RETRIES):
            busy = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, BusyError)]
            if not busy or job.cancel.is_set():
                break
            time.sleep(min(0.1 * 2 ** attempt, 5.0))
            again = self._submit(engine, chunk, busy).result()
            for i, outcome in zip(busy, again, strict=True):
                outcomes[i] = outcome
        return chunk.errors + self._results(chunk.valid, outcomes, chunk.started_at,
                                            (time.perf_counter() - chunk.began) * 1000)

    @staticmethod
    def _results(valid: list[tuple[int, Any]], outcomes: list[Response | Exception], started_at: str,
                 wall_ms: float) -> list[NewResult]:
        """One result per case from the engine's outcomes (a response, or the case's own error)."""
        finished_at = now_iso()
        out: list[NewResult] = []
        for (case_id, _), response in zip(valid, outcomes, strict=True):
            if isinstance(response, Exception):
                out.append(error_result(case_id, response, started_at))
                continue
            out.append({
                "case_id": case_id, "response": response,
                # the record's own compute as the engine saw it (its share of its batch's time), never the time its
                # chunk waited behind the run's previous one; an engine that does not say: the wall time shared
                "latency_ms": response.get("x_compute_ms", response.get("x_latency_ms", wall_ms / len(valid))),
                "input_tokens": response["usage"]["input_tokens"] if "usage" in response else None,
                "token_counts": response.get("x_token_counts"),
                "started_at": started_at, "finished_at": finished_at,
            })
        return out
