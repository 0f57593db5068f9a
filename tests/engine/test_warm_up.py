"""Issue 38: a model answers as soon as it is loaded; what is compiled, autotuned and captured for lengths nobody
asked for yet happens afterwards, in the background (`Engine.warm_up_steps`, a thread of the engine's own whose steps
wait for their turn as bulk work), and the engine reads "warming" until it is done, then "ready" (the workbench's
sidebar: tests/workbench/test_model_loader.py; /health: tests/api/test_server.py). On the tiny release (CPU), warm-up
held at a step that waits for the test (tests/support/warm_up.py), so every "before" and "after" is an event."""

from __future__ import annotations

import os
import threading

import torch

from clef_engine.config import EngineConfig
from clef_engine.fast.graphs import PrefillGraphs
from clef_engine.fast.packed import PackedBackbone
from tests.support.warm_up import held_warm_up, until, warming_engine

REQUEST = {"state": "The parcel arrived crushed and nobody answers my emails.",
           "questions": {"angry": {"type": "noul", "instructions": "Is the customer angry?"},
                         "topic": {"type": "choice", "instructions": "What is it about?",
                                   "criteria": {"shipping": None, "billing": None, "other": None}}}}
SAME = 1e-5


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


def test_requests_run_on_the_plain_kernels_until_the_warm_up_has_compiled_the_fast_ones(tiny_release, monkeypatch):
    """On a cold machine the fast kernels' compiles take longer than loading: the engine answers on the plain PyTorch
    kernels while the warm-up chooses and compiles them on its own thread, then switches, with the same answers."""
    from clef_engine.fast import kernels

    compiling, gate = threading.Event(), threading.Event()
    fast_rms_norm_calls = []

    def fast_rms_norm(*args, **kwargs):  # stands for a compiled kernel: the same function under another name
        fast_rms_norm_calls.append(threading.current_thread().name)
        return kernels.rms_norm_torch(*args, **kwargs)

    def select_kernels(self):
        compiling.set()
        gate.wait()
        return kernels.Kernels(rms_norm=fast_rms_norm)

    monkeypatch.setattr(PackedBackbone, "select_kernels", select_kernels)
    engine = warming_engine(tiny_release)
    try:
        until(compiling.is_set, "the warm-up to choose the fast kernels")
        during = engine.probabilities([REQUEST])[0]  # answered while the fast kernels compile
        assert engine.state == "warming" and engine.runner.backbone.kernels.rms_norm is kernels.rms_norm_torch
        assert fast_rms_norm_calls == []
        gate.set()
        until(lambda: engine.state == "ready", "the warm-up to end")
        assert engine.info()["kernels"]["packed"]["rms_norm"].endswith("fast_rms_norm")
        calls = len(fast_rms_norm_calls)
        after = engine.probabilities([REQUEST])[0]
        assert len(fast_rms_norm_calls) > calls  # the request ran on the fast kernels
        assert max(abs(a - b) for x, y in zip(during, after) for a, b in zip(x, y)) <= SAME
    finally:
        gate.set()
        engine.close(wait=True)


def test_the_warm_up_compiles_the_kernels_that_continue_from_a_kept_state(tiny_engine, monkeypatch):
    """A sweep's first case and a re-run's first batch keep a state and continue from it: on the H200 the compiles
    and autotuning of those kernels slowed a sweep's first 20 cases by ~14 s. The warm-up's compile of the chosen
    kernels runs them too."""
    from clef_engine.fast import kernels

    continued: list[int] = []

    def attention_after_prefixes(*args, **kwargs):  # the chosen kernel, as the plain one under another name
        continued.append(1)
        return kernels.attention_after_prefixes(*args, **kwargs)

    monkeypatch.setattr(PackedBackbone, "select_kernels",
                        lambda self: kernels.Kernels(attention_after_prefixes=attention_after_prefixes))
    monkeypatch.setattr(tiny_engine.runner, "plain_until_warm", True)  # as on CUDA with a warm-up
    chosen = tiny_engine.runner.compile_fast_kernels()
    assert chosen is not None and chosen.attention_after_prefixes is attention_after_prefixes
    assert continued


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
        # at most the held step was done (the switch to the fast kernels, queued first, is not a counted step)
        assert answer.result()[0]["answers"] and answered_after[0] <= 1
    finally:
        blocker.set()
        gate.set()
        engine.close(wait=True)


def test_a_bucket_not_captured_yet_runs_eagerly_while_the_warm_up_captures(tiny_engine):
    graphs = PrefillGraphs(tiny_engine.runner.backbone, max_tokens=256)
    graphs.capture_on_use = False  # as while warming
    assert graphs.run(torch.zeros(40, dtype=torch.long)) is None
    assert graphs.captures == 0 and graphs.disabled is None  # nothing tried in the request's time


def test_compile_and_autotune_caches_live_in_the_projects_cache_folder(tmp_path, monkeypatch):
    """Set before a CUDA release loads (Triton reads them when the kernels' modules are imported), so that a later
    process finds what an earlier one compiled and autotuned; a value the operator set is kept."""
    monkeypatch.setenv("CLEF_CACHE_DIR", str(tmp_path))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                 "FLA_DISABLE_BACKEND_DISPATCH"):  # restored afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/inductor")
    EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16).apply_process_settings()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/inductor"
