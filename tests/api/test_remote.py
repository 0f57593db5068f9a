"""Remote System One endpoints as engines (`clef_engine.load("http://…")` → RemoteEngine).

Two kinds of server, both real processes or threads on 127.0.0.1 spoken to over HTTP:
- our own API (`python -m clef_engine serve` on the tiny release, with an API key): answers must equal the
  in-process engine's on the same requests, and its errors must come back as the engine's own error types;
- a scripted stub that answers 429 with Retry-After, 500, slowly, or with malformed bodies, and records what it
  received (headers, bodies, client ports, how many requests were in flight at once).
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import clef_engine
from clef_engine import BusyError, RequestError, TokenBudgetError
from clef_engine.errors import CancelledError
from clef_engine.remote import (
    RemoteAuthError,
    RemoteEngine,
    RemoteError,
    RequestTooLargeError,
    parse_endpoint,
)
from clef_engine.remote_http import retry_after_seconds
from clef_workbench import compare
from clef_workbench.jobs import JobRunner
from clef_workbench.store import Store
from tests.support.servers import ServerProcess, serving

pytestmark = pytest.mark.slow  # real server processes
API_KEY = "remote-test-key-\u00e9"  # non-ASCII: the header must carry the key's UTF-8 bytes

# --- requests ----------------------------------------------------------------------------------------------------


def make_request(i: int) -> dict:
    """One question of each type; `i` varies state and schema. Choice ids deliberately unsorted."""
    return {
        "model": "jev-latest",
        "state": {"ticket": f"Customer {i}: charged {i + 1} times for order {1000 + i}.", "amount": 9.5 * (i + 1)},
        "questions": {
            "billing": {"type": "noul", "instructions": f"Is ticket {i} about billing?"},
            "tone": {"type": "choice", "instructions": "What is the tone?",
                     "criteria": {"neutral": "Matter of fact.", "angry": None, "calm": "Relaxed."}},
            "urgency": {"type": "score", "instructions": "How urgent?",
                        "criteria": ["can wait", "this week", "today", "now"][: 2 + i % 3]},
        },
    }


def assert_same_answers(remote: dict, local: dict) -> None:
    """Same questions, same argmax, probabilities equal to the 4-decimal rounding (one unit of slack for sums done
    in another order when the server batches concurrent requests)."""
    assert list(remote["answers"]) == list(local["answers"])
    for question_id, expected in local["answers"].items():
        got = remote["answers"][question_id]
        assert got["type"] == expected["type"]
        if expected["type"] == "noul":
            assert got["noul"] == pytest.approx(expected["noul"], abs=2e-4)
            continue
        assert list(got["probabilities"]) == list(expected["probabilities"])
        for option, p in expected["probabilities"].items():
            assert got["probabilities"][option] == pytest.approx(p, abs=2e-4), (question_id, option)
        if expected["type"] == "choice":
            assert got["choice"] == expected["choice"]
        else:
            assert got["score"] == pytest.approx(expected["score"], abs=1e-3)
            assert got["legend"] == expected["legend"]
    assert remote["usage"] == local["usage"]


# --- our own API server, for real ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from serving(tiny_release, tmp_path_factory, "remote-server.log",
                      "--api-key-env", "CLEF_REMOTE_TEST_KEY", env={"CLEF_REMOTE_TEST_KEY": API_KEY})


@pytest.fixture
def remote(api_server: ServerProcess, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CLEF_API_KEY", raising=False)
    engine = clef_engine.load(api_server.url, api_key=API_KEY)
    yield engine
    engine.close()


def test_load_url_returns_a_remote_engine_that_lists_the_server_model(remote, api_server, tiny_release):
    assert isinstance(remote, RemoteEngine)
    info = remote.info()
    assert info["remote"] is True and info["endpoint"] == api_server.url
    assert tiny_release.name in info["models"]  # from GET /v1/models, which needed the key
    assert info["random_weights"] is True, "the endpoint's /v1/models says the tiny release's weights are random"
    assert API_KEY not in json.dumps(info) and API_KEY not in repr(remote)


def test_answers_equal_the_in_process_engine(remote, tiny_engine):
    requests = [make_request(i) for i in range(6)]
    local = [tiny_engine.decide(r) for r in requests]  # one at a time, as the server receives them
    answered = remote.decide_many(requests)  # several in flight at once
    for got, expected in zip(answered, local, strict=True):
        assert_same_answers(got, expected)
        assert got["model"] == "jev-latest"
        assert got["x_attempts"] == 1
        # the client's latency includes the server's own
        assert got["x_latency_ms"] >= got["x_server_latency_ms"] > 0
    assert_same_answers(remote.decide(requests[0]), local[0])


def test_submit_returns_a_future_like_the_local_engine(remote, tiny_engine):
    future = remote.submit([make_request(1), make_request(2)])
    assert isinstance(future, Future)
    answers = future.result(timeout=60)
    assert [a["answers"]["tone"]["choice"] for a in answers] == \
        [tiny_engine.decide(make_request(i))["answers"]["tone"]["choice"] for i in (1, 2)]
    assert remote.queue_depth() == 0


def png_file(path: Path) -> Path:
    pixels = np.random.default_rng(4).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")
    return path


def test_media_as_paths_and_bytes_travel_as_data_urls(remote, tiny_engine, tmp_path):
    image = png_file(tmp_path / "evidence.png")
    request = dict(make_request(4), images=[str(image)])
    expected = tiny_engine.decide(request)  # the local engine reads the path itself
    assert_same_answers(remote.decide(request), expected)
    assert_same_answers(remote.decide(dict(request, images=[image.read_bytes()])), expected)
    with pytest.raises(RequestError) as caught:
        remote.decide(dict(request, images=[str(tmp_path / "missing.png")]))
    assert caught.value.problems[0].loc == ("images", 0) and "missing.png" in str(caught.value)


def test_local_and_remote_runs_of_one_case_set_agree(remote, tiny_engine, tmp_path):
    """"Does our local Clef agree with the served one?": the same tiny release in-process and behind the API, one
    case set run on both as one action, then compared."""
    store = Store(tmp_path / "w.sqlite3")
    case_set = store.create_case_set("tickets")
    store.add_cases(case_set, [{"state": make_request(i)["state"], "expected": {"billing": i % 2 == 0}}
                               for i in range(5)])
    schema = {"name": "triage", "version": "1", "questions": make_request(0)["questions"]}
    runner = JobRunner(store)
    run_ids = compare.start_runs(store, runner, case_set, schema, {"local": tiny_engine, "remote": remote})
    for run_id in run_ids:
        assert runner.wait(run_id, timeout=120)
        assert store.get_run(run_id)["status"] == "finished" and store.get_run(run_id)["errors"] == 0
    runs = compare.load_runs(store, run_ids)
    table = compare.agreement(runs, n_boot=50)
    assert list(table["question_id"]) == ["billing", "tone", "urgency"]
    assert list(table["agreement"]) == [1.0, 1.0, 1.0] and list(table["n"]) == [5, 5, 5]
    assert compare.case_matrix(runs, disagreements_only=True).empty
    latency = compare.metrics(runs, n_boot=50).query("metric == 'latency_p50_ms'")
    assert list(latency["n"]) == [5, 5] and (latency["value"] > 0).all()


def test_invalid_request_comes_back_as_request_error_naming_the_field(remote, api_server):
    bad = {"state": "x", "questions": {"ok": {"type": "noul"}, "q": {"type": "maybe"}}}
    with pytest.raises(RequestError) as caught:
        remote.decide(bad)
    assert [p.loc for p in caught.value.problems] == [("questions", "q", "type")]
    message = str(caught.value)
    assert f"{api_server.url}/v1/systemone" in message and "questions.q.type" in message
    with pytest.raises(RequestError) as local:  # the in-process check names the same field
        remote.validate(bad)
    assert [p.loc for p in local.value.problems] == [("questions", "q", "type")]


def test_token_budget_comes_back_as_token_budget_error_like_the_local_engine(remote, tiny_engine):
    request = dict(make_request(0), state="word " * 400)
    with pytest.raises(TokenBudgetError) as local:
        tiny_engine.decide(request, max_length=400)
    with pytest.raises(TokenBudgetError) as caught:
        remote.decide(request, max_length=400)
    assert (caught.value.over_by, caught.value.part, caught.value.max_length) == \
        (local.value.over_by, local.value.part, 400)
    truncated = remote.decide(request, max_length=400, overflow="truncate_state")
    expected = tiny_engine.decide(request, max_length=400, overflow="truncate_state")
    assert truncated["x_truncated_state_tokens"] == expected["x_truncated_state_tokens"] > 0
    assert_same_answers(truncated, expected)


def test_wrong_or_missing_key_is_refused_at_load_naming_the_endpoint(api_server, monkeypatch):
    monkeypatch.delenv("CLEF_API_KEY", raising=False)
    with pytest.raises(RemoteAuthError) as missing:
        clef_engine.load(api_server.url)
    assert missing.value.status == 401
    assert f"{api_server.url}/v1/models" in str(missing.value) and "CLEF_API_KEY" in str(missing.value)
    with pytest.raises(RemoteAuthError) as wrong:
        clef_engine.load(api_server.url, api_key="not-the-key")
    # 401 or 403 both mean a refused key (our server answers 401 for a wrong key too)
    assert wrong.value.status in (401, 403) and "invalid API key" in str(wrong.value)
    monkeypatch.setenv("CLEF_API_KEY", API_KEY)  # the key from the environment
    with clef_engine.load(api_server.url) as engine:
        assert engine.decide(make_request(3))["answers"]["billing"]["type"] == "noul"


def test_unreachable_endpoint_is_a_clear_error():
    with pytest.raises(RemoteError, match=r"could not reach http://127\.0\.0\.1:9/v1/models"):
        clef_engine.load("http://127.0.0.1:9", max_retries=1, backoff_s=0.01)


def test_local_only_options_are_refused_for_an_endpoint():
    with pytest.raises(ValueError, match="device"):
        clef_engine.load("http://127.0.0.1:9", device="cuda")


# --- a scripted stub server ---------------------------------------------------------------------------------------


def stub_answer(request: dict) -> dict:
    answers = {}
    for question_id, question in request["questions"].items():
        if question["type"] == "noul":
            answers[question_id] = {"type": "noul", "noul": 0.75}
        elif question["type"] == "choice":
            ids = list(question["criteria"])
            answers[question_id] = {"type": "choice", "choice": ids[0], "confidence": 1 / len(ids),
                                    "probabilities": {i: 1 / len(ids) for i in ids}}
        else:
            n = len(question["criteria"])
            answers[question_id] = {"type": "score", "score": (n - 1) / 2, "confidence": 1 / n,
                                    "legend": {str(i): c for i, c in enumerate(question["criteria"])},
                                    "probabilities": {str(i): 1 / n for i in range(n)}}
    return {"model": request.get("model", "stub"), "answers": answers,
            "usage": {"input_tokens": 10, "output_tokens": 0}, "x_latency_ms": 1.5, "x_echo": request["state"]}


class Stub:
    """A System One server on 127.0.0.1 that plays `script` (one action per POST, then answers normally) and records
    every POST: its body, Authorization header, client port, and the most requests it held at once."""

    def __init__(self) -> None:
        self.script: list[tuple] = []
        self.seen: list[dict] = []
        self.lock = threading.Lock()
        self.active = self.max_active = 0
        self.sent_bytes = 0  # by the streaming actions, until the client stopped reading
        self.released = threading.Event()  # ends a "hang" when the stub closes
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, so connection reuse is visible in the client ports

            def log_message(self, *args) -> None:
                pass

            def reply(self, status: int, body: bytes | dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode() if isinstance(body, dict) else body
                try:
                    self.send_response(status)
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def stream(self, kind: str, arg: float) -> None:
                """trickle: a valid answer's headers, then its body a byte every `arg` seconds (padded with spaces
                to last minutes). flood: `arg` bytes of body without a length, as fast as the client reads."""
                self.send_response(200)
                self.send_header("content-type", "application/json")
                body = json.dumps(stub_answer(NOUL)).encode() + b" " * 100_000
                if kind == "trickle":
                    self.send_header("content-length", str(len(body)))
                else:
                    self.send_header("connection", "close")  # the body ends when the connection does
                self.end_headers()
                block = b" " * (1 << 20)
                try:
                    while stub.sent_bytes < (len(body) if kind == "trickle" else arg):
                        piece = body[stub.sent_bytes: stub.sent_bytes + 1] if kind == "trickle" else block
                        self.wfile.write(piece)
                        self.wfile.flush()
                        stub.sent_bytes += len(piece)
                        if kind == "trickle":
                            time.sleep(arg)
                except (BrokenPipeError, ConnectionResetError):  # the client stopped reading
                    pass
                self.close_connection = True

            def do_GET(self) -> None:
                self.reply(200, {"models": [{"name": "stub-model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                with stub.lock:
                    stub.seen.append({"body": body, "authorization": self.headers.get("authorization"),
                                      "port": self.client_address[1], "at": time.monotonic(),
                                      "content_type": self.headers.get("content-type")})
                    stub.active += 1
                    stub.max_active = max(stub.max_active, stub.active)
                    action = stub.script.pop(0) if stub.script else ("ok",)
                if action[0] == "sleep":
                    time.sleep(action[1])
                if action[0] == "hang":  # the request read, the answer never comes
                    stub.released.wait(120)
                with stub.lock:
                    stub.active -= 1  # before replying: the client's next request may arrive right after
                if action[0] in ("trickle", "flood"):
                    self.stream(*action)
                elif action[0] == "reply":
                    self.reply(*action[1:])
                else:
                    self.reply(200, stub_answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


@pytest.fixture
def connect(stub, monkeypatch):
    monkeypatch.delenv("CLEF_API_KEY", raising=False)
    engines = []

    def make(**options) -> RemoteEngine:
        options = {"backoff_s": 0.01, "check": False, **options}
        engine = RemoteEngine(stub.url, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


NOUL = {"state": "s", "questions": {"q": {"type": "noul"}}}
ENDPOINT_PATH = "/v1/systemone"


def test_429_waits_as_long_as_retry_after_says(stub, connect):
    stub.script = [("reply", 429, {"detail": {"error_type": "overloaded"}}, {"retry-after": "1"})]
    started = time.monotonic()
    answer = connect().decide(NOUL)
    assert answer["x_attempts"] == 2 and answer["answers"]["q"]["noul"] == 0.75
    gap = stub.seen[1]["at"] - stub.seen[0]["at"]
    # at least the second asked for (the backoff alone would have waited about 0.01 s); far less than the cap of a
    # wait the client did not understand (max_retry_wait_s) — an upper bound only as a safety limit, a busy machine
    # may add seconds to any wait
    assert 0.95 <= gap < 60, gap
    assert answer["x_latency_ms"] >= 950 and time.monotonic() - started >= 0.95


def test_retry_after_as_an_http_date():
    assert retry_after_seconds(format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)) == \
        pytest.approx(30, abs=2)
    assert retry_after_seconds("2.5") == 2.5
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_429_after_every_retry_is_busy_error(stub, connect):
    stub.script = [("reply", 429, {"detail": {"error_type": "overloaded", "message": "queue full"}},
                    {"retry-after": "0"})] * 3
    with pytest.raises(BusyError, match=rf"{stub.url}{ENDPOINT_PATH} is overloaded .*queue full.* 3 attempt"):
        connect(max_retries=2).decide(NOUL)
    assert len(stub.seen) == 3


def test_500_is_retried_with_backoff_then_answered(stub, connect):
    stub.script = [("reply", 500, {"detail": {"error_type": "internal_error", "message": "boom"}}),
                   ("reply", 503, b"<html>bad gateway</html>")]
    answer = connect().decide(NOUL)
    assert answer["x_attempts"] == 3 and len(stub.seen) == 3


def test_persistent_500_is_a_remote_error_with_the_server_message(stub, connect):
    stub.script = [("reply", 500, {"detail": {"error_type": "internal_error", "message": "boom"}})] * 2
    with pytest.raises(RemoteError) as caught:
        connect(max_retries=1).decide(NOUL)
    assert caught.value.status == 500
    assert f"{stub.url}{ENDPOINT_PATH} answered 500 internal_error: boom after 2 attempt(s)" == str(caught.value)


def test_slow_answer_times_out_at_the_deadline_and_is_not_retried_past_it(stub, connect):
    stub.script = [("hang",)]  # answers only when released, after the client has given up
    with pytest.raises(RemoteError, match=rf"{stub.url}{ENDPOINT_PATH} did not answer within 0.4 s"):
        connect(timeout=0.4, max_retries=3).decide(NOUL)
    assert stub.active == 1, "the client waited for the answer instead of ending the call at its deadline"
    assert len(stub.seen) == 1  # the deadline covers the retries: none fits after the first attempt used it up
    stub.released.set()
    stub.script = [("reply", 503, {"detail": "restarting"})]
    assert connect(timeout=5, max_retries=1).decide(NOUL)["x_attempts"] == 2  # a quick failure leaves time


# --- a hostile or broken server: every call ends by its deadline with a clear error ---------------------------------

CALL_TIMEOUT = 3.0
# What the stub would make a client without the deadline wait: a hang is released when the stub closes, a trickle
# lasts minutes, a Retry-After of an hour is capped at max_retry_wait_s (120 s). A call ending well before this ended
# at its own deadline; the margin is what a busy machine may add, not a measure of the client.
STALL_SECONDS = 60.0


def ends_within_the_timeout(call, error: type[Exception], match: str) -> Exception:
    """Run `call`, which must raise `error` matching `match` long before the stub's stall would have ended."""
    started = time.monotonic()
    with pytest.raises(error, match=match) as caught:
        call()
    elapsed = time.monotonic() - started
    assert elapsed < STALL_SECONDS, f"the call took {elapsed:.1f} s with a timeout of {CALL_TIMEOUT:g} s"
    return caught.value


