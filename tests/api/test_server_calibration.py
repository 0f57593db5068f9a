"""How sure, over HTTP: `"x_calibration": "<name>"` on a real `clef-engine serve --calibrations FILE` process, the
file exported by `python -m clef_workbench calibrate --export`; and the workbench-served API reading its store."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_workbench import calibration
from clef_workbench.store import Store
from tests.support import REPO
from tests.support.api import TIMINGS, without_latency
from tests.support.bodies import make_request
from tests.support.servers import ServerProcess, serving

pytestmark = pytest.mark.slow  # real server processes

SOFT_BILLING = calibration.QuestionCalibration("billing", "noul", "platt", a=0.4, b=0.1)
WARM_TONE = calibration.QuestionCalibration("tone", "choice", "temperature", temperature=3.0)
SHARP_URGENCY = calibration.QuestionCalibration("urgency", "score", "temperature", temperature=0.5)


def store_with_calibrations(db: Path) -> Store:
    """A store holding two calibrations of a run (fitted elsewhere: here their maps are given)."""
    store = Store(db)
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": "ticket"}])
    schema = {"name": "tickets", "questions": {"billing": {"type": "noul"}}}
    run = store.get_run(store.create_run(set_id, schema=schema, model_id="tiny"))
    store.save_calibration("tickets · tiny", run, {"questions": {
        q.question_id: calibration.asdict(q) for q in (SOFT_BILLING, WARM_TONE, SHARP_URGENCY)}, "report": []})
    store.save_calibration("billing only", run, {"questions": {"billing": calibration.asdict(SOFT_BILLING)},
                                                 "report": []})
    return store


@pytest.fixture(scope="module")
def calibrated_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("calibrations")
    store_with_calibrations(folder / "w.db")
    exported = folder / "calibrations.json"
    done = subprocess.run([sys.executable, "-m", "clef_workbench", "calibrate", "--db", str(folder / "w.db"),
                           "--export", str(exported)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exported 2 calibration(s)" in done.stdout
    yield from serving(tiny_release, tmp_path_factory, "calibrated-server.log", "--calibrations", str(exported))


def post(to: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{to.url}/v1/systemone", json=body, timeout=120)


def test_x_calibrated_is_the_named_calibration_of_the_contracts_answers(calibrated_server, tmp_path):
    body = make_request(3)
    reply = post(calibrated_server, body | {"x_calibration": "tickets · tiny"})
    assert reply.status_code == 200, reply.text
    answered = reply.json()
    plain = post(calibrated_server, body).json()
    # the contract's own fields are unchanged; x_calibrated sits beside them
    assert {k: v for k, v in answered.items() if k not in ("x_calibrated", *TIMINGS)} == {
        k: v for k, v in plain.items() if k not in TIMINGS}
    # the same figures the workbench shows for that calibration (its store, its arithmetic)
    _, expected = calibration.calibrated_response(store_with_calibrations(tmp_path / "w.db"), "tickets · tiny",
                                                  plain)
    assert answered["x_calibrated"] == expected
    assert answered["x_calibrated"]["billing"]["noul"] != plain["answers"]["billing"]["noul"]
    # a temperature above 1 flattens the choice, below 1 sharpens the score; the ranking stays
    tone, raw_tone = answered["x_calibrated"]["tone"], plain["answers"]["tone"]
    assert tone["choice"] == raw_tone["choice"] and tone["confidence"] < raw_tone["confidence"]
    assert list(tone["probabilities"]) == list(raw_tone["probabilities"])  # the caller's order
    assert answered["x_calibrated"]["urgency"]["confidence"] > plain["answers"]["urgency"]["confidence"]


def test_a_calibration_answers_only_the_questions_it_has_a_map_for(calibrated_server):
    reply = post(calibrated_server, make_request(1) | {"x_calibration": "billing only"})
    assert reply.status_code == 200, reply.text
    assert set(reply.json()["x_calibrated"]) == {"billing"}


def test_without_x_calibration_the_answer_is_byte_for_byte_the_plain_servers(calibrated_server, server):  # noqa: F811
    body = make_request(2)
    with_file, without = post(calibrated_server, body), post(server, body)
    assert with_file.status_code == without.status_code == 200
    assert without_latency(with_file.content) == without_latency(without.content)
    assert without_latency(post(calibrated_server, body | {"x_calibration": None}).content) == without_latency(
        without.content)


def test_an_unknown_calibration_is_422_naming_it_and_listing_those_there_are(calibrated_server, server):  # noqa: F811
    reply = post(calibrated_server, make_request(0) | {"x_calibration": "tickets · flash"})
    assert reply.status_code == 422, reply.text
    [problem] = reply.json()["detail"]
    assert problem["loc"] == ["body", "x_calibration"]
    assert "'tickets · flash'" in problem["msg"] and "'billing only', 'tickets · tiny'" in problem["msg"]
    # a server started without --calibrations has none, and says so
    bare = post(server, make_request(0) | {"x_calibration": "tickets · tiny"})
    assert bare.status_code == 422 and bare.json()["detail"][0]["msg"].endswith("it has: none")
    wrong_type = post(calibrated_server, make_request(0) | {"x_calibration": 3})
    assert wrong_type.status_code == 422
    assert wrong_type.json()["detail"][0]["loc"] == ["body", "x_calibration"]


def test_a_calibrations_file_that_is_not_one_stops_the_server_with_the_reason(tiny_release, tmp_path):
    broken = tmp_path / "calibrations.json"
    broken.write_text(json.dumps({"questions": {}}))
    done = subprocess.run([sys.executable, "-m", "clef_engine", "serve", "--model", str(tiny_release), "--device",
                           "cpu", "--calibrations", str(broken)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert f"--calibrations {broken}: not a calibrations file" in done.stderr


def test_a_calibrations_file_that_would_fail_requests_stops_the_server_saying_where(tiny_release, tmp_path):
    """A NaN in a map made every request naming its calibration a 500 (ab0a202): now the server does not start."""
    broken = tmp_path / "calibrations.json"
    broken.write_text(json.dumps({"calibrations": {"tickets": {"questions": {
        "tone": {"question_type": "choice", "method": "temperature", "temperature": float("nan")}}}}}))
    done = subprocess.run([sys.executable, "-m", "clef_engine", "serve", "--model", str(tiny_release), "--device",
                           "cpu", "--calibrations", str(broken)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert (f"--calibrations {broken}: calibration 'tickets', question 'tone': temperature must be a number from "
            "0.01 to 100; got nan") in done.stderr
    assert "Traceback" not in done.stderr


X_CALIBRATION = st.one_of(st.sampled_from(["tickets · tiny", "billing only"]), st.text(max_size=20), st.none(),
                          st.integers(), st.floats(allow_nan=False, allow_infinity=False),  # what JSON carries
                          st.lists(st.text(max_size=3), max_size=2),
                          st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(named=X_CALIBRATION, i=st.integers(0, 5), other_types=st.booleans())
def test_any_x_calibration_is_answered_without_a_server_fault(calibrated_server, named, i, other_types):
    body = make_request(i)
    if other_types:  # the calibrations' question ids, asking questions of other types than they were fitted on
        asked = body["questions"]
        body["questions"] = {"billing": asked["tone"], "tone": asked["urgency"], "urgency": asked["billing"]}
    reply = post(calibrated_server, body | {"x_calibration": named})
    assert reply.status_code in (200, 422), reply.text
    if reply.status_code == 200 and named is not None:
        assert set(reply.json()["x_calibrated"]) <= set(body["questions"])
    assert "Traceback" not in calibrated_server.log()


def test_the_workbench_served_api_reads_calibrations_from_its_store(tmp_path, monkeypatch, tiny_engine):
    """The workbench's routes (workbench_ui.server) over one engine: a calibration kept in the store after the
    server started is served at once."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from clef_engine.serve.server import routes
    from workbench_ui.server import stored_calibrations

    monkeypatch.setenv("CLEF_DB", str(tmp_path / "w.db"))
    store = Store(tmp_path / "w.db")
    app = Starlette(routes=routes(lambda: {"tiny": tiny_engine}, calibrations=stored_calibrations))
    with TestClient(app) as client:
        body = make_request(4, model="tiny")
        missing = client.post("/v1/systemone", json=body | {"x_calibration": "billing only"})
        assert missing.status_code == 422 and "it has: none" in missing.text
        store_with_calibrations(tmp_path / "w.db")
        reply = client.post("/v1/systemone", json=body | {"x_calibration": "billing only"})
        assert reply.status_code == 200, reply.text
        _, expected = calibration.calibrated_response(store, "billing only", reply.json())
        assert reply.json()["x_calibrated"] == {"billing": expected["billing"]}
