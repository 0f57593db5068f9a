"""Which models the workbench runs, loaded once per process and shared by every browser session.

One process holds one or more resident models (local engines sharing one GPU queue per device, remote endpoints),
one of them the default. Loading runs in a background thread so every page can show progress instead of freezing,
and a second session asking for the same model waits for the same load. A failed load ends in a message saying
what failed and what to do; when nothing is resident the workbench then falls back to the demo model so it stays
usable. Switching or adding a model does so for every session (there is one GPU).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from clef_engine.remote import is_endpoint
from clef_workbench.settings import WorkbenchSettings

log = logging.getLogger(__name__)

DEMO_SOURCE = "demo"
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


def default_source(env: Mapping[str, str] | None = None, *, cuda: bool | None = None) -> str:
    """CLEF_MODEL if set; otherwise Clef when a CUDA GPU is present, else the demo model."""
    configured = WorkbenchSettings.from_env(env).model
    if configured:
        return configured
    if cuda is None:
        cuda = cuda_available()
    return CLEF_REPO if cuda else DEMO_SOURCE


def load_options(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """clef_engine.load keyword arguments the workbench adds: the Hub revision (CLEF_REVISION). The engine's own
    knobs (CLEF_DEVICE, CLEF_DTYPE, ...) are read by the engine's EngineConfig, in one place."""
    revision = WorkbenchSettings.from_env(env).revision
    return {"revision": revision} if revision else {}


def label_of(source: str) -> str:
    return MODEL_LABELS.get(source, source)


def request_model_name(source: str | None) -> str:
    """The `model` field the workbench puts in requests (the response echoes it): a short name, not a path."""
    if not source:
        return "clef"
    names = {CLEF_REPO.lower(): "clef", CLEF_FLASH_REPO.lower(): "clef-flash", DEMO_SOURCE: "clef-demo"}
    if is_endpoint(source):  # host[:port][/path], never a key or scheme
        parts = urlsplit(source.strip())
        host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        return (host + parts.path.rstrip("/")).replace("/", "-") or "remote"
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
class LoadedModel:
    """One resident model: `name` is its short request name (request_model_name, made unique in the process)."""

    name: str
    source: str  # a repo id, a release folder, "demo", or an endpoint URL
    label: str
    engine: Any
    is_demo: bool
    random_weights: bool = False  # its answers mean nothing: the demo, a release or endpoint that says so


def is_demo_name(name: str | None) -> bool:
    """Whether `name` is the demo model's request name (made unique in a process by a number: clef-demo-2)."""
    demo = request_model_name(DEMO_SOURCE)
    base = (name or "").split("@")[0]
    return base == demo or (base.startswith(demo + "-") and base.removeprefix(demo + "-").isdigit())


def reported_info(engine: Any) -> dict[str, Any]:
    """What an engine says of itself (whether its weights are random: a local release's config.json, an endpoint's
    /v1/models), or {} when it cannot say: it is taken at its word of nothing."""
    try:
        return engine.info() or {}
    except Exception:  # noqa: BLE001 — a model that answers is still resident
        log.warning("could not ask %r what it is", engine, exc_info=True)
        return {}


@dataclass(frozen=True)
class LoadState:
    """A snapshot for the UI, of the default model. `engine` is its resident engine (None until one loaded)."""

    engine: Any
    source: str | None  # what `engine` was loaded from (a repo id, a folder, or "demo")
    loading_source: str | None  # a load of the default model in progress
    loading_seconds: float
    error: str | None  # the last failure, kept until a load succeeds for the source that failed
    notice: str | None  # e.g. "fell back to the demo model because …"
    adding: tuple[str, ...] = ()  # additional models loading now (ModelManager.add)

    @property
    def is_demo(self) -> bool:
        return self.source == DEMO_SOURCE

    @property
    def busy(self) -> bool:
        """A model is loading (the default or an added one)."""
        return self.loading_source is not None or bool(self.adding)

    @property
    def status(self) -> str:
        """Of the default model: "loading"; "warming" while its engine compiles and captures in the background (it
        answers meanwhile, see clef_engine's Engine.state); "ready"; or "none" when no model is resident. An engine
        that does not warm up (a remote endpoint) is ready once loaded."""
        if self.loading_source is not None:
            return "loading"
        if self.engine is None:
            return "none"
        return getattr(self.engine, "state", "ready")

    def status_line(self) -> str | None:
        """The sidebar's line about the default model while it is not ready yet, else None."""
        if self.status == "loading":
            return f"Loading {label_of(self.loading_source or '')}… {self.loading_seconds:.0f} s"
        if self.status == "warming":
            return (f"Warming up {label_of(self.source or '')}: it answers now; lengths not asked for yet are "
                    "compiled and captured in the background, and requests go first.")
        return None


