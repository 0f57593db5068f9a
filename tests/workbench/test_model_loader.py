"""The process-wide model manager: default model choice, one load at a time, clear failures, demo fallback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import clef_engine
from clef_engine.errors import ReleaseError
from clef_workbench import model_loader
from clef_workbench.model_loader import DEMO_SOURCE, ModelManager
from tests.support.warm_up import WAIT_SECONDS, held_warm_up, until, warming_engine


class FakeEngine:
    def __init__(self, source):
        self.source = str(source)
        self.closed = False

    def close(self):
        self.closed = True


def failing_at(bad: str, error: Exception):
    """A loader that raises `error` for the source `bad` and loads a FakeEngine for any other."""
    def loader(source):
        if str(source) == bad:
            raise error
        return FakeEngine(source)
    return loader


def test_default_source():
    assert model_loader.default_source({"CLEF_MODEL": " /models/flash "}, cuda=False) == "/models/flash"
    assert model_loader.default_source({}, cuda=True) == "Cloudflare/clef"
    assert model_loader.default_source({}, cuda=False) == DEMO_SOURCE


def test_request_model_name():
    assert model_loader.request_model_name("Cloudflare/clef") == "clef"
    assert model_loader.request_model_name("cloudflare/clef-flash") == "clef-flash"
    assert model_loader.request_model_name(DEMO_SOURCE) == "clef-demo"
    assert model_loader.request_model_name("/models/my-release") == "my-release"


def test_loads_once_even_when_many_sessions_ask():
    calls = []
    gate = threading.Event()

    def loader(source):
        calls.append(source)
        gate.wait(5)
        return FakeEngine(source)

    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"))
    for _ in range(5):
        manager.request("/models/a")
    assert manager.state().loading_source == "/models/a"
    gate.set()
    state = manager.wait(5)
    assert calls == ["/models/a"]
    assert state.engine.source == "/models/a" and state.error is None and not state.is_demo
    manager.request("/models/a")  # already resident: nothing happens
    assert manager.wait(5).engine is state.engine and calls == ["/models/a"]


def test_failed_first_load_falls_back_to_demo_with_the_reason():
    loader = failing_at("/missing", ReleaseError("release folder /missing does not exist"))
    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo-release"))
    manager.request("/missing")
    state = manager.wait(5)
    assert state.is_demo and state.engine.source == "/demo-release"
    assert state.error == "Could not load /missing: release folder /missing does not exist"
    assert "demo model" in state.notice


def test_failed_switch_keeps_the_resident_model():
    loader = failing_at("/broken", MemoryError("CUDA out of memory"))
    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"))
    manager.request("/good")
    first = manager.wait(5).engine
    manager.request("/broken")
    state = manager.wait(5)
    assert state.engine is first and state.source == "/good" and not first.closed
    assert "the GPU ran out of memory" in state.error


def test_switching_closes_the_old_engine():
    manager = ModelManager(loader=FakeEngine, demo_path=lambda: Path("/demo"))
    manager.request("/a")
    first = manager.wait(5).engine
    manager.request(DEMO_SOURCE)
    state = manager.wait(5)
    assert state.is_demo and first.closed


def test_published_models_are_refused_without_cuda(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(model_loader, "cuda_available", lambda: False)
    loaded = []
    manager = ModelManager(loader=lambda s: loaded.append(str(s)) or FakeEngine(s), demo_path=lambda: Path("/demo"))
    manager.request("Cloudflare/clef")
    state = manager.wait(5)
    assert "Clef (27B) needs a CUDA GPU and none is visible here" in state.error
    assert loaded == ["/demo"], "the 27B model must not even start loading on a CPU machine"


def test_describe_failure_for_unexpected_errors():
    assert model_loader.describe_failure("/x", ImportError("No module named 'av'")).startswith(
        "Could not load /x: a Python package is missing")
    assert "Check CLEF_MODEL" in model_loader.describe_failure("/x", RuntimeError("boom"))


def test_real_demo_release_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The real path: the demo release built into a cache folder, loaded on the CPU, answers a request."""
    monkeypatch.setenv("CLEF_CACHE_DIR", str(tmp_path))
    manager = ModelManager()
    manager.request(DEMO_SOURCE)
    state = manager.wait(120)
    assert state.error is None and state.is_demo
    assert clef_engine.is_demo_release(Path(state.engine.info()["path"]))
    response = state.engine.decide({"state": "hello", "questions": {"q": {"type": "noul", "instructions": "Hi?"}}})
    assert 0.0 <= response["answers"]["q"]["noul"] <= 1.0
    state.engine.close()


