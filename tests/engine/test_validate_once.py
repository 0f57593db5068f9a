"""One request is validated by the contract once, where it enters: the HTTP server for `POST /v1/systemone`, the job
runner for a batch case. The engine encodes the ValidRequest it is handed without validating it again. Counted at
pydantic's entry point, `SystemOneRequest.model_validate`, which every validation of a request goes through."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clef_engine import protocol
from clef_workbench.jobs import JobRunner
from clef_workbench.store import RunSettings, Store
from tests.support.media import plain_png

SCHEMA = {"questions": {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team should answer?",
             "criteria": {"billing": "Invoices and payments", "support": "Everything else"}},
}}


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
            **SCHEMA, "images": [protocol.data_url("image/png", plain_png(32, 24))], "x_max_length": 4096}
    with TestClient(create_app(tiny_engine)) as client:
        validations.clear()  # whatever starting the app validated (a warm-up) is not this request's
        response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == {"refund", "team"}
    assert len(validations) == 1


def test_a_batch_run_validates_its_schema_once_and_each_cases_evidence_once(tmp_path, tiny_engine, validations,
                                                                            monkeypatch):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"Invoice {i} shows the wrong amount, please refund the difference.",
                              "images": [plain_png(32, 24)]} for i in range(5)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="demo", settings=RunSettings(max_length=4096))
    sent: list[protocol.ValidRequest] = []
    submit = tiny_engine.submit

    def recording(requests, **options):
        sent.extend(requests)
        return submit(requests, **options)

    monkeypatch.setattr(tiny_engine, "submit", recording)
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    results = store.list_results(run_id)
    assert len(results) == 5
    assert all(r["error"] is None and set(r["response"]["answers"]) == {"refund", "team"} for r in results)
    # the schema's questions once for the run, then each case's state and media without them
    assert sum("questions" in seen for seen in validations) == 1
    assert len(validations) == 1 + 5
    # the stored media reach the engine as the bytes the store holds, not as base64 data URLs
    assert len(sent) == 5 and all(isinstance(image, bytes) for r in sent for image in r.images)


def test_a_batch_run_tokenizes_its_schema_once(tmp_path, tiny_engine, monkeypatch):
    from clef_engine.model.encoding import SCHEMA_HEADER, Encoder

    schema_tokenizations: list[int] = []
    tokenize_many = Encoder.tokenize_many

    def counting(self, texts):
        if texts and texts[0] == SCHEMA_HEADER:
            schema_tokenizations.append(len(texts))
        return tokenize_many(self, texts)

    monkeypatch.setattr(Encoder, "tokenize_many", counting)
    schema = {"questions": {  # a schema no other test encodes (the encoder remembers the schemas it saw last)
        "urgent": {"type": "noul", "instructions": f"Is it urgent? ({tmp_path.name})"},
        "team": SCHEMA["questions"]["team"]}}
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"Ticket {i}: the parcel is late."} for i in range(6)])
    run_id = store.create_run(set_id, schema=schema, model_id="demo")
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    assert [r["error"] for r in store.list_results(run_id)] == [None] * 6
    assert len(schema_tokenizations) == 1


def test_a_run_whose_schema_is_invalid_reports_the_problem_on_every_case(tmp_path, tiny_engine):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": "Refund please."}, {"state": "Where is my parcel?"}])
    schema = {"questions": {"refund": {"type": "yes_or_no", "instructions": "Refund?"}}}
    run_id = store.create_run(set_id, schema=schema, model_id="demo")
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=120)
    errors = [r["error"] for r in store.list_results(run_id)]
    assert len(errors) == 2 and all(e and "questions.refund.type" in e for e in errors), errors


def test_one_decide_page_run_is_validated_once(tiny_engine, validations):
    from workbench_ui.shell import run_queued

    request = {"model": "clef", "state": "Please refund the second charge on my card.", **SCHEMA,
               "images": [protocol.data_url("image/png", plain_png(32, 24))]}
    (response,) = run_queued(tiny_engine, [request], max_length=4096, overflow="truncate_state")
    assert set(response["answers"]) == {"refund", "team"}
    assert len(validations) == 1
