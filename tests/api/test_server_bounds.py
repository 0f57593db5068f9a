"""Issue 40's hostile requests against a real server process on the tiny release (CPU): a body's every intermediate
— the inflated body, a truncated state, an explanation's variants, thousands of questions — is bounded by the
request's checked limits, or refused with 413 before it is built. Memory is the server's resident set, sampled while
the request runs (RssSampler); work is the server's own CPU time, whatever the machine's load does to the clock."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clef_engine.serve.bodies import ZstdDecompressor
from tests.support.api import JSON
from tests.support.hostile import (
    MAX_GROWTH_MB,
    MAX_WORK_SECONDS,
    SMALL,
    RssSampler,
    cpu_seconds,
    engine_metric,
    noul_questions,
)
from tests.support.servers import ServerProcess, serving

pytestmark = pytest.mark.slow  # real server processes
QUESTIONS = {"late": {"type": "noul", "instructions": "Is the parcel late?"},
             "tone": {"type": "choice", "instructions": "What is the tone?",
                      "criteria": {"calm": None, "angry": "The customer is angry."}}}


@pytest.fixture(scope="module")
def ceiling_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serving(tiny_release, tmp_path_factory, "ceiling-server.log", "--max-tokens-per-request", "4000")


def measured(server: ServerProcess, send) -> tuple[httpx.Response, float, float]:
    """`send`'s answer, the server's growth in MB while it ran, and the CPU seconds it took."""
    with httpx.Client(base_url=server.url, timeout=300) as http:
        before = cpu_seconds(server.process.pid)
        sampler = RssSampler(server.process.pid)
        response = send(http)
        growth = sampler.stop()
        work = cpu_seconds(server.process.pid) - before
    assert response.status_code < 500, response.text[:500]
    assert "Traceback" not in response.text
    assert server.alive()
    return response, growth, work


def zstd(data: bytes) -> bytes:
    if ZstdDecompressor is None:
        pytest.skip("no zstd in this Python")  # pragma: no cover - the test requirements install the backport
    try:
        from compression.zstd import compress  # type: ignore[import-not-found]
    except ImportError:
        from backports.zstd import compress
    return compress(data)


def test_explaining_a_json_state_of_thousands_of_fields_is_refused_before_its_variants(
        fresh_server: ServerProcess) -> None:
    """A JSON state of 6,000 fields that fits the budget: refused from the count of its fields, not after copying
    the state once per field (a 24 KB one took 25.7 CPU-seconds before its 413)."""
    body = {"state": {"items": [0] * 6_000}, "questions": QUESTIONS, "x_explain": True}
    response, growth, work = measured(fresh_server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 413, response.text[:500]
    assert response.json()["detail"]["part"] == "explanation"
    assert work <= MAX_WORK_SECONDS, f"the refusal took {work:.1f} s of the server's CPU"
    assert growth < MAX_GROWTH_MB, f"the server grew by {growth:.0f} MB"


def test_explaining_a_long_text_state_holds_no_variant_in_memory(fresh_server: ServerProcess) -> None:
    """A 120 KB text of short sentences: each variant was a copy of the state, all held before the cost check
    (0.8 → 5.4 GB)."""
    body = {"state": "The parcel is late. " * 6_000, "questions": QUESTIONS, "x_explain": True,
            "x_overflow": "truncate_state"}
    response, growth, work = measured(fresh_server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 413, response.text[:500]
    assert response.json()["detail"]["part"] == "explanation"
    assert growth < MAX_GROWTH_MB, f"the server grew by {growth:.0f} MB"
    assert work <= MAX_WORK_SECONDS, f"the refusal took {work:.1f} s of the server's CPU"


@pytest.mark.parametrize("explain", [False, True], ids=["decide", "x_explain"])
def test_a_small_zstd_body_of_millions_of_sentences_truncated_is_bounded(fresh_server: ServerProcess,
                                                                        explain: bool) -> None:
    """~8 MiB of "a. a. …" in a few KB of zstd, with truncate_state: the state is cut to what fits before it is
    tokenized (the whole of it took 2.3 GB per 8 MiB); an explanation of its millions of sentences is refused from
    their count."""
    body = {"state": "a. " * (8 * 2**20 // 3), "questions": QUESTIONS, "x_overflow": "truncate_state"}
    if explain:
        body["x_explain"] = True
    compressed = zstd(json.dumps(body).encode())
    assert len(compressed) < 8 * 1024
    headers = {**JSON, "content-encoding": "zstd"}
    response, growth, _ = measured(fresh_server, lambda http: http.post("/v1/systemone", content=compressed,
                                                                  headers=headers))
    assert growth < MAX_GROWTH_MB, f"the server grew by {growth:.0f} MB"
    if explain:
        assert response.status_code == 413, response.text[:500]
        assert response.json()["detail"]["part"] == "explanation"
        assert "at least" in response.json()["detail"]["message"]
    else:
        assert response.status_code == 200, response.text[:500]
        answer = response.json()
        assert answer["usage"]["input_tokens"] == 16384
        # a lower bound past what was tokenized: at least one token per longest token's bytes of the rest
        assert 8 * 2**20 // 18 - 16384 <= answer["x_truncated_state_tokens"] < 8 * 2**20


def test_max_tokens_per_request_bounds_an_explanation(ceiling_server: ServerProcess) -> None:
    """With --max-tokens-per-request 4000, an explanation of more tokens than that in all is refused (it bought
    54,561 tokens before); one that fits is answered."""
    state = " ".join(f"Sentence {i} says the parcel is late." for i in range(40))
    with httpx.Client(base_url=ceiling_server.url, timeout=300) as http:
        plain = http.post("/v1/systemone", json={"state": state, "questions": QUESTIONS})
        assert plain.status_code == 200 and plain.json()["usage"]["input_tokens"] < 4000  # the record alone fits
        response = http.post("/v1/systemone", json={"state": state, "questions": QUESTIONS, "x_explain": True})
        assert response.status_code == 413, response.text[:500]
        detail = response.json()["detail"]
        assert detail["part"] == "explanation" and detail["max_length"] == 4000
        assert detail["max_tokens_per_request"] == 4000
        short = http.post("/v1/systemone", json={"state": "Late. Angry.", "questions": QUESTIONS, "x_explain": True})
        assert short.status_code == 200, short.text[:500]
        assert short.json()["usage"]["input_tokens"] + short.json()["x_explain_tokens"] <= 4000


def test_thousands_of_questions_are_refused_before_they_are_validated(server: ServerProcess) -> None:
    """2,800 questions are over the token ceiling from their count alone: refused 413 before the contract walks and
    renders them (one of them is malformed, which validation would have answered 422 first)."""
    questions = noul_questions(2_800) | {"bad": {"type": "nope"}}
    body = {"state": "The parcel never came.", "questions": questions, "x_max_length": 1_048_576}
    response, _, _ = measured(server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 413, response.text[:500]
    detail = response.json()["detail"]
    assert detail["part"] == "schema" and detail["max_tokens_per_request"] == 16384
    assert "at most 16,384 tokens per request" in detail["message"]


def test_a_small_decide_is_answered_while_an_explanation_runs(server: ServerProcess) -> None:
    """An explanation's 31 records run as bulk work: a small decide sent while they run waits for a layer of them,
    not for all of them (it queued behind them before), so it is answered first."""
    state = " ".join(f"Sentence {i} says the parcel {1000 + i} is late." for i in range(30))
    body = {"state": state, "questions": QUESTIONS, "x_explain": True}
    explained: dict[str, object] = {}

    def explain() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as own:
            explained["response"] = own.post("/v1/systemone", json=body)
            explained["at"] = time.monotonic()

    thread = threading.Thread(target=explain)
    thread.start()
    with httpx.Client(base_url=server.url, timeout=300) as http:
        while engine_metric(http, "clef_engine_busy") == 0:  # its records are running
            assert thread.is_alive(), explained["response"].text[:300]  # type: ignore[union-attr]
            time.sleep(0.005)
        small = http.post("/v1/systemone", json=SMALL)
        small_at = time.monotonic()
    thread.join()
    assert small.status_code == 200, small.text[:300]
    response = explained["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200, response.text[:300]
    assert small_at < explained["at"]  # type: ignore[operator]
