"""Issue 38: a model answers as soon as it is loaded; what is compiled, autotuned and captured for lengths nobody
asked for yet happens afterwards, in the background (`Engine.warm_up_steps`, a thread of the engine's own whose steps
wait for their turn as bulk work), and the engine, the workbench's sidebar and the server's /health read "warming"
until it is done, then "ready". On the tiny release (CPU): warm-up is turned on (CLEF_WARM_UP, off on the CPU by
default) and held at a first step that waits for the test, so every "before" and "after" here is an event, not a
time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import pytest

import clef_engine
from clef_engine.config import EngineConfig
from clef_engine.engine import Engine
from clef_engine.fast.graphs import PrefillGraphs
from clef_workbench.model_loader import ModelManager
from tests.browser_harness import free_port, stop_process
from tests.test_server import REPO, STARTUP_SECONDS

REQUEST = {"state": "The parcel arrived crushed and nobody answers my emails.",
           "questions": {"angry": {"type": "noul", "instructions": "Is the customer angry?"},
                         "topic": {"type": "choice", "instructions": "What is it about?",
                                   "criteria": {"shipping": None, "billing": None, "other": None}}}}
SAME = 1e-5
WAIT_SECONDS = 120  # only a bound on a hang: every assertion below waits for an event


def held_warm_up(monkeypatch, gate: threading.Event, after: int = 0) -> list[str]:
    """Hold every engine's warm-up at a step that waits for `gate`, after its first `after` real steps; returns the
    names of the steps as they finish."""
    done: list[str] = []
    steps = Engine.warm_up_steps

    def counted(step, name: str) -> None:
        step()
        done.append(name)

    def held(self):
        real = steps(self)
        named = [*real[:after], gate.wait, *real[after:]]
        return [partial(counted, step, f"step {n}") for n, step in enumerate(named)]

    monkeypatch.setattr(Engine, "warm_up_steps", held)
    return done


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def warming_engine(tiny_release: Path) -> Engine:
    return clef_engine.load(tiny_release, config=EngineConfig.resolve(device="cpu", dtype="float32", warm_up=True))


def test_the_first_answer_comes_before_the_warm_up_ends_and_equals_the_answers_after(tiny_release, monkeypatch):
    gate = threading.Event()
    done = held_warm_up(monkeypatch, gate, after=1)  # one real step (a decide), then held
    engine = warming_engine(tiny_release)
    try:
        assert engine.state == "warming" and engine.info()["state"] == "warming"
        during = engine.probabilities([REQUEST])[0]
        assert engine.state == "warming" and len(done) < len(engine.warm_up_steps())  # answered mid-warm-up
        gate.set()
        until(lambda: engine.state == "ready", "the warm-up to end")
        assert len(done) == len(engine.warm_up_steps()) and engine.info()["warm_up_seconds"] > 0
        assert engine.info()["state_cache"]["entries"] == 0  # the warm-up's long state is not left behind
        after = engine.probabilities([REQUEST])[0]
        assert max(abs(a - b) for x, y in zip(during, after) for a, b in zip(x, y)) <= SAME
    finally:
        gate.set()
        engine.close(wait=True)


def test_the_warm_up_steps_wait_behind_requests(tiny_release, monkeypatch):
    """A step asks for the worker as bulk work: an interactive request queued after it still runs first."""
    gate = threading.Event()
    done = held_warm_up(monkeypatch, gate)
    engine = warming_engine(tiny_release)
    started, blocker = threading.Event(), threading.Event()
    answered_after: list[int] = []
    try:
        threading.Thread(target=engine.scheduler.call, args=(lambda: started.set() or blocker.wait(),),
                         daemon=True).start()
        until(started.is_set, "the worker to be busy")  # what is submitted from now on queues
        gate.set()
        until(lambda: engine.queue_depth() >= 1, "the warm-up's next step to queue")
        answer = engine.submit([REQUEST])
        answer.add_done_callback(lambda _: answered_after.append(len(done)))
        blocker.set()
        until(lambda: engine.state == "ready", "the warm-up to end")
        assert answer.result()[0]["answers"] and answered_after == [1]  # only the held step was done
    finally:
        blocker.set()
        gate.set()
        engine.close(wait=True)


def test_a_bucket_not_captured_yet_runs_eagerly_while_the_warm_up_captures(tiny_engine):
    import torch

    graphs = PrefillGraphs(tiny_engine.backbone, max_tokens=256)
    graphs.capture_on_use = False  # as while warming
    assert graphs.run(torch.zeros(40, dtype=torch.long)) is None
    assert graphs.captures == 0 and graphs.disabled is None  # nothing tried in the request's time


def test_the_sidebar_says_warming_until_the_warm_up_ends(tiny_release, monkeypatch):
    gate = threading.Event()
    held_warm_up(monkeypatch, gate)
    manager = ModelManager(loader=lambda source: warming_engine(source))
    try:
        manager.request(str(tiny_release))
        state = manager.wait(WAIT_SECONDS)
        assert state.engine is not None and state.status == "warming"
        assert "Warming up" in (state.status_line() or "") and "Loading" not in (state.status_line() or "")
        gate.set()
        until(lambda: manager.state().status == "ready", "the sidebar to say ready")
        assert manager.state().status_line() is None
    finally:
        gate.set()
        if manager.state().engine is not None:
            manager.state().engine.close(wait=True)


@pytest.mark.slow  # a real server process
def test_health_of_a_real_server_says_warming_then_ready(tiny_release, tmp_path):
    gate = tmp_path / "warm-up-gate"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.warming_server", str(gate), "serve", "--model", str(tiny_release),
             "--device", "cpu", "--port", str(port)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "CLEF_WARM_UP": "1"})
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        health = None
        while health is None or health.status_code != 200:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            try:
                health = httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
        assert health.json()["state"] == "warming" and health.json()["ready"] is True
        answer = httpx.post(f"{url}/v1/systemone", json=REQUEST, timeout=60)
        assert answer.status_code == 200 and set(answer.json()["answers"]) == {"angry", "topic"}
        assert httpx.get(f"{url}/health", timeout=5).json()["state"] == "warming"  # answered while warming
        gate.touch()
        until(lambda: httpx.get(f"{url}/health", timeout=5).json()["state"] == "ready", "/health to say ready")
    finally:
        stop_process(process, timeout=20)


def test_compile_and_autotune_caches_live_in_the_projects_cache_folder(tmp_path, monkeypatch):
    """Set before a CUDA release loads (Triton reads them when the kernels' modules are imported), so that a later
    process finds what an earlier one compiled and autotuned; a value the operator set is kept."""
    import torch

    monkeypatch.setenv("CLEF_CACHE_DIR", str(tmp_path))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                 "FLA_DISABLE_BACKEND_DISPATCH"):  # restored afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/inductor")
    EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16).apply_process_settings()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/inductor"