def test_a_trickled_answer_ends_at_the_call_deadline(stub, connect):
    stub.script = [("trickle", 0.05)]  # a byte every 50 ms: no single read ever waits long
    ends_within_the_timeout(lambda: connect(timeout=CALL_TIMEOUT).decide(NOUL), RemoteError,
                            rf"{stub.url}{ENDPOINT_PATH} did not answer within 3 s")
    assert 0 < stub.sent_bytes < 100_000 and len(stub.seen) == 1


def test_a_server_that_never_answers_ends_at_the_call_deadline_without_retries_past_it(stub, connect):
    stub.script = [("hang",)] * 6
    ends_within_the_timeout(lambda: connect(timeout=CALL_TIMEOUT).decide(NOUL), RemoteError,
                            r"did not answer within 3 s \(ReadTimeout, 1 attempt")
    assert stub.active == 1 and len(stub.seen) == 1  # ended while the server still held its one request


def test_retry_after_past_the_deadline_ends_the_call_at_once_with_the_server_error(stub, connect):
    stub.script = [("reply", 429, {"detail": {"error_type": "overloaded", "message": "come back later"}},
                    {"retry-after": "3600"})] * 6
    error = ends_within_the_timeout(lambda: connect(timeout=CALL_TIMEOUT).decide(NOUL), BusyError,
                                    "come back later.*after 1 attempt.*retried after 120 s, past this call's 3 s")
    assert len(stub.seen) == 1 and stub.url in str(error)


