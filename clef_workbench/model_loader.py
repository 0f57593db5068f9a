"""Which model the workbench runs, loaded once per process and shared by every browser session.

One process holds one resident engine (one GPU queue). Loading runs in a background thread so every page can show
progress instead of freezing, and a second session asking for the same model waits for the same load. A failed
load ends in a message saying what failed and what to do; the workbench then falls back to the demo model so it
stays usable. Switching the model switches it for every session (there is one GPU).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

DEMO_SOURCE = "demo"
MODEL_ENV = "CLEF_MODEL"
CLEF_REPO = "Cloudflare/clef"
CLEF_FLASH_REPO = "Cloudflare/clef-flash"
# The published models need a CUDA GPU: on CPU they would need ~110 GB (Clef) / ~38 GB (Flash) of RAM in float32
# and minutes per record, so we refuse them there rather than let a machine swap itself to death.
GPU_ONLY_SOURCES = {CLEF_REPO.lower(), CLEF_FLASH_REPO.lower(), "clef", "clef-flash"}
MODEL_LABELS = {
    CLEF_REPO: "Clef (27B)",
    CLEF_FLASH_REPO: "Clef-Flash (9B)",
    DEMO_SOURCE: "Demo model (random weights)",
}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_source(env: dict[str, str] | None = None, *, cuda: bool | None = None) -> str:
    """CLEF_MODEL if set; otherwise Clef when a CUDA GPU is present, else the demo model."""
    env = os.environ if env is None else env
    configured = (env.get(MODEL_ENV) or "").strip()
    if configured:
        return configured
    if cuda is None:
        cuda = cuda_available()
    return CLEF_REPO if cuda else DEMO_SOURCE


def load_options(env: dict[str, str] | None = None) -> dict[str, str]:
    """clef_engine.load keyword arguments the workbench adds: the Hub revision (CLEF_REVISION). The engine's own
    knobs (CLEF_DEVICE, CLEF_DTYPE, ...) are read by the engine's EngineConfig, in one place."""
    env = os.environ if env is None else env
    revision = (env.get("CLEF_REVISION") or "").strip()
    return {"revision": revision} if revision else {}


def label_of(source: str) -> str:
    return MODEL_LABELS.get(source, source)


def request_model_name(source: str | None) -> str:
    """The `model` field the workbench puts in requests (the response echoes it): a short name, not a path."""
    from pathlib import Path

    if not source:
        return "clef"
    names = {CLEF_REPO.lower(): "clef", CLEF_FLASH_REPO.lower(): "clef-flash", DEMO_SOURCE: "clef-demo"}
    return names.get(source.lower(), Path(source).name or source)


def kernel_summary(kernels: dict[str, Any]) -> tuple[bool, str]:
    """(fast kernels on?, a one-line detail) from engine.info()["kernels"]. "On" means the packed path runs with
    optimized kernels (e.g. flash-linear-attention's gated delta rule), not the PyTorch reference ones."""
    packed = kernels.get("packed") or {}
    compute = [v for k, v in packed.items() if k not in ("reason",) and isinstance(v, str)]
    fast = bool(compute) and any(not name.endswith("_torch") for name in compute
                                 if "delta" in name or "conv" in name) and not kernels.get("slow_fallbacks")
    available = ", ".join(f"{name} {'✓' if ok else '✗'}" for name, ok in (kernels.get("available") or {}).items())
    detail = "; ".join(part for part in (kernels.get("path", ""), packed.get("reason", ""), available) if part)
    return fast, detail


def describe_failure(source: str, error: BaseException) -> str:
    """What failed and what to do, in one paragraph, for any exception a load can raise."""
    from clef_engine.errors import ReleaseError

    what = f"Could not load {label_of(source)}"
    if isinstance(error, ReleaseError):
        return f"{what}: {error}"
    name = type(error).__name__
    if "OutOfMemory" in name or "out of memory" in str(error).lower():
        return (f"{what}: the GPU ran out of memory ({error}). Choose Clef-Flash, free the GPU from other "
                "processes, or use a GPU with more memory.")
    if isinstance(error, ImportError):
        return (f"{what}: a Python package is missing ({error}). Install the requirements: "
                "pip install -r requirements.txt")
    if isinstance(error, OSError):
        return f"{what}: a file could not be read ({error}). Check the path, disk space and permissions."
    return f"{what}: {name}: {error}. Check CLEF_MODEL or choose another model in the sidebar."