def test_kernel_summary():
    cpu = {"available": {"flash-linear-attention": False}, "path": "forward_packed",
           "packed": {"gated_delta": "kernels.gated_delta_torch", "causal_conv": "kernels.causal_conv_torch",
                      "reason": "CPU: PyTorch reference kernels"}, "slow_fallbacks": []}
    fast, detail = model_loader.kernel_summary(cpu)
    assert not fast and detail == "forward_packed; CPU: PyTorch reference kernels; flash-linear-attention ✗"
    gpu = {"available": {"flash-linear-attention": True}, "path": "forward_packed",
           "packed": {"gated_delta": "fla.chunk_gated_delta_rule", "causal_conv": "kernels.causal_conv_torch"},
           "slow_fallbacks": []}
    assert model_loader.kernel_summary(gpu)[0]
    assert not model_loader.kernel_summary({**gpu, "slow_fallbacks": ["gated_delta"]})[0]
    assert not model_loader.kernel_summary({"path": "forward_padded", "available": {}})[0]


def test_load_options_come_from_the_environment():
    from clef_engine import EngineConfig
    from clef_workbench.model_loader import load_options

    env = {"CLEF_REVISION": "2f3de3d", "CLEF_DEVICE": "cpu", "CLEF_DTYPE": "bf16", "CLEF_MODEL": "x"}
    assert load_options({}) == {}
    assert load_options(env) == {"revision": "2f3de3d"}  # the engine's own knobs are EngineConfig's to read
    config = EngineConfig.resolve(env=env)
    assert str(config.device) == "cpu" and config.dtype == torch.bfloat16


# --- several models in one process -------------------------------------------------------------------------------


def test_several_models_at_once_with_one_default():
    manager = ModelManager(loader=FakeEngine, demo_path=lambda: Path("/demo"))
    manager.request("/models/a")
    manager.wait(5)
    manager.add("/models/b")
    manager.add("/models/b")  # loading already: nothing more
    manager.add("/models/a")  # resident already: nothing more
    state = manager.wait(5)
    assert state.source == "/models/a" and state.error is None and state.adding == ()
    models = manager.loaded()
    assert [(m.name, m.source, m.is_demo) for m in models] == [("a", "/models/a", False), ("b", "/models/b", False)]
    assert manager.get("b") is models[1].engine and manager.get("/models/b") is models[1].engine
    with pytest.raises(KeyError, match=r"no model named 'c' is loaded \(loaded: a, b\)"):
        manager.get("c")
    manager.set_default("b")
    assert manager.state().engine is models[1].engine and [m.name for m in manager.loaded()] == ["b", "a"]
    manager.remove("b")  # the default: the next resident model takes over
    assert models[1].engine.closed and manager.state().source == "/models/a"
    assert [m.name for m in manager.loaded()] == ["a"]
    with pytest.raises(KeyError, match="loaded: a"):
        manager.remove("b")


def test_switching_the_default_keeps_the_added_models():
    manager = ModelManager(loader=FakeEngine, demo_path=lambda: Path("/demo"))
    manager.request("/a")
    manager.add("/b")
    first = manager.wait(5).engine
    manager.request("/c")
    state = manager.wait(5)
    assert state.source == "/c" and first.closed
    assert [m.name for m in manager.loaded()] == ["c", "b"]


def test_same_folder_names_get_unique_request_names():
    manager = ModelManager(loader=FakeEngine, demo_path=lambda: Path("/demo"))
    manager.add("/x/release")
    manager.wait(5)
    manager.add("/y/release")
    manager.wait(5)
    assert [m.name for m in manager.loaded()] == ["release", "release-2"]


def test_a_failed_add_keeps_what_is_loaded_and_says_why():
    loader = failing_at("/broken", ReleaseError("release folder /broken does not exist"))
    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"))
    manager.request("/good")
    manager.add("/broken")
    state = manager.wait(5)
    assert state.source == "/good" and [m.name for m in manager.loaded()] == ["good"]
    assert state.error == "Could not load /broken: release folder /broken does not exist"


def test_an_add_that_fails_while_the_default_still_loads_keeps_its_message():
    """The default model's load ending after an add failed must not wipe that failure (it did: one error slot, the
    last load to end wrote it, so the sidebar said nothing about the model that did not load)."""
    release = threading.Event()
    failing = failing_at("/broken", ReleaseError("release folder /broken does not exist"))

    def loader(source):
        if source == "/slow":
            release.wait(60)
        return failing(source)

    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"))
    manager.request("/slow")
    manager.add("/broken")
    deadline = time.monotonic() + 60
    while manager.state().adding and time.monotonic() < deadline:  # the add has failed; the default still loads
        time.sleep(0.01)
    release.set()
    state = manager.wait(60)
    assert state.source == "/slow" and [m.name for m in manager.loaded()] == ["slow"]
    assert state.error == "Could not load /broken: release folder /broken does not exist"
    manager.add("/other")  # a later success clears it
    assert manager.wait(60).error is None


