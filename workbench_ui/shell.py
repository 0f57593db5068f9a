"""The Streamlit shell: the process-wide engine, store and runners, the sidebar, kept widgets, the GPU queue."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import streamlit as st

from clef_engine.remote import is_endpoint
from clef_workbench import calibration, model_loader
from clef_workbench.model_loader import ModelManager, label_of
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.settings import WorkbenchSettings
from workbench_ui import links
from workbench_ui.decide_model import KEEP_PREFIX, forget_kept, kept, set_kept
from workbench_ui.state_input import IMAGE_EXTENSIONS, MAX_IMAGE_BYTES, MB

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STATUS_REFRESH_SECONDS = WorkbenchSettings.from_env().status_refresh_s  # how often the sidebar status redraws itself
PAGES_DIR = Path(__file__).resolve().parents[1] / "pages"
PAGE_SPECS = [
    ("decide.py", "Decide", ":material/psychology:"),
    ("schemas.py", "Schemas", ":material/schema:"),
    ("cases.py", "Case sets", ":material/dataset:"),
    ("runs.py", "Runs", ":material/speed:"),
    ("review.py", "Review", ":material/fact_check:"),
    ("compare.py", "Compare", ":material/compare_arrows:"),
    ("sweeps.py", "Sweeps", ":material/leaderboard:"),
]


def render_shell(page_file: str) -> None:
    """Every page's first call: the tab's title, the navigation and the sidebar."""
    name = Path(page_file).name
    title, icon = next((title, icon) for file, title, icon in PAGE_SPECS if file == name)
    st.set_page_config(page_title=f"{title} · Clef Workbench", page_icon=icon, layout="wide")
    with st.sidebar:
        for file, page_title, page_icon in PAGE_SPECS:
            if (PAGES_DIR / file).is_file():
                st.page_link(f"pages/{file}", label=page_title, icon=page_icon)
    render_sidebar()  # before the page, so a page that stops early (st.stop) still has it; its status refreshes itself


model_manager = model_loader.shared_manager  # one per process, shared by all sessions and the HTTP API


@st.cache_resource(show_spinner=False)
def get_store():
    from clef_workbench.store import Store

    return Store(WorkbenchSettings.from_env().db_path)


# The process-wide runners: batch runs and sweeps keep going across page switches, reloads and sessions.
def get_job_runner():
    return _runner("runs", str(get_store().path))


def get_sweep_runner():
    return _runner("sweeps", str(get_store().path))


@st.cache_resource(show_spinner=False)
def _runner(kind: str, db_path: str):
    from clef_workbench.distributed import make_job_runner  # on Ray when CLEF_RAY_ADDRESS is set
    from clef_workbench.store import Store
    from clef_workbench.sweep_runner import SweepRunner

    return make_job_runner(Store(db_path)) if kind == "runs" else SweepRunner(Store(db_path))


def get_library() -> SchemaLibrary:
    """The schema library folder (CLEF_SCHEMAS_DIR), its history in the store. Cheap: reads files on demand."""
    return SchemaLibrary(history=get_store())


def get_engine(*, show_errors: bool = True):
    """The resident engine, waiting while a load runs; None (the reason shown) when none is loaded."""
    manager = model_manager()
    state = manager.state()
    # always there: the page's elements keep their places when the load ends (a redraw drops what is being typed)
    loading_area = st.container()
    if state.loading_source is not None:
        with loading_area.status(f"Loading {label_of(state.loading_source)}…", expanded=True) as status:
            line = st.empty()
            while state.loading_source is not None:
                line.write(f"{state.loading_seconds:.0f} s elapsed. Clef reads 55 GB of weights, Clef-Flash 19 GB; "
                           "the demo model takes a few seconds.")
                state = manager.wait(timeout=1.0)
            if state.engine is None:
                status.update(label="Loading failed", state="error", expanded=False)
            else:
                status.update(label=f"Loaded {label_of(state.source)}", state="complete", expanded=False)
    if show_errors and state.error:
        st.error(state.error, icon=":material/warning:")
    if show_errors and state.notice:
        st.info(state.notice)
    return state.engine


def random_weights_text(model_name: str) -> str:
    demo = "**Demo model.** " if model_loader.is_demo_name(model_name) else ""
    return (f"{demo}**{model_name} has random weights: its answers mean nothing.** Accuracy, calibration and "
            "confidences from it say nothing about Clef; use Clef or Clef-Flash for answers to act on.")


def random_weights_notice(model_name: str | None) -> None:
    if model_name and model_manager().random_weights(model_name):
        st.warning(random_weights_text(model_name), icon=":material/casino:")


def _gib(n: int | None) -> str:
    return "–" if not n else f"{n / 2**30:.1f} GiB"


MODEL_CHOICES = {"Clef (27B)": model_loader.CLEF_REPO, "Clef-Flash (9B)": model_loader.CLEF_FLASH_REPO,
                 "Local release folder": "local", "System One endpoint (URL)": "endpoint",
                 "Demo model (random weights)": model_loader.DEMO_SOURCE}
SOURCE_INPUTS = {"local": ("Release folder", "/models/clef-flash"),
                 "endpoint": ("Endpoint URL (key from CLEF_API_KEY, never stored)", "https://host:8000")}


def pick_source(label: str, key: str, current: str | None = None) -> str:
    """A model source from MODEL_CHOICES, with a text box for a folder or an endpoint URL."""
    current_choice = ("Demo model (random weights)" if not current else "System One endpoint (URL)"
                      if is_endpoint(current) else
                      next((label for label, src in MODEL_CHOICES.items() if src == current), "Local release folder"))
    picked = st.selectbox(label, list(MODEL_CHOICES), index=list(MODEL_CHOICES).index(current_choice),
                          key=f"{key}_choice")
    source = MODEL_CHOICES[picked]
    if source in SOURCE_INPUTS:
        text_label, placeholder = SOURCE_INPUTS[source]
        source = st.text_input(text_label, value=current if picked == current_choice and current else "",
                               key=f"{key}_{source}", placeholder=placeholder).strip()
    return source


# No ellipsis nor word broken across lines at 1024 px: labels and values wrap between words, buttons are as wide as
# their longest word, margins shrink below 1280 px. Decide's Images uploader states the images' limit, not its own.
PAGE_STYLE = """<style>
button [data-testid="stMarkdownContainer"], button [data-testid="stMarkdownContainer"] *,
[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] *,
[data-testid="stMetricValue"], [data-testid="stMetricValue"] * {
  white-space: normal !important; overflow: visible !important; text-overflow: clip !important;
  overflow-wrap: normal !important; word-break: normal !important; }
