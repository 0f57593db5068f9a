"""One queue, one GPU worker thread: every GPU call in the process goes through here.

Callers (Streamlit sessions, batch jobs, the HTTP API) submit a job — a list of encoded records — and wait on a
future. This is the one place where records are grouped into GPU batches: interactive jobs before bulk ones, then
waiting records of the same priority, in order, up to a token budget (`token_budget` for interactive work, so
concurrent clients share forward passes; the smaller `bulk_batch_tokens` for bulk work); a job larger than a batch
is split across batches. `run_batch(records, steps)` does the work (the model runner's `forward`); the scheduler
knows nothing of tensors and the runner nothing of the queue: `steps` (a `BatchSteps`) is all the runner sees of
the scheduler. Between steps (layers) a bulk batch lets waiting interactive jobs run, so an interactive request
waits for one step of a bulk batch, not all of it. The queue is bounded in records: past the bound, `submit` raises
BusyError at once instead of growing memory. A failing batch is where a failing record is isolated (`_isolate`).

Several engines in one process (Clef and Clef-Flash resident together) each keep their own scheduler, and the
schedulers of one device share a `GpuTurn`, so the device runs one engine's batch at a time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .errors import BusyError, CancelledError

PRIORITIES = {"interactive": 0, "bulk": 1}


class GpuTurn:
    """Whose turn it is on one device, shared by the schedulers of every engine on it. A worker holds the turn while
    it runs a batch; waiting workers are served by (priority, arrival): an interactive batch goes before bulk ones,
    and bulk batches of different engines alternate in the order they asked, so a long bulk run on one model never
    starves another. A bulk batch that lets interactive work in between its layers also lets another engine's
    waiting interactive batch in there (`pass_to_interactive`): an interactive request on model B during a bulk run
    on model A waits for a layer of A's batch, at most the rest of that one batch."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: list[tuple[int, int]] = []  # heap of (priority, ticket)
        self._held = False

    def acquire(self, priority: int) -> float:
        """Wait for the turn; returns the seconds waited."""
        started = time.perf_counter()
        with self._condition:
            ticket = (priority, next(self._tickets))
            heapq.heappush(self._waiting, ticket)
            while self._held or self._waiting[0] != ticket:
                self._condition.wait()
            heapq.heappop(self._waiting)
            self._held = True
        return time.perf_counter() - started

    def release(self) -> None:
        with self._condition:
            self._held = False
            self._condition.notify_all()

    def interactive_waiting(self) -> bool:
        """Whether another engine's interactive batch waits for the turn (cheap: read without the lock)."""
        waiting = self._waiting
        return bool(waiting) and waiting[0][0] == PRIORITIES["interactive"]

    def pass_to_interactive(self) -> float:
        """From the holder, between two steps of a bulk batch: let the interactive batches waiting now run, then
        take the turn back ahead of every bulk batch (the resumed batch waits as interactive work, after them).
        Returns the seconds the holder waited."""
        if not self.interactive_waiting():
            return 0.0
        self.release()
        return self.acquire(PRIORITIES["interactive"])


_device_turns: dict[str, GpuTurn] = {}
_device_turns_lock = threading.Lock()


def device_turn(device: str) -> GpuTurn:
    """The process's one GpuTurn for `device` (e.g. "cuda:0", "cpu"): every engine on it shares the one queue."""
    with _device_turns_lock:
        return _device_turns.setdefault(device, GpuTurn())


@dataclass(order=True)
class Job:
    priority: int
    sequence: int
    records: list = field(compare=False)
    lengths: list = field(compare=False)  # tokens of each record
    finalize: Callable[[list, JobTiming], Any] = field(compare=False)
    future: Future = field(compare=False)
    submitted: float = field(compare=False, default_factory=time.perf_counter)
    started: bool = field(compare=False, default=False)
    taken: int = field(compare=False, default=0)  # records handed to batches so far
    abandoned: bool = field(compare=False, default=False)  # its caller gave up: run no more of it
    results: list = field(compare=False, default_factory=list)
    done: int = field(compare=False, default=0)
    per_record: bool = field(compare=False, default=False)  # a failing record's error goes in its result slot
    first_batch_at: float | None = field(compare=False, default=None)
    compute_s: dict = field(compare=False, default_factory=dict)  # record index -> its share of its batch's time


@dataclass(frozen=True)
class JobTiming:
    """How the engine spent a job's time: `queued_s` from its submission to the start of its first batch (waiting
    behind earlier work), and per record `compute_s`, the time of the batch the record ran in times the record's
    share of that batch's tokens (the records of a batch run together; the tokens are what costs)."""

    queued_s: float
    compute_s: list[float]