@pytest.mark.parametrize("value", ["inf", "nan", "-5", "1e999"])
def test_retry_after_that_is_not_a_time_is_ignored(value):
    assert retry_after_seconds(value) is None


def test_a_huge_answer_is_abandoned_at_the_size_limit_not_read_whole(stub, connect):
    stub.script = [("flood", 300 * 1024 * 1024)]  # no length given: only reading tells how big it is
    engine = connect(timeout=CALL_TIMEOUT, max_response_bytes=1024 * 1024)
    ends_within_the_timeout(lambda: engine.decide(NOUL), RemoteError,
                            r"over this client's limit of 1,048,576 bytes \(was still coming\); stopped reading")
    assert stub.sent_bytes < 100 * 1024 * 1024  # the client closed the connection long before the end
    stub.script = [("reply", 200, b"x" * (2 * 1024 * 1024))]
    ends_within_the_timeout(lambda: engine.decide(NOUL), RemoteError, "says it is 2,097,152 bytes long")
    assert engine.decide(NOUL)["answers"]["q"]["noul"] == 0.75  # the client still works


def with_probability(value) -> dict:
    answer = stub_answer(make_request(1))
    answer["answers"]["tone"]["probabilities"]["angry"] = value
    return answer


@pytest.mark.parametrize("body, problem", [
    ({"answers": {"q": {"type": "noul", "noul": math.nan}}}, "its noul is not a probability in [0, 1]"),
    ({"answers": {"q": {"type": "noul", "noul": math.inf}}}, "its noul is not a probability in [0, 1]"),
    ({"answers": {"q": {"type": "noul", "noul": -0.25}}}, "its noul is not a probability in [0, 1]"),
    ({"answers": {"q": {"type": "noul", "noul": "0.5"}}}, "its noul is not a probability in [0, 1]"),
    ({"answers": {"q": {"type": "noul", "noul": True}}}, "its noul is not a probability in [0, 1]"),
])
def test_a_noul_that_is_not_a_probability_is_a_remote_error(stub, connect, body, problem):
    stub.script = [("reply", 200, json.dumps(body).encode())]  # json.dumps writes NaN and Infinity as JS does
    error = ends_within_the_timeout(lambda: connect(timeout=CALL_TIMEOUT).decide(NOUL), RemoteError,
                                    "malformed response")
    assert problem in str(error) and "'q'" in str(error) and stub.url in str(error)
    assert len(stub.seen) == 1  # a wrong answer is not retried