[data-testid^="stBaseButton"] { min-width: min-content; }
[data-testid="stMetricValue"] { font-size: clamp(1.25rem, 2vw, 2.25rem); }
@media (max-width: 1280px) { [data-testid="stMainBlockContainer"] { padding-left: 2rem; padding-right: 2rem; } }
.st-key-decide-images [data-testid="stFileUploaderDropzoneInstructions"] span { font-size: 0; }
.st-key-decide-images [data-testid="stFileUploaderDropzoneInstructions"] span::after {
  content: "IMAGE_LIMIT per file • IMAGE_TYPES"; font-size: 0.875rem; }
</style>""".replace("IMAGE_LIMIT", f"{MAX_IMAGE_BYTES // MB} MB").replace(
    "IMAGE_TYPES", ", ".join(extension.upper() for extension in IMAGE_EXTENSIONS if extension != "jpeg"))


def render_sidebar() -> None:
    """The default model's selector, the other resident models and the status, drawn before the page."""
    st.html(PAGE_STYLE)
    manager = model_manager()
    state = manager.state()
    with st.sidebar:
        st.subheader("Model")
        current = state.loading_source or state.source
        if st.session_state.get("sidebar.model_shown") != current:
            # the default changed (Make default, a load from another session): the selector shows the new one
            for stale in ("sidebar.model_choice", *(f"sidebar.model_{kind}" for kind in SOURCE_INPUTS)):
                st.session_state.pop(stale, None)
            st.session_state["sidebar.model_shown"] = current
        source = pick_source("Model (shared by all sessions)", "sidebar.model", current)
        resident = next((m for m in manager.loaded() if m.source == source), None)
        if source and source != current and resident is not None:
            if st.button(f"Make {resident.name} the default", key="sidebar.make_default"):
                manager.set_default(resident.name)
                st.rerun()
        elif source and source != current:
            st.caption("Switching reloads the model for every open session.")
            if st.button(f"Load {label_of(source)}", key="sidebar.load"):
                manager.request(source)
                st.rerun()
        # the list redraws itself while a model is added, so it shows the new one at once
        redrawn_while(bool(state.adding), lambda: render_models(manager))
        st.divider()
        # the model status, refreshing itself only while a model loads (never rerunning the page: stale values)
        redrawn_while(state.status in ("loading", "warming") or bool(state.adding), render_status)
        render_add_model(manager)
        if get_store().read_only:
            st.warning(f"The database {get_store().path.name} is read-only for this user: you can look at everything, "
                       "nothing is saved.", icon=":material/lock:")