@dataclass
class WorkerCall:
    """A job's one record that is a function to call on the worker thread (`Scheduler.call`), not a record."""

    fn: Callable[[], Any]


@dataclass
class Piece:
    """Records [start, end) of a job, in one batch."""

    job: Job
    start: int
    end: int


@dataclass
class SchedulerStats:
    batches: int = 0
    records: int = 0
    tokens: int = 0
    largest_batch_records: int = 0
    last_batch_records: int = 0
    busy_seconds: float = 0.0
    turn_wait_seconds: float = 0.0  # waiting for other engines on the same device (GpuTurn)
    abandoned_batches: int = 0  # stopped part-way because every job in them was abandoned
    busy: int = 0  # 1 while a batch runs


class BatchAbandoned(Exception):
    """Raised by `BatchSteps.stop_if_abandoned` to stop a batch whose every job was abandoned."""


@dataclass(frozen=True)
class BatchSteps:
    """What a batch may do between its steps, handed to `run_batch` with it (the default: nothing)."""

    bulk: bool = False  # a bulk batch: interactive work may run between its steps
    stop_if_abandoned: Callable[[], None] = lambda: None  # raises BatchAbandoned once no one waits for the batch
    let_interactive_in: Callable[[], None] = lambda: None  # runs the interactive jobs waiting now, if any