@pytest.mark.parametrize("value, problem", [
    (math.nan, "a probability is not a number in [0, 1]"),
    (-math.inf, "a probability is not a number in [0, 1]"),
    (1.5, "a probability is not a number in [0, 1]"),
    (None, "a probability is not a number in [0, 1]"),
    (0.9, "its probabilities do not sum to 1"),
])
def test_choice_probabilities_that_are_not_a_distribution_are_a_remote_error(stub, connect, value, problem):
    stub.script = [("reply", 200, json.dumps(with_probability(value)).encode())]
    error = ends_within_the_timeout(lambda: connect(timeout=CALL_TIMEOUT).decide(make_request(1)), RemoteError,
                                    "malformed response")
    assert problem in str(error) and "'tone'" in str(error)


@pytest.mark.parametrize("body, problem", [
    (b"<html>502 from a proxy</html>", "not JSON"),
    ({"answers": {}}, "no answer for question 'q'"),
    ({"answers": {"q": {"type": "choice"}}}, "is not a noul answer"),
    ({"result": "yes"}, "no 'answers' object"),
])
def test_malformed_body_is_a_remote_error_and_not_retried(stub, connect, body, problem):
    stub.script = [("reply", 200, body)]
    with pytest.raises(RemoteError, match="malformed response") as caught:
        connect().decide(NOUL)
    assert problem in str(caught.value) and stub.url in str(caught.value)
    assert len(stub.seen) == 1