def render_models(manager: ModelManager) -> None:
    """Every resident model when there are several, with Make default and Unload (asked first)."""
    models = manager.loaded()
    if len(models) > 1:
        st.caption("Loaded models (the API and the Decide and Runs pages pick among them):")
    confirming = st.session_state.get("sidebar.confirm_remove")
    for index, model in enumerate(models if len(models) > 1 else []):
        st.markdown(f"**{model.name}**" + (" (default)" if index == 0 else "")
                    + (" · random weights" if model.random_weights else "")
                    + f"  \n{model.label}")
        # stacked, not side by side: half the sidebar's width cut "Make default" to "Make def…"
        if index and st.button("Make default", key=f"sidebar.default.{model.name}", icon=":material/star:",
                               help="The model pages and API requests use unless they pick another"):
            manager.set_default(model.name)
            st.rerun()
        if st.button("Unload…", key=f"sidebar.remove.{model.name}", icon=":material/close:"):
            st.session_state["sidebar.confirm_remove"] = confirming = model.name
        # the question right under the button that asked it
        if confirming == model.name and confirm(
                f"Unload {model.name}? Runs on it stop after their batch in flight; you can load it again.",
                page_key("sidebar"), "sidebar.confirm_remove", yes_label="Yes, unload", icon=None):
            with contextlib.suppress(KeyError):  # unloaded meanwhile by another session
                manager.remove(model.name)
            st.rerun()


def render_add_model(manager: ModelManager) -> None:
    # open while this session's add has news: a rerun would draw it closed, hiding its progress
    with st.expander("Add a model", icon=":material/add:", expanded=ADDED_KEY in st.session_state,
                     key="sidebar.add_box"):
        st.caption("Loads beside the others (each keeps its own engine; local ones share the GPU's queue). Memory "
                   "is checked first: a model that does not fit is refused.")
        source = pick_source("Model to add", "sidebar.add")
        loaded_sources = {m.source for m in manager.loaded()}
        if st.button("Add", key="sidebar.add", disabled=not source or source in loaded_sources):
            manager.add(source)
            st.session_state[ADDED_KEY] = source
            st.rerun()  # drawn again with the list of models following the load
        if added := st.session_state.get(ADDED_KEY):
            redrawn_while(added in manager.state().adding, follow_add)  # redraws itself until the load ends


ADDED_KEY = "sidebar.added"  # the model this session last asked to add: its progress and outcome show under Add


