"""A job abandoned while it runs stops at the next check its batch makes, and a job split over several batches runs
no more of them once abandoned (issue 24: a deadline stops the work, not only the answer)."""

from __future__ import annotations

import threading

import pytest

from clef_engine.errors import CancelledError
from clef_engine.scheduler import BatchSteps, Scheduler

STEPS = 2_000  # a batch that is not abandoned takes a few seconds


class Steps:
    """A run_batch of many steps that calls `steps.stop_if_abandoned` between them, as the runner does between
    layers."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.steps = 0
        self.batches: list[list] = []

    def __call__(self, records: list, steps: BatchSteps) -> list:
        self.batches.append(records)
        self.started.set()
        for _ in range(STEPS):
            steps.stop_if_abandoned()
            self.steps += 1
            threading.Event().wait(0.001)
        return [f"done {r}" for r in records]


def test_a_running_job_abandoned_stops_at_the_next_step() -> None:
    steps = Steps()
    scheduler = Scheduler(steps, token_budget=10)
    try:
        future = scheduler.submit(["a"], tokens=1)
        assert steps.started.wait(30)
        scheduler.abandon(future)
        with pytest.raises(CancelledError):
            future.result(timeout=30)
        assert steps.steps < STEPS
        assert scheduler.stats.abandoned_batches == 1
        assert scheduler.stats.busy == 0
        assert scheduler.submit(["b"], tokens=1).result(timeout=60) == ["done b"]  # the worker goes on
    finally:
        scheduler.close()


def test_an_abandoned_job_runs_no_more_of_its_batches() -> None:
    steps = Steps()
    scheduler = Scheduler(steps, token_budget=2)
    try:
        future = scheduler.submit(["a", "b", "c", "d", "e", "f"], tokens=6)  # three batches of two
        assert steps.started.wait(30)
        scheduler.abandon(future)
        with pytest.raises(CancelledError):
            future.result(timeout=30)
        assert scheduler.queue_depth() == 0  # its other two batches left the queue before it ended
        after = scheduler.submit(["z"], tokens=1)  # the worker reaches it only after whatever it still had queued
        assert after.result(timeout=60) == ["done z"]
        assert steps.batches == [["a", "b"], ["z"]]
    finally:
        scheduler.close()


def test_abandoning_a_queued_job_cancels_it() -> None:
    steps = Steps()
    scheduler = Scheduler(steps, token_budget=1)
    try:
        running = scheduler.submit(["a"], tokens=1)
        assert steps.started.wait(30)
        queued = scheduler.submit(["b"], tokens=1)
        scheduler.abandon(queued)
        assert queued.cancelled()
        scheduler.abandon(running)
        with pytest.raises(CancelledError):
            running.result(timeout=30)
        assert steps.batches == [["a"]]
    finally:
        scheduler.close()