def test_added_model_becomes_the_default_when_none_is_resident():
    manager = ModelManager(loader=FakeEngine, demo_path=lambda: Path("/demo"))
    manager.add("/only")
    assert manager.wait(5).source == "/only" and manager.default_name() == "only"


def test_endpoint_sources_load_without_release_options_or_memory_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLEF_REVISION", "abc")  # a Hub revision means nothing to an endpoint
    calls = []

    def loader(source, **options):
        calls.append((str(source), options))
        return FakeEngine(source)

    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"), free_memory=lambda device: 0)
    manager.add("https://user:secret@api.example.com:8443/jev/")
    state = manager.wait(5)
    assert state.error is None and calls == [("https://user:secret@api.example.com:8443/jev/", {})]
    assert manager.loaded()[0].name == "api.example.com:8443-jev"  # never the credentials
    assert model_loader.request_model_name("http://127.0.0.1:8000") == "127.0.0.1:8000"


def test_memory_is_checked_before_loading_with_a_clear_refusal(tiny_release: Path, tmp_path: Path):
    """A model that would not fit in the memory free on its device is refused before a byte is loaded, naming what
    it needs, what is free, and what is loaded."""
    from clef_engine import memory

    need = memory.estimate(tiny_release)
    assert need is not None and need.weights > 0 and need.margin > 0
    free = {"bytes": need.total + 1}
    calls = []

    def loader(source, **options):
        calls.append(str(source))
        return FakeEngine(source)

    second = tmp_path / "second-release"
    second.symlink_to(tiny_release, target_is_directory=True)
    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"), free_memory=lambda device: free["bytes"])
    manager.request(str(tiny_release))
    assert manager.wait(5).error is None and calls == [str(tiny_release)]
    free["bytes"] = need.total - 1  # the first model took its share
    manager.add(str(second))
    state = manager.wait(5)
    assert calls == [str(tiny_release)], "the model that does not fit must not start loading"
    assert [m.source for m in manager.loaded()] == [str(tiny_release)]
    assert f"Could not load {second}: {second} needs ~{memory.gib(need.total)}" in state.error
    assert f"{memory.gib(need.total - 1)} free on cpu with {tiny_release} loaded" in state.error
    assert "Unload a model" in state.error


def test_memory_estimate_scales_with_the_load_dtype_and_knows_the_published_models(tiny_release: Path):
    from clef_engine import EngineConfig, memory

    fp32 = memory.estimate(tiny_release, config=EngineConfig.resolve(device="cpu", dtype="float32", env={}))
    bf16 = memory.estimate(tiny_release, config=EngineConfig.resolve(device="cpu", dtype="bfloat16", env={}))
    on_disk = sum(p.stat().st_size for p in tiny_release.glob("*.safetensors"))
    assert bf16.weights == on_disk and fp32.weights == 2 * on_disk  # the tiny release is saved in bf16
    config = EngineConfig(device=torch.device("cpu"), dtype=torch.bfloat16, token_budget=65_536,
                          state_cache_bytes=8 * memory.GiB)
    clef = memory.estimate("Cloudflare/clef", config=config)
    flash = memory.estimate("Cloudflare/clef-flash", config=config)
    assert clef.weights == 55_000_000_000 and flash.weights == 19_100_000_000
    assert clef.total > flash.total > 8 * memory.GiB + flash.weights
    assert memory.estimate("/no/such/release", config=config) is None


class InfoEngine(FakeEngine):
    """A fake engine that reports what its release or endpoint says about its weights."""

    def info(self):
        return {"random_weights": "random" in self.source}


def test_models_whose_weights_are_random_are_flagged_by_name():
    manager = ModelManager(loader=InfoEngine, demo_path=lambda: Path("/demo"))
    manager.request(DEMO_SOURCE)
    manager.wait(5)
    manager.add("/models/random-tiny")
    manager.add("/models/clef")
    manager.wait(5)
    assert {m.name: m.random_weights for m in manager.loaded()} == {
        "clef-demo": True, "random-tiny": True, "clef": False}
    assert manager.random_weights("random-tiny") and not manager.random_weights("clef")
    manager.remove("random-tiny")
    manager.remove("clef-demo")
    # runs recorded under a demo name stay flagged after it is unloaded; other names are not guessed at
    assert manager.random_weights("clef-demo") and manager.random_weights("clef-demo-2")
    assert not manager.random_weights("random-tiny") and not manager.random_weights("12")


def test_the_sidebar_says_warming_until_the_warm_up_ends(tiny_release, monkeypatch):
    """Issue 38: a model answers as soon as it is loaded, warming up in the background meanwhile."""
    gate = threading.Event()
    held_warm_up(monkeypatch, gate)
    manager = ModelManager(loader=warming_engine)
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