def test_422_maps_to_request_error_with_the_fields(stub, connect):
    detail = [{"loc": ["body", "questions", "q", "criteria"], "msg": "choice needs 2–255 options", "type": "x"},
              {"loc": ["body", "state"], "msg": "field required", "type": "missing"}]
    stub.script = [("reply", 422, {"detail": detail})]
    with pytest.raises(RequestError) as caught:
        connect().decide(NOUL)
    assert [(p.loc, p.msg) for p in caught.value.problems] == [
        (("questions", "q", "criteria"), "choice needs 2–255 options"), (("state",), "field required")]
    assert str(caught.value).startswith(f"{stub.url}{ENDPOINT_PATH} refused the request: questions.q.criteria")
    assert len(stub.seen) == 1  # a bad request is not retried


def test_413_maps_to_token_budget_or_too_large(stub, connect):
    stub.script = [("reply", 413, {"detail": {"error_type": "token_budget_exceeded", "message": "too long",
                                              "over_by": 7, "part": "state", "max_length": 100,
                                              "token_counts": {"total": 107}}}),
                   ("reply", 413, {"detail": {"error_type": "request_too_large", "message": "body > 1 MiB"}})]
    engine = connect()
    with pytest.raises(TokenBudgetError) as budget:
        engine.decide(NOUL)
    assert (budget.value.over_by, budget.value.max_length, budget.value.token_counts) == (7, 100, {"total": 107})
    with pytest.raises(RequestTooLargeError, match="body > 1 MiB"):
        engine.decide(NOUL)