def follow_add() -> None:
    manager = model_manager()
    source = st.session_state.get(ADDED_KEY)
    state = manager.state()
    added = next((m for m in manager.loaded() if m.source == source), None)
    if source in state.adding:
        st.info(f"Adding {label_of(source)}… The list of models shows it when it has loaded.",
                icon=":material/hourglass_top:")
    elif added is not None:
        st.success(f"Added {added.name}: pick it on the Decide and Runs pages, or make it the default above.",
                   icon=":material/check_circle:")
    elif state.error:
        st.error(state.error, icon=":material/error:")


def redrawn_while(busy: bool, draw: Callable[[], None]) -> None:
    """`draw` now, and while `busy` again every STATUS_REFRESH_SECONDS on its own, without rerunning the page.
    Each `draw` is a function of its own: a fragment is known by its function's name and its container."""
    (st.fragment(draw, run_every=STATUS_REFRESH_SECONDS) if busy else draw)()


def render_status() -> None:
    state = model_manager().state()
    if line := state.status_line():
        st.caption(line)
    for source in state.adding:
        st.caption(f"Adding {label_of(source)}…")
    engine = state.engine
    if engine is None:
        st.session_state.pop(RUNNING_SHOWN_KEY, None)
        st.caption("No model loaded.")
        return
    info = engine.info()
    memory = info.get("memory") or {}
    fast, kernel_detail = model_loader.kernel_summary(info.get("kernels") or {})
    rows = {
        "model": label_of(state.source or info.get("model", "?")) if state.is_demo else info.get("model", "?"),
        "revision": info.get("revision") or "–",
        "device": f"{info.get('device')} ({info.get('device_name', '')})",
        "precision": info.get("dtype") or "–",  # the weights' dtype: float32 on a CPU, bfloat16 on a GPU
        "GPU memory loaded": _gib(memory.get("loaded")),
        "peak allocated": _gib(memory.get("peak_allocated")),
        "peak reserved": _gib(memory.get("peak_reserved")),
        "fast kernels": f"{'on' if fast else 'off'} ({kernel_detail})",
        "queue depth": str(engine.queue_depth()),
        "batch runs": running_runs_text(),
    }
    st.markdown("\n".join(f"- **{k}:** {v}" for k, v in rows.items()))


RAW_PROBABILITIES = "raw (as the model answered)"


def pick_calibration(label: str, key: str, schema_name: str, *, help: str, saved: str | None = None,
                     always: bool = False, verdicts: bool = False) -> str | None:
    """A calibration fitted for the schema to read probabilities through, or None for the model's own; no selector
    while none is fitted unless `always`; with `verdicts`, how the one chosen did per question under it."""
    fitted = [c["name"] for c in get_store().list_calibrations(schema_name=schema_name)]
    if not fitted and not always:
        return None
    choices = [RAW_PROBABILITIES, *fitted]
    chosen = st.selectbox(label, choices, key=key, index=choices.index(saved) if saved in fitted else 0, help=help)
    if chosen not in fitted:
        return None
    if verdicts:
        st.markdown(calibration.verdicts_text(get_store().get_calibration(name=chosen)["payload"]))
    return chosen


# The Runs page's "Start a run" case set, and its request to open: set by "Run this case set" on the Case sets page.
RUNS_START_SET, RUNS_START_OPEN = "runs.start.case_set", "runs.start.open"
RUNNING_SHOWN_KEY = "sidebar.running_runs"  # the runs the sidebar last drew as running (the Runs page checks them)


def running_run_ids() -> list[int]:
    """Runs some workbench process works on now (live lease): the queue depth alone hides them."""
    store = get_store()
    return [r["id"] for r in store.list_runs() if r["status"] == "running" and store.run_lease_holder(r["id"])]


def running_runs_text() -> str:
    """The runs running now, remembered so a page following a run redraws when they differ."""
    running = st.session_state[RUNNING_SHOWN_KEY] = running_run_ids()
    return ", ".join(f"#{run_id}" for run_id in running) + " running" if running else "none running"


