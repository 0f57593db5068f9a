"""One queue, one GPU worker thread: every GPU call in the process goes through here.

Callers (Streamlit sessions, batch jobs, the HTTP API) submit a job — a list of encoded records — and wait on a
future. The worker takes interactive jobs before bulk ones, then merges as many waiting jobs as fit a token budget
into one batch, so concurrent clients share forward passes. The queue is bounded in records: past the bound,
`submit` raises BusyError at once instead of growing memory. A job cancelled before it starts is skipped. The
scheduler knows nothing of tensors: `run_batch` does the work.
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

from ..errors import BusyError

PRIORITIES = {"interactive": 0, "bulk": 1}


@dataclass(order=True)
class Job:
    priority: int
    sequence: int
    records: list = field(compare=False)
    tokens: int = field(compare=False)
    finalize: Callable[[list], Any] = field(compare=False)
    future: Future = field(compare=False)
    submitted: float = field(compare=False, default_factory=time.perf_counter)


@dataclass
class SchedulerStats:
    batches: int = 0
    records: int = 0
    tokens: int = 0
    largest_batch_records: int = 0
    last_batch_records: int = 0
    busy_seconds: float = 0.0


class Scheduler:
    def __init__(self, run_batch: Callable[[list], list], *, token_budget: int = 65_536,
                 max_queued_records: int = 4_096, name: str = "clef-gpu-worker"):
        self.run_batch = run_batch
        self.token_budget = token_budget
        self.max_queued_records = max_queued_records
        self.stats = SchedulerStats()
        self._heap: list[Job] = []
        self._queued_records = 0
        self._sequence = itertools.count()
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, records: Sequence, *, priority: str = "interactive", tokens: int | None = None,
               finalize: Callable[[list], Any] = lambda results: results) -> Future:
        """Queue `records`; the future resolves to finalize(results of run_batch for these records)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        future: Future = Future()
        job = Job(PRIORITIES[priority], next(self._sequence), list(records),
                  tokens if tokens is not None else sum(len(r) for r in records), finalize, future)
        with self._condition:
            if self._closed:
                raise BusyError("the engine is shutting down")
            if self._queued_records + len(job.records) > self.max_queued_records:
                raise BusyError(f"the GPU queue is full ({self._queued_records} records waiting, limit "
                                f"{self.max_queued_records}); try again shortly")
            self._queued_records += len(job.records)
            heapq.heappush(self._heap, job)
            self._condition.notify()
        return future

    def queue_depth(self) -> int:
        """Jobs waiting to start (not counting the batch on the GPU now)."""
        with self._condition:
            return len(self._heap)

    def position(self, future: Future) -> int | None:
        """How many jobs run before this one; None once it has started or finished."""
        with self._condition:
            ordered = sorted(self._heap)
            for index, job in enumerate(ordered):
                if job.future is future:
                    return index
        return None

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()

    def _take_batch(self) -> list[Job]:
        """Highest priority first; then every waiting job that still fits the token budget (FIFO within a
        priority). Called with the lock held."""
        jobs: list[Job] = []
        tokens = 0
        skipped: list[Job] = []
        while self._heap:
            job = heapq.heappop(self._heap)
            if jobs and tokens + job.tokens > self.token_budget:
                skipped.append(job)
                break
            self._queued_records -= len(job.records)
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while waiting
            jobs.append(job)
            tokens += job.tokens
        for job in skipped:
            heapq.heappush(self._heap, job)
        return jobs

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not self._heap and not self._closed:
                    self._condition.wait()
                if self._closed and not self._heap:
                    return
                jobs = self._take_batch()
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        records = [r for job in jobs for r in job.records]
        started = time.perf_counter()
        try:
            results = self.run_batch(records)
        except Exception as error:  # noqa: BLE001 — one failing batch must not kill the worker
            if len(jobs) > 1:  # isolate the culprit: run each job alone
                for job in jobs:
                    self._run_alone(job)
                return
            jobs[0].future.set_exception(error)
            return
        finally:
            self._account(records, started)
        offset = 0
        for job in jobs:
            count = len(job.records)
            self._resolve(job, results[offset: offset + count])
            offset += count

    def _run_alone(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            results = self.run_batch(job.records)
        except Exception as error:  # noqa: BLE001
            job.future.set_exception(error)
            return
        finally:
            self._account(job.records, started)
        self._resolve(job, results)

    def _resolve(self, job: Job, results: list) -> None:
        try:
            job.future.set_result(job.finalize(results))
        except Exception as error:  # noqa: BLE001
            job.future.set_exception(error)

    def _account(self, records: list, started: float) -> None:
        stats = self.stats
        stats.batches += 1
        stats.records += len(records)
        stats.tokens += sum(len(r) for r in records)
        stats.last_batch_records = len(records)
        stats.largest_batch_records = max(stats.largest_batch_records, len(records))
        stats.busy_seconds += time.perf_counter() - started
