"""One request is validated by the contract once, where it enters: the HTTP server for `POST /v1/systemone`, the job
runner for a batch case. The engine encodes the ValidRequest it is handed without validating it again. Counted at
pydantic's entry point, `SystemOneRequest.model_validate`, which every validation of a request goes through."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from PIL import Image

from clef_engine import protocol
from clef_workbench.jobs import JobRunner
from clef_workbench.store import Store

SCHEMA = {"questions": {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team should answer?",
             "criteria": {"billing": "Invoices and payments", "support": "Everything else"}},
}}


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every request the contract's model validates from now on (a class attribute: every thread sees it)."""
    seen: list[object] = []
    original = protocol.SystemOneRequest.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls, obj, *args, **kwargs):
        seen.append(obj)
        return original(cls, obj, *args, **kwargs)

    monkeypatch.setattr(protocol.SystemOneRequest, "model_validate", classmethod(counting))
    yield seen


def test_one_http_request_is_validated_once(tiny_engine, validations):
    from starlette.testclient import TestClient

    from clef_engine.serve.server import create_app

    body = {"model": "clef", "state": {"subject": "Refund", "body": "I was charged twice for my order."},
            **SCHEMA, "images": [protocol.data_url("image/png", png_bytes())], "x_max_length": 4096}
    with TestClient(create_app(tiny_engine)) as client:
        validations.clear()  # whatever starting the app validated (a warm-up) is not this request's
        response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == {"refund", "team"}
    assert len(validations) == 1


def test_one_batch_case_is_validated_once(tmp_path, tiny_engine, validations):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": "My invoice shows the wrong amount, please refund the difference.",
                              "images": [png_bytes()]}])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo", settings={"max_length": 4096})
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    (result,) = store.list_results(run_id)
    assert result["error"] is None and set(result["response"]["answers"]) == {"refund", "team"}
    assert len(validations) == 1


def test_one_decide_page_run_is_validated_once(tiny_engine, validations):
    from workbench_ui.shell import run_queued

    request = {"model": "clef", "state": "Please refund the second charge on my card.", **SCHEMA,
               "images": [protocol.data_url("image/png", png_bytes())]}
    (response,) = run_queued(tiny_engine, [request], max_length=4096, overflow="truncate_state")
    assert set(response["answers"]) == {"refund", "team"}
    assert len(validations) == 1