def run_queued(engine, requests: list[dict], *, max_length: int | None = None, overflow: str = "refuse",
               on_wait: Callable[[str], None] | None = None, stopped_key: str | None = None) -> list[dict]:
    """Run requests at interactive priority, showing "queued, n ahead" while waiting. A widget changed meanwhile
    makes Streamlit stop the script while it waits: the engine then drops the job (`abandon`), and `stopped_key`
    is left set in the session for the page's next run to say so (`was_stopped`)."""
    prepared = [engine.validate(request, max_length=max_length, overflow=overflow) for request in requests]
    future = engine.submit(prepared, priority="interactive")  # validated once, above: carries its budget
    if stopped_key:
        st.session_state[stopped_key] = True
    started = time.monotonic()
    try:
        while not future.done():
            if on_wait is not None:
                waited = time.monotonic() - started
                position = engine.queue_position(future)
                on_wait(f"Queued, {position} ahead (queue depth {engine.queue_depth()}) — {waited:.0f} s" if position
                        else f"Running on {engine.info().get('device', 'the device')}… {waited:.1f} s")
            with contextlib.suppress(TimeoutError):
                future.result(timeout=POLL_SECONDS)
        answers = future.result()
    except Exception:  # the run's own failure, which the page shows: not a stopped run
        was_stopped(stopped_key)  # clears the mark
        raise
    except BaseException:  # Streamlit stopped the script (its rerun exceptions are BaseExceptions)
        engine.abandon(future)
        raise
    was_stopped(stopped_key)  # clears the mark
    return answers


def was_stopped(stopped_key: str | None) -> bool:
    """Whether the last run_queued under `stopped_key` was stopped by a rerun before its answers came (once)."""
    return bool(stopped_key) and bool(st.session_state.pop(stopped_key, None))


def ended_since_last_poll(key: str, live: bool) -> bool:
    """Whether what `key` follows was live at the last poll and is not now: the page is then drawn again whole."""
    was_live, st.session_state[key] = st.session_state.get(key), live
    return bool(was_live) and not live


def failure_text(what: str, exc: BaseException) -> str:
    """The words for a failure a page catches broadly; the traceback goes to the log."""
    log.error("%s", what, exc_info=exc)
    return f"{what}: {type(exc).__name__}: {exc}"


def page_key(page: str) -> Callable[[str], str]:
    return lambda name: f"{page}.{name}"


def kept_widget(widget: Callable[..., Any], label: str, key: str, default: Any = None, **kwargs: Any) -> Any:
    """A widget whose value survives page switches (a copy is kept and restored)."""
    if key not in st.session_state:
        st.session_state[key] = st.session_state.get(KEEP_PREFIX + key, default)
    # declared as the value the server holds: a browser redraw that falls back to the default changes nothing
    kwargs.update(declared_default(widget.__name__, st.session_state[key], kwargs.get("options")))
    value = widget(label, key=key, **kwargs)
    st.session_state[KEEP_PREFIX + key] = value
    return value


def declared_default(widget_name: str, value: Any, options: Any = None) -> dict[str, Any]:
    """The keyword that declares `value` as the default of a Streamlit widget (none for other widgets)."""
    if widget_name in ("text_input", "text_area", "number_input", "toggle", "checkbox", "slider"):
        return {"value": value}
    if widget_name == "multiselect" and options is not None:
        return {"default": [v for v in value or () if v in options]}
    choices = list(options) if widget_name in ("selectbox", "radio") and options is not None else []
    return {"index": choices.index(value)} if value in choices else {}


def show_message(key: str, undo: Callable[..., None] | None = None, **kwargs: Any) -> None:
    """The message (kind, text[, undo arguments]) an action left under `key` for the page's next run, shown once;
    with undo arguments, beside an Undo button that calls `undo` with them."""
    message = st.session_state.pop(key, None)
    if not message:
        return
    kind, text, undo_args = (*message, None)[:3]
    if undo is None or undo_args is None:
        getattr(st, kind)(text, **kwargs)
        return
    cols = st.columns([5, 1], vertical_alignment="center")
    getattr(cols[0], kind)(text, **kwargs)
    cols[1].button("Undo", key=f"{key}.undo", icon=":material/undo:", on_click=undo, args=undo_args)