class ModelManager:
    """Holds the resident models (Clef and Clef-Flash on one H200, a remote endpoint beside them); thread-safe, one
    per process. The local ones share their device's GPU queue (clef_engine.scheduler.GpuTurn). `request` / `state` /
    `wait` are about the default model, `add` / `remove` / `get` / `loaded` about all. A local release's memory need
    is checked against its device's free memory first (clef_engine.memory), so a model that would not fit is refused
    naming the models loaded, not by an out-of-memory error halfway through."""

    def __init__(self, loader: Callable[..., Any] | None = None, demo_path: Callable[[], Path] | None = None,
                 free_memory: Callable[..., int] | None = None):
        import clef_engine
        from clef_engine import memory

        self._loader = loader or clef_engine.load
        self._demo_path = demo_path or clef_engine.demo_release
        self._free_memory = free_memory or memory.free_bytes
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._models: dict[str, LoadedModel] = {}  # by name, in load order
        self._default: str | None = None
        self._requested: str | None = None  # the model `request` loaded: the one a later `request` replaces
        self._loading: str | None = None
        self._loading_since = 0.0
        self._adding: dict[str, float] = {}  # source → loading since
        self._error: str | None = None
        self._error_at = 0.0  # when the load that set `_error` ended
        self._notice: str | None = None

    # ---- the default model (what pages that run one model use) ---------------------------------------------------

    def state(self) -> LoadState:
        with self._lock:
            seconds = time.monotonic() - self._loading_since if self._loading else 0.0
            default = self._models.get(self._default) if self._default else None
            return LoadState(default.engine if default else None, default.source if default else None,
                             self._loading, seconds, self._error, self._notice, tuple(self._adding))

    def request(self, source: str) -> None:
        """Make `source` the default model, replacing (and unloading) the model the last `request` loaded; models
        from `add` stay. Loads it unless it is resident already. Returns at once; nothing happens while another
        `request` load runs."""
        source = source.strip()
        with self._lock:
            if self._loading is not None or source in self._adding:
                return
            resident = self._by_source(source)
            if resident is not None:
                old = self._models.pop(self._requested, None) if self._requested not in (None, resident.name) else None
                self._default = self._requested = resident.name
                if old is not None:
                    old.engine.close()
                return
            self._loading = source
            self._loading_since = time.monotonic()
        threading.Thread(target=self._load, args=(source,), name=f"clef-load-{source}",
                         daemon=True).start()

    def wait(self, timeout: float | None = None) -> LoadState:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while self._loading is not None or self._adding:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._done.wait(remaining)
        return self.state()

    # ---- several models ------------------------------------------------------------------------------------------

    def loaded(self) -> list[LoadedModel]:
        """The resident models, the default first, then in load order."""
        with self._lock:
            return sorted(self._models.values(), key=lambda m: m.name != self._default)

    def get(self, name: str) -> Any:
        """The engine of the model named `name` (or loaded from the source `name`)."""
        with self._lock:
            return (self._models.get(name) or self._by_source(name) or self._named(name)).engine

    def random_weights(self, name: str | None) -> bool:
        """Whether answers recorded as coming from the model `name` come from random weights: a resident model by
        its flag; a name no longer loaded by the demo's name (a run of an unloaded demo is still demo output)."""
        with self._lock:
            model = self._models.get(name or "")
        return model.random_weights if model is not None else is_demo_name(name)

    def default_name(self) -> str | None:
        with self._lock:
            return self._default

    def set_default(self, name: str) -> None:
        with self._lock:
            self._default = self._named(name).name

    def add(self, source: str) -> None:
        """Start loading `source` as an additional model (background thread; `state().adding` and `wait` follow it).
        Nothing happens when it is resident or loading already. A failure is kept in `state().error`."""
        source = source.strip()
        with self._lock:
            if not source or self._by_source(source) is not None or source in self._adding or \
                    source == self._loading:
                return
            self._adding[source] = time.monotonic()
        threading.Thread(target=self._load, args=(source,), kwargs={"adding": True},
                         name=f"clef-add-{source}", daemon=True).start()

    def remove(self, name: str) -> None:
        """Unload the model named `name` (its worker finishes queued jobs, then exits). When it was the default, the
        next resident model becomes the default. Raises KeyError when no such model is loaded."""
        with self._lock:
            model = self._models.pop(self._named(name).name)
            if self._requested == name:
                self._requested = None
            if self._default == name:
                self._default = next(iter(self._models), None)
        model.engine.close()

    # ---- loading -------------------------------------------------------------------------------------------------

    def _named(self, name: str) -> LoadedModel:  # the lock held
        if name not in self._models:
            raise KeyError(f"no model named {name!r} is loaded (loaded: {', '.join(self._models) or 'none'})")
        return self._models[name]

    def _by_source(self, source: str) -> LoadedModel | None:
        return next((m for m in self._models.values() if m.source == source), None)

    def _unique_name(self, source: str) -> str:
        base = request_model_name(source)
        name, n = base, 2
        while name in self._models:
            name, n = f"{base}-{n}", n + 1
        return name

    def _check_memory(self, source: str, path: Any) -> None:
        from clef_engine import memory

        with self._lock:
            resident = [m.label for m in self._models.values() if not is_endpoint(m.source)]
        memory.check_fits(path, label=label_of(source), revision=load_options().get("revision"), loaded=resident,
                          free=self._free_memory)

    def _load_one(self, source: str) -> Any:
        if is_endpoint(source):  # a System One endpoint: no weights here (key from CLEF_API_KEY, never stored)
            return self._loader(source)
        if source == DEMO_SOURCE:
            path = self._demo_path()
            self._check_memory(source, path)
            return self._loader(path)
        if source.lower() in GPU_ONLY_SOURCES and not cuda_available():
            from clef_engine.errors import ReleaseError

            raise ReleaseError(f"{label_of(source)} needs a CUDA GPU and none is visible here. Run the workbench on "
                               "a GPU machine (see README), or use the demo model to try the workbench.")
        self._check_memory(source, source)
        return self._loader(source, **load_options())

    def _try_load(self, source: str) -> tuple[Any, str | None]:
        """(its engine, None), or (None, what failed and what to do)."""
        try:
            return self._load_one(source), None
        except Exception as exc:  # noqa: BLE001 — any failure becomes a message; the app must not show a traceback
            log.exception("loading %s failed", label_of(source))  # the traceback for the operator's log
            return None, describe_failure(source, exc)

    def _load(self, source: str, *, adding: bool = False) -> None:
        """The thread of a `request` (the new default, replacing the model the last one loaded) or of an `add`."""
        started = time.monotonic()
        engine, error = self._try_load(source)
        loaded_source, notice = source, None
        if engine is None and not adding and source != DEMO_SOURCE and not self._models:
            # Nothing is resident: fall back to the demo model so the workbench stays usable.
            engine, demo_error = self._try_load(DEMO_SOURCE)
            if engine is None:
                error = f"{error} The demo model failed too: {demo_error}"
            else:
                loaded_source = DEMO_SOURCE
                notice = "Running on the demo model because the requested model could not be loaded."
        old = None
        with self._done:
            if engine is not None:
                if not adding and self._requested is not None:
                    old = self._models.pop(self._requested, None)
                demo, info = loaded_source == DEMO_SOURCE, reported_info(engine)
                model = LoadedModel(self._unique_name(loaded_source), loaded_source, label_of(loaded_source), engine,
                                    demo, demo or bool(info.get("random_weights")))
                self._models[model.name] = model
                if adding:
                    self._default = self._default or model.name
                else:
                    self._default = self._requested = model.name
                    self._notice = notice
            # its failure is shown; its success clears only a failure of a load that ended before it started (an
            # add that failed meanwhile stays shown)
            if error is not None or self._error_at <= started:
                self._error, self._error_at = error, time.monotonic()
            if adding:
                self._adding.pop(source, None)
            else:
                self._loading = None
            self._done.notify_all()
        if old is not None and old.engine is not engine:
            old.engine.close()  # the worker finishes queued jobs, then exits; memory goes with the last reference


_shared: ModelManager | None = None
_shared_lock = threading.Lock()


def shared_manager() -> ModelManager:
    """The process's one ModelManager, shared by every browser session and the HTTP API (its resident models, one
    GPU queue). The first call starts loading the default model (CLEF_MODEL, else Clef on CUDA, else the demo)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ModelManager()
            _shared.request(default_source())
        return _shared