@dataclass(frozen=True)
class LoadState:
    """A snapshot for the UI. `engine` is the resident engine (None until one loaded)."""

    engine: Any
    source: str | None  # what `engine` was loaded from (a repo id, a folder, or "demo")
    loading_source: str | None  # a load in progress
    loading_seconds: float
    error: str | None  # the last failure, kept until a load succeeds for the source that failed
    notice: str | None  # e.g. "fell back to the demo model because …"

    @property
    def is_demo(self) -> bool:
        return self.source == DEMO_SOURCE


class ModelManager:
    """Holds the resident engine. Thread-safe; every Streamlit session of the process shares one instance."""

    def __init__(self, loader=None, demo_path=None):
        import clef_engine

        self._loader = loader or clef_engine.load
        self._demo_path = demo_path or clef_engine.demo_release
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._engine: Any = None
        self._source: str | None = None
        self._loading: str | None = None
        self._loading_since = 0.0
        self._error: str | None = None
        self._notice: str | None = None

    def state(self) -> LoadState:
        with self._lock:
            seconds = time.monotonic() - self._loading_since if self._loading else 0.0
            return LoadState(self._engine, self._source, self._loading, seconds, self._error, self._notice)

    def request(self, source: str) -> None:
        """Start loading `source` unless it is resident or already loading. Returns at once."""
        source = source.strip()
        with self._lock:
            if self._loading is not None or (self._engine is not None and self._source == source):
                return
            self._loading = source
            self._loading_since = time.monotonic()
        threading.Thread(target=self._load, args=(source,), name=f"clef-load-{source}", daemon=True).start()

    def wait(self, timeout: float | None = None) -> LoadState:
        """Block until no load is in progress (or the timeout passes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while self._loading is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._done.wait(remaining)
        return self.state()

    def _load_one(self, source: str) -> Any:
        if source == DEMO_SOURCE:
            return self._loader(self._demo_path())
        if source.lower() in GPU_ONLY_SOURCES and not cuda_available():
            from clef_engine.errors import ReleaseError

            raise ReleaseError(f"{label_of(source)} needs a CUDA GPU and none is visible here. Run the workbench on "
                               "a GPU machine (see README), or use the demo model to try the workbench.")
        return self._loader(source, **load_options())

    def _load(self, source: str) -> None:
        engine, error, notice = None, None, None
        loaded_source = source
        try:
            engine = self._load_one(source)
        except Exception as exc:  # noqa: BLE001 — any failure becomes a message; the app must not show a traceback
            error = describe_failure(source, exc)
        if engine is None and source != DEMO_SOURCE and self._engine is None:
            # Nothing is resident: fall back to the demo model so the workbench stays usable.
            try:
                engine = self._load_one(DEMO_SOURCE)
                loaded_source = DEMO_SOURCE
                notice = "Running on the demo model because the requested model could not be loaded."
            except Exception as exc:  # noqa: BLE001
                error = f"{error} The demo model failed too: {describe_failure(DEMO_SOURCE, exc)}"
        with self._done:
            if engine is not None:
                old = self._engine if self._engine is not engine else None
                self._engine, self._source = engine, loaded_source
                self._error = error
                self._notice = notice
                if old is not None:
                    old.close()  # the worker finishes queued jobs, then exits; memory goes with the last reference
            else:
                self._error = error
            self._loading = None
            self._done.notify_all()


_shared: ModelManager | None = None
_shared_lock = threading.Lock()


def shared_manager() -> ModelManager:
    """The process's one ModelManager, shared by every browser session and the HTTP API (one resident model, one
    GPU queue). The first call starts loading the default model (CLEF_MODEL, else Clef on CUDA, else the demo)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ModelManager()
            _shared.request(default_source())
        return _shared