def url_int(name: str) -> int | None:
    value = st.query_params.get(name)
    return int(value) if value is not None and str(value).isdigit() else None


def pick_id(ids: list[int], key: str, label: str, format_func: Callable[[int], str], *, param: str,
            what: str) -> int | None:
    """A selector of one row kept across pages and shared through the URL; None for a link to a missing one."""
    first_visit = KEEP_PREFIX + key not in st.session_state
    if first_visit and st.query_params.get(param) is not None:
        linked = url_int(param)
        if linked not in ids:
            show_not_found(links.missing(what, st.query_params.get(param), ids, format_func, param=param), key)
            return None
        chosen = linked
    else:
        chosen = kept(st.session_state, key)
    if chosen not in ids:
        chosen = ids[0]
    st.session_state[key] = st.session_state[KEEP_PREFIX + key] = chosen
    value = kept_widget(st.selectbox, label, key, default=chosen, options=ids, format_func=format_func)
    st.query_params[param] = str(value)
    return value


def show_not_found(missing: links.Missing, key: str | None = None) -> None:
    """"Not found" for a link, with links to what exists; with `key`, a button opens the first instead."""
    st.error(missing.message, icon=":material/link_off:")
    if missing.links:
        st.markdown("\n".join(f"- [{text}]({url})" for text, url in missing.links)
                    + (f"\n- … and {missing.more} more" if missing.more else ""))
    if key is not None and missing.first_id is not None and st.button(
            f"Open {missing.first_label} instead", key=f"{key}.not_found_open", icon=":material/arrow_forward:"):
        set_widget(key, missing.first_id)
        st.query_params[missing.param] = str(missing.first_id)
        st.rerun()


def pick_run(runs: list[dict], key: str, label: Callable[[dict], str]) -> int | None:
    labels = {run["id"]: label(run) for run in runs}
    return pick_id(list(labels), key, "Run", labels.get, param="run", what="run")


def pick_model(widget: Callable[..., Any], key: str, models: dict[str, Any], help: str, default: str | None = None
               ) -> str:
    """A selector of the loaded models (`models`: name → model, the default first), kept across page switches."""
    return kept_widget(widget, "Model", key, default, options=list(models), help=help,
                       format_func=lambda name: f"{name} · {models[name].label}" if models[name].label != name
                       else name)


def forget_widget(key: str, unless_in: Any = ()) -> None:
    forget_kept(st.session_state, key, unless_in)


def forget_pick(key: str, param: str) -> None:
    """Forget what a picker (pick_id's, or one like it) shows and the URL parameter linking to it: what it showed
    was deleted, and the page opens another rather than a "Not found" for its own stale link."""
    forget_widget(key)
    st.query_params.pop(param, None)


def kept_value(key: str) -> Any:
    """A kept widget's value (None before it was ever set)."""
    return kept(st.session_state, key)


def set_widget(key: str, value: Any) -> None:
    set_kept(st.session_state, key, value)


def confirm(question: str, key: Callable[[str], str], confirm_key: str, *, yes_label: str = "Yes, delete it",
            icon: str | None = ":material/delete:") -> bool:
    """Asks before an action: True when `yes_label` was clicked; it or Cancel closes the question."""
    with st.container(border=True, key=key("confirm_box")):
        st.warning(question, icon=icon)
        cols = st.columns(2)
        yes = cols[0].button(yes_label, key=key("confirm_yes"), type="primary")
        if yes or cols[1].button("Cancel", key=key("confirm_no")):
            st.session_state.pop(confirm_key, None)
        if not yes and confirm_key not in st.session_state:  # cancelled: drawn again without the question
            st.rerun()
    return yes


def format_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)