class Scheduler:
    def __init__(self, run_batch: Callable[[list, BatchSteps], list], *, token_budget: int = 65_536,
                 bulk_batch_tokens: int | None = None, max_queued_records: int = 4_096, name: str = "clef-gpu-worker",
                 turn: GpuTurn | None = None):
        """`turn`: the device's GpuTurn shared with other engines' schedulers (default: a turn of its own)."""
        self.run_batch = run_batch
        self.turn = turn if turn is not None else GpuTurn()
        self.token_budget = token_budget
        self.bulk_batch_tokens = token_budget if bulk_batch_tokens is None else min(bulk_batch_tokens, token_budget)
        self.max_queued_records = max_queued_records
        self.stats = SchedulerStats()
        self._heap: list[Job] = []
        self._queued_records = 0
        self._sequence = itertools.count()
        self._condition = threading.Condition()
        self._closed = False
        self.running_priority: int | None = None  # of the batch on the GPU now (worker thread only)
        self._running: list[Piece] = []  # the pieces of the batch on the GPU now (innermost)
        self._jobs: dict[int, Job] = {}  # id(future) → its job, until the job is resolved: see abandon
        self._steps = {PRIORITIES["interactive"]: BatchSteps(False, self._stop_if_abandoned),
                       PRIORITIES["bulk"]: BatchSteps(True, self._stop_if_abandoned,
                                                      lambda: self.run_waiting_interactive())}
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, records: Sequence, *, priority: str = "interactive", tokens: float | None = None,
               finalize: Callable[[list, JobTiming], Any] = lambda results, _timing: results,
               per_record: bool = False) -> Future:
        """Queue `records`; the future resolves to finalize(results of run_batch for these records, JobTiming).
        `per_record`: a record whose batch fails, alone, has the exception as its result instead of failing the
        job."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        future: Future = Future()
        records = list(records)
        # `tokens`: the caller's count for the whole job, shared out
        lengths = [len(r) for r in records] if tokens is None else [tokens / max(1, len(records))] * len(records)
        job = Job(PRIORITIES[priority], next(self._sequence), records, lengths, finalize, future,
                  results=[None] * len(records), per_record=per_record)
        if not records:
            future.set_running_or_notify_cancel()
            future.set_result(finalize([], JobTiming(0.0, [])))
            return future
        with self._condition:
            if self._closed:
                raise BusyError("the engine is shutting down")
            if self._queued_records + len(job.records) > self.max_queued_records:
                raise BusyError(f"the GPU queue is full ({self._queued_records} records waiting, limit "
                                f"{self.max_queued_records}); try again shortly")
            self._queued_records += len(job.records)
            heapq.heappush(self._heap, job)
            self._jobs[id(future)] = job
            future.add_done_callback(self._forget)
            self._condition.notify()
        return future

    def call(self, fn: Callable[[], Any], priority: str = "interactive") -> Any:
        """Call `fn` on the worker thread, between batches, and return what it returns (or raise what it raises).
        For state a library keeps per thread: torch keeps cuDNN's attention plans per thread, so plans built on
        another thread would be built again for the first request that needs them. Its length is infinite: it runs
        alone in its batch. As "bulk", interactive work waiting goes first (the engine's background warm-up)."""
        return self.submit([WorkerCall(fn)], priority=priority, tokens=float("inf"),
                           finalize=lambda results, _timing: results[0]).result()

    def _forget(self, future: Future) -> None:
        with self._condition:
            self._jobs.pop(id(future), None)

    def abandon(self, future: Future) -> None:
        """The caller of `future` gives up (its deadline passed): cancel it if it has not started; if it runs, run
        no more of it, and stop the batch it is in at its next `stop_if_abandoned` once no one waits for any of
        the batch."""
        if future.cancel():
            return
        with self._condition:
            job = self._jobs.get(id(future))
            if job is not None:
                job.abandoned = True

    def _stop_if_abandoned(self) -> None:
        """Between steps of the running batch: stop it once every job in it is abandoned (cheap)."""
        running = self._running
        if running and all(piece.job.abandoned for piece in running):
            raise BatchAbandoned

    def queue_depth(self) -> int:
        """Jobs waiting to start (not counting the batch on the GPU now)."""
        with self._condition:
            return len(self._heap)

    def position(self, future: Future) -> int | None:
        """How many jobs run before this one; None once it has started or finished."""
        with self._condition:
            return next((index for index, job in enumerate(sorted(self._heap)) if job.future is future), None)

    def close(self, wait: bool = False) -> None:
        """Take no more work: the worker runs what is queued (abandoned jobs it drops), then ends. `wait`: return
        once it has; a process must not exit while the worker is inside torch, whose threads then abort it."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _take_batch(self) -> list[Piece]:
        """The next batch: the first waiting job (highest priority, then FIFO), then the records of the jobs after it
        of the same priority, in order, while they fit the budget; a job that does not fit entirely is split, and
        the batch's first record goes in whatever its size. Called with the lock held."""
        pieces: list[Piece] = []
        tokens = 0
        budget = None
        while self._heap:
            job = self._heap[0]
            if pieces and job.priority != pieces[0].job.priority:
                break
            if not job.started:
                job.started = True
                if not job.future.set_running_or_notify_cancel():
                    heapq.heappop(self._heap)  # cancelled while waiting
                    self._queued_records -= len(job.records)
                    continue
            if job.future.done() or job.abandoned:  # an earlier piece failed, or the caller gave up: drop the rest
                heapq.heappop(self._heap)
                self._queued_records -= len(job.records) - job.taken
                if not job.future.done():
                    job.future.set_exception(CancelledError("abandoned: the caller's deadline passed"))
                continue
            if budget is None:
                budget = self.token_budget if job.priority == PRIORITIES["interactive"] else self.bulk_batch_tokens
            start = end = job.taken
            while end < len(job.records) and (tokens == 0 or tokens + job.lengths[end] <= budget):
                tokens += job.lengths[end]
                end += 1
            if end == start:
                break
            pieces.append(Piece(job, start, end))
            job.taken = end
            self._queued_records -= end - start
            if end < len(job.records):
                break  # the budget is full
            heapq.heappop(self._heap)
        return pieces

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not self._heap and not self._closed:
                    self._condition.wait()
                if self._closed and not self._heap:
                    return
                pieces = self._take_batch()
            if pieces:
                self.stats.turn_wait_seconds += self.turn.acquire(pieces[0].job.priority)
                try:
                    self._run(pieces)
                finally:
                    self.turn.release()

    def interactive_waiting(self) -> bool:
        """Whether interactive work — this engine's, or another engine's on the same device — waits while a bulk
        batch runs (cheap: read without the lock)."""
        if self.running_priority != PRIORITIES["bulk"]:
            return False
        heap = self._heap
        return (bool(heap) and heap[0].priority == PRIORITIES["interactive"]) or self.turn.interactive_waiting()

    def run_waiting_interactive(self) -> None:
        """Run the interactive jobs waiting now, inside the bulk batch that calls this (worker thread only): other
        engines' first (they waited for the turn), then this engine's own."""
        self.stats.turn_wait_seconds += self.turn.pass_to_interactive()
        while self.interactive_waiting():
            with self._condition:
                pieces = self._take_batch() if self._heap and self._heap[0].priority == 0 else []
            if not pieces:
                return
            self._run(pieces)

    def _run(self, pieces: list[Piece]) -> None:
        records = [r for piece in pieces for r in piece.job.records[piece.start: piece.end]]
        if isinstance(records[0], WorkerCall):  # alone in its batch (infinite length); not a batch in the stats
            self._call(pieces[0], records[0])
            return
        started = time.perf_counter()
        outer, self.running_priority = self.running_priority, pieces[0].job.priority
        outer_pieces, self._running = self._running, pieces
        self.stats.busy = 1
        try:
            results = self.run_batch(records, self._steps[pieces[0].job.priority])
        except BatchAbandoned:
            self.stats.abandoned_batches += 1
            with self._condition:  # the rest of each job leaves the queue before its caller hears of the end
                self._drop_queued([piece.job for piece in pieces])
            for piece in pieces:
                if not piece.job.future.done():
                    piece.job.future.set_exception(CancelledError("abandoned: the caller's deadline passed"))
            return
        except Exception as error:  # noqa: BLE001 — one failing batch must not kill the worker
            failed: Exception | None = error
        else:
            failed = None
        finally:
            self.running_priority = outer
            self._running = outer_pieces
            self.stats.busy = 1 if outer_pieces else 0
            self._account(records, started)
        if failed is not None:
            self._isolate(pieces, failed)
            return
        self._share_time(pieces, started, time.perf_counter() - started)
        offset = 0
        for piece in pieces:
            count = piece.end - piece.start
            self._deliver(piece, results[offset: offset + count])
            offset += count

    def _drop_queued(self, jobs: list[Job]) -> None:
        """Take the records of `jobs` not run yet out of the queue. Called with the lock held."""
        dropped = {id(job) for job in jobs}
        for job in self._heap:
            if id(job) in dropped:
                self._queued_records -= len(job.records) - job.taken
        self._heap = [job for job in self._heap if id(job) not in dropped]
        heapq.heapify(self._heap)

    def _isolate(self, pieces: list[Piece], error: Exception) -> None:
        """After a failed batch: each job's piece again alone; a per-record piece halved down to single records,
        whose error becomes its result; any other piece that fails alone fails its job."""
        if len(pieces) > 1:
            for piece in pieces:
                self._run([piece])
            return
        piece = pieces[0]
        if piece.job.future.done():
            return
        if not piece.job.per_record:
            piece.job.future.set_exception(error)
        elif piece.end - piece.start == 1:
            self._deliver(piece, [error])
        else:
            middle = (piece.start + piece.end) // 2
            self._run([Piece(piece.job, piece.start, middle)])
            self._run([Piece(piece.job, middle, piece.end)])

    @staticmethod
    def _share_time(pieces: list[Piece], started: float, elapsed: float) -> None:
        """Give each record of a batch its share of the batch's time, by tokens."""
        total = sum(piece.job.lengths[i] for piece in pieces for i in range(piece.start, piece.end))
        count = sum(piece.end - piece.start for piece in pieces)
        for piece in pieces:
            job = piece.job
            if job.first_batch_at is None:
                job.first_batch_at = started
            for i in range(piece.start, piece.end):
                job.compute_s[i] = elapsed * (job.lengths[i] / total if total else 1 / count)

    def _call(self, piece: Piece, call: WorkerCall) -> None:
        try:
            result = call.fn()
        except Exception as error:  # noqa: BLE001 — the caller gets the error; the worker goes on
            piece.job.future.set_exception(error)
        else:
            self._deliver(piece, [result])

    def _deliver(self, piece: Piece, results: list) -> None:
        job = piece.job
        if job.future.done():
            return
        job.results[piece.start: piece.end] = results
        job.done += piece.end - piece.start
        if job.done < len(job.records):
            return
        timing = JobTiming(queued_s=(job.first_batch_at or job.submitted) - job.submitted,
                           compute_s=[job.compute_s.get(i, 0.0) for i in range(len(job.records))])
        try:
            job.future.set_result(job.finalize(job.results, timing))
        except Exception as error:  # noqa: BLE001
            job.future.set_exception(error)

    def _account(self, records: list, started: float) -> None:
        """Count the batch: an item that stands for several records (an explanation's record and variants,
        explain.SharedPrefixes, with their `records`) counts as those."""
        stats = self.stats
        count = sum(len(getattr(r, "records", (r,))) for r in records)
        stats.batches += 1
        stats.records += count
        stats.tokens += sum(len(r) for r in records)
        stats.last_batch_records = count
        stats.largest_batch_records = max(stats.largest_batch_records, count)
        stats.busy_seconds += time.perf_counter() - started
