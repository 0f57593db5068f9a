"""Several engines on one device: their schedulers share one GpuTurn, take turns fairly, and an interactive request
on one model is not held up by a bulk run on another for more than one of its batches (or one layer of it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from clef_engine.scheduler import BatchSteps, GpuTurn, Scheduler, device_turn

BATCH_S = 0.05  # the fake GPU's time per batch


class FakeGpu:
    """run_batch of each engine logs (engine, what it started / ended) on one shared timeline; `layers` splits a batch
    into steps with the engine's between-layers call, as the packed runner does in bulk batches."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.running = 0
        self.overlaps = 0
        self.during: dict[tuple[str, int], Callable[[], None]] = {}  # (record, layer) → called after that layer

    def engine(self, name: str, turn: GpuTurn, *, layers: int = 1, batch_s: float = BATCH_S) -> Scheduler:
        def run_batch(records: list, steps: BatchSteps) -> list:
            with self.lock:
                self.running += 1
                self.overlaps += self.running > 1
                self.log.append((name, f"start {records[0]}"))
            for layer in range(layers):
                time.sleep(batch_s / layers)
                with self.lock:
                    self.log.append((name, f"layer {records[0]}"))
                if (records[0], layer) in self.during:
                    self.during.pop((records[0], layer))()
                if layer < layers - 1:
                    with self.lock:
                        self.running -= 1
                    steps.let_interactive_in()
                    with self.lock:
                        self.running += 1
            with self.lock:
                self.running -= 1
                self.log.append((name, f"end {records[0]}"))
            return records

        return Scheduler(run_batch, token_budget=1, name=f"worker-{name}", turn=turn)


def test_two_engines_alternate_and_never_overlap():
    gpu, turn = FakeGpu(), GpuTurn()
    a, b = gpu.engine("A", turn), gpu.engine("B", turn)
    turn.acquire(1)  # the device is busy until both workers wait for it, whichever thread the OS runs first
    futures = [a.submit([f"a{i}"], priority="bulk", tokens=1) for i in range(6)]
    futures += [b.submit([f"b{i}"], priority="bulk", tokens=1) for i in range(6)]
    while len(turn._waiting) < 2:
        time.sleep(0.005)
    turn.release()
    for future in futures:
        future.result(timeout=10)
    starts = [name for name, what in gpu.log if what.startswith("start")]
    # from then on the two take turns, batch by batch
    assert starts in (["A", "B"] * 6, ["B", "A"] * 6), starts
    assert gpu.overlaps == 0, "two engines ran batches on the device at the same time"
    assert b.stats.turn_wait_seconds > 0 and a.stats.turn_wait_seconds > 0
    a.close(), b.close()


def test_without_a_shared_turn_engines_run_at_once():
    """The control: the interleaving above comes from the shared turn, not from timing."""
    gpu = FakeGpu()
    a, b = gpu.engine("A", GpuTurn()), gpu.engine("B", GpuTurn())
    futures = [s.submit([f"{n}{i}"], priority="bulk", tokens=1) for i in range(4) for n, s in (("a", a), ("b", b))]
    for future in futures:
        future.result(timeout=10)
    assert gpu.overlaps > 0
    a.close(), b.close()


def _interactive_during_bulk(layers: int, batch_s: float = BATCH_S) -> list[tuple[str, str]]:
    """A long bulk run on A; an interactive request on B arrives during A's third batch, after its first layer (sent
    from inside the batch, and waited for until B's worker asks for the device: the moment is an event, not a
    guess). Returns the log from that arrival to B's start."""
    gpu, turn = FakeGpu(), GpuTurn()
    a, b = gpu.engine("A", turn, layers=layers, batch_s=batch_s), gpu.engine("B", turn)
    interactive: list[Future] = []

    def arrive() -> None:
        interactive.append(b.submit(["b-interactive"], priority="interactive", tokens=1))
        deadline = time.monotonic() + 60  # a safety limit: B's worker asks for the turn as soon as it is scheduled
        while not turn.interactive_waiting():
            assert time.monotonic() < deadline, "B's worker never asked for the device"
            time.sleep(0.001)
        with gpu.lock:
            gpu.log.append(("B", "arrived"))

    gpu.during[("a2", 0)] = arrive
    bulk = [a.submit([f"a{i}"], priority="bulk", tokens=1) for i in range(20)]
    for future in bulk:
        future.result(timeout=120)
    interactive[0].result(timeout=120)
    a.close(), b.close()
    assert gpu.overlaps == 0
    return gpu.log[gpu.log.index(("B", "arrived")): gpu.log.index(("B", "start b-interactive"))]


def test_interactive_on_b_waits_for_at_most_one_batch_of_a_bulk_run_on_a():
    before_b = _interactive_during_bulk(layers=1)
    # the rest of the batch A was running as B's request arrived, then B: without the shared turn's order, all 17 left
    assert [what for name, what in before_b if name == "A"] == ["end a2"], before_b


def test_interactive_on_b_runs_between_layers_of_a_bulk_batch_on_a():
    before_b = _interactive_during_bulk(layers=10, batch_s=0.2)
    # B runs at A's next step between layers: none of the nine layers left of A's batch, not the rest of it
    assert [what for name, what in before_b if name == "A"] == [], before_b


def test_interactive_first_within_and_across_engines():
    gpu, turn = FakeGpu(), GpuTurn()
    a, b = gpu.engine("A", turn), gpu.engine("B", turn)
    turn.acquire(1)  # the device is busy: everything below queues
    futures = [a.submit(["a-bulk"], priority="bulk", tokens=1)]
    while len(turn._waiting) < 1:  # A's bulk batch asked for the device first
        time.sleep(0.005)
    futures.append(b.submit(["b-interactive"], priority="interactive", tokens=1))
    while len(turn._waiting) < 2:
        time.sleep(0.005)
    turn.release()
    for future in futures:
        future.result(timeout=10)
    starts = [what for name, what in gpu.log if what.startswith("start")]
    assert starts == ["start b-interactive", "start a-bulk"]
    a.close(), b.close()


def test_one_turn_per_device():
    assert device_turn("cuda:0") is device_turn("cuda:0")
    assert device_turn("cuda:0") is not device_turn("cuda:1")
    assert device_turn("cpu") is device_turn("cpu")


def test_engines_on_one_device_share_its_turn(tiny_release):
    """The public path: two engines loaded in one process share the device's turn, and both answer while busy."""
    import clef_engine

    first = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    second = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    try:
        assert first.scheduler.turn is second.scheduler.turn is device_turn("cpu")
        request = {"state": "refund please " * 20, "questions": {"q": {"type": "noul", "instructions": "Refund?"}}}
        bulk = first.submit([dict(request, state=f"case {i} " * 40) for i in range(12)], priority="bulk")
        answer = second.decide(request)
        assert answer["answers"]["q"]["noul"] == pytest.approx(first.decide(request)["answers"]["q"]["noul"],
                                                                abs=1e-6)
        assert len(bulk.result(timeout=120)) == 12
    finally:
        first.close()
        second.close()
