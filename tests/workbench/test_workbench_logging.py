"""A failure the workbench turns into words for the user also reaches the operator's log with its traceback: a batch
run whose engine fails (real SQLite, the real tiny engine behind a wrapper that fails), a model that cannot be loaded,
and a page's broad catch."""

from __future__ import annotations

import logging
from pathlib import Path

from clef_engine.errors import ClefError
from clef_workbench.jobs import JobRunner
from clef_workbench.model_loader import ModelManager
from clef_workbench.store import RunSettings, Store

SCHEMA = {"name": "small", "version": "1", "questions": {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None}}}}


class EngineThatFails:
    """The tiny engine's validation, then `error` raised for every chunk it is given."""

    def __init__(self, engine, error: Exception):
        self.engine = engine
        self.error = error

    def validate(self, request: dict, **budget):
        return self.engine.validate(request, **budget)

    def submit(self, requests: list[dict], **options):
        raise self.error


def run_on(store: Store, engine, cases: int = 3) -> int:
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"ticket {i}: my invoice is wrong"} for i in range(cases)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo", settings=RunSettings(chunk_size=2))
    runner = JobRunner(store)
    runner.start(run_id, engine, check=False)
    assert runner.wait(run_id, timeout=120)
    return run_id


def records_with(caplog, logger: str, error: Exception) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.exc_info and r.exc_info[1] is error]


def test_an_engine_that_refuses_a_chunk_gives_each_case_its_error_and_the_log_its_traceback(tmp_path, tiny_engine,
                                                                                            caplog):
    error = ClefError("the endpoint stopped answering")
    store = Store(tmp_path / "w.db")
    with caplog.at_level(logging.WARNING, logger="clef_workbench"):
        run_id = run_on(store, EngineThatFails(tiny_engine, error))
    results = store.list_results(run_id)
    assert [r["error"] for r in results] == ["ClefError: the endpoint stopped answering"] * 3
    logged = records_with(caplog, "clef_workbench.jobs", error)
    assert logged and all(r.levelno == logging.WARNING for r in logged)
    assert f"run {run_id}: the engine refused a chunk of 2 cases" in [r.getMessage() for r in logged]


def test_an_engine_fault_fails_the_run_with_its_words_and_logs_the_traceback(tmp_path, tiny_engine, caplog):
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    store = Store(tmp_path / "w.db")
    with caplog.at_level(logging.WARNING, logger="clef_workbench"):
        run_id = run_on(store, EngineThatFails(tiny_engine, error))
    run = store.get_run(run_id)
    assert (run["status"], run["error"]) == ("failed", f"RuntimeError: {error}")
    [logged] = records_with(caplog, "clef_workbench.jobs", error)
    assert logged.levelno == logging.ERROR
    assert logged.getMessage() == f"batch run {run_id} failed: RuntimeError: {error}"
    assert logged.exc_info[2] is not None  # the traceback itself, down to the engine's raise


def test_a_model_that_cannot_load_is_a_sidebar_message_and_a_logged_traceback(caplog):
    error = OSError("No space left on device")

    def loader(source):
        if source == "/models/full-disk":
            raise error
        return object()

    manager = ModelManager(loader=loader, demo_path=lambda: Path("/demo"))
    with caplog.at_level(logging.WARNING, logger="clef_workbench"):
        manager.request("/models/full-disk")
        state = manager.wait(5)
    assert state.error.startswith("Could not load /models/full-disk")
    [logged] = records_with(caplog, "clef_workbench.model_loader", error)
    assert logged.levelno == logging.ERROR and logged.getMessage() == "loading /models/full-disk failed"


def test_a_page_s_broad_catch_shows_the_words_and_logs_the_traceback(caplog):
    from workbench_ui.shell import failure_text

    try:
        raise ValueError("bad frame index")
    except ValueError as exc:
        error = exc
        with caplog.at_level(logging.WARNING, logger="workbench_ui"):
            text = failure_text("Sampled frames unavailable", exc)
    assert text == "Sampled frames unavailable: ValueError: bad frame index"
    [logged] = records_with(caplog, "workbench_ui.shell", error)
    assert logged.levelno == logging.ERROR