@pytest.mark.parametrize("status, message", [(401, "pass api_key= or set \\$CLEF_API_KEY"),
                                             (404, "is http://127.0.0.1:\\d+ a System One endpoint")])
def test_401_and_404_say_what_to_do(stub, connect, status, message):
    stub.script = [("reply", status, {"detail": {"error_type": "x", "message": "nope"}})]
    with pytest.raises(RemoteError, match=message) as caught:
        connect().decide(NOUL)
    assert caught.value.status == status and len(stub.seen) == 1


def wait_until(condition, what: str, timeout: float = 60) -> None:
    """Poll `condition` until it holds; `timeout` is a safety limit for a busy machine, not part of the claim."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_concurrency_is_bounded_and_used(stub, connect):
    stub.script = [("hang",)] * 6  # the stub holds every request until released
    engine = connect(max_concurrency=2)
    future = engine.submit([dict(NOUL, state=str(i)) for i in range(6)])
    wait_until(lambda: stub.active == 2, "two requests in flight")
    time.sleep(0.2)  # room for a third request to arrive, were the bound not kept
    assert engine.queue_depth() == 6 and stub.max_active == 2 and len(stub.seen) == 2
    stub.released.set()
    answers = future.result(timeout=60)
    assert [a["answers"]["q"]["noul"] for a in answers] == [0.75] * 6
    assert stub.max_active == 2
    assert sorted(s["body"]["state"] for s in stub.seen) == [str(i) for i in range(6)]
    assert [a["x_echo"] for a in answers] == [str(i) for i in range(6)]  # answers in the order of the requests
    assert engine.queue_depth() == 0


def test_one_connection_is_reused(stub, connect):
    engine = connect()
    for i in range(4):
        engine.decide(dict(NOUL, state=str(i)))
    assert len({s["port"] for s in stub.seen}) == 1


def test_key_from_env_or_argument_sent_as_bearer_and_never_shown(stub, monkeypatch):
    monkeypatch.setenv("CLEF_API_KEY", "env-key")
    with RemoteEngine(stub.url) as engine:  # check=True: GET /v1/models first
        engine.decide(NOUL)
        assert engine.info()["models"] == ["stub-model"]
        assert engine.info()["random_weights"] is False, "an endpoint that does not say so is not flagged"
        assert "env-key" not in json.dumps(engine.info()) and "env-key" not in repr(engine)
    with RemoteEngine(stub.url, api_key=API_KEY) as engine:
        engine.decide(NOUL)
    # http.server reads header bytes as latin-1; encoding back gives the bytes sent
    assert [s["authorization"].encode("latin-1") for s in stub.seen] == \
        [b"Bearer env-key", b"Bearer " + API_KEY.encode("utf-8")]
    assert stub.seen[0]["content_type"] == "application/json"


def test_model_and_budget_options_travel_in_the_body(stub, connect):
    connect().decide(dict(NOUL, model="from-request"))
    connect(model="clef-flash").decide(dict(NOUL, model="from-request"), max_length=99,
                                       overflow="truncate_state")
    assert stub.seen[0]["body"] == dict(NOUL, model="from-request")  # defaults add nothing
    assert stub.seen[1]["body"] == dict(NOUL, model="clef-flash", x_max_length=99, x_overflow="truncate_state")


def test_unsendable_request_fails_at_submit_and_sends_nothing(stub, connect):
    with pytest.raises(RequestError, match="cannot be sent as JSON"):
        connect().submit([dict(NOUL, state=math.nan)])
    with pytest.raises(RequestError, match="JSON object"):
        connect().submit(["not a request"])
    assert stub.seen == []


def test_close_ends_a_retry_wait(stub, connect):
    stub.script = [("reply", 429, {"detail": "busy"}, {"retry-after": "3600"})]  # waits max_retry_wait_s: 120 s
    engine = connect(timeout=600)
    future = engine.submit([NOUL])
    wait_until(lambda: stub.seen and stub.active == 0, "the 429 answered")
    engine.close()
    with pytest.raises(CancelledError):
        future.result(timeout=STALL_SECONDS)  # far before the retry wait would have ended
    assert len(stub.seen) == 1  # no attempt after the close


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("https://gw.example/jev/v1/systemone/", "https://gw.example/jev"),
])
def test_parse_endpoint(url, expected):
    assert parse_endpoint(url) == expected


@pytest.mark.parametrize("url, message", [("http://user:secret@host:1", "not in the URL"),
                                          ("ftp://host", "not an http"), ("http://host/?key=1", "no query")])
def test_parse_endpoint_refuses(url, message):
    with pytest.raises(ValueError, match=message):
        parse_endpoint(url)


def test_decide_many_can_return_an_error_per_request_like_the_local_engine(stub, connect):
    stub.script = [("ok",), ("reply", 422, {"detail": [{"loc": ["body", "state"], "msg": "bad state",
                                                        "type": "value_error"}]})]
    engine = connect(max_concurrency=1)  # in order, so the stub's script meets the requests in order
    outcomes = engine.decide_many([NOUL, NOUL, {"state": math.nan, "questions": {}}, NOUL], errors="return")
    assert outcomes[0]["answers"]["q"]["noul"] == 0.75 and outcomes[3]["answers"]["q"]["noul"] == 0.75
    assert isinstance(outcomes[1], RequestError) and outcomes[1].problems[0].loc == ("state",)
    assert isinstance(outcomes[2], RequestError) and "cannot be sent as JSON" in str(outcomes[2])
    assert len(stub.seen) == 3  # the unsendable one was not sent
