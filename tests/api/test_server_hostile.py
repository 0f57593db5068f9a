"""Hostile clients against a real server process on the tiny release (CPU), one test per row of issue 24's table:
each cheap request that used to buy minutes of engine time or gigabytes of memory is refused or bounded (never a
5xx, the server's memory growing by less than MAX_GROWTH_MB), while small decides from another client go on being
answered: their median within twice the idle time plus a second (the idle time measured just before and just after,
on this machine as busy as it is then: a load that comes or goes meanwhile is in the measure), and, when the hostile
request is worked on for longer than that, one of them answered before it is. Not their maximum: on a machine whose
cores other work also burns, any one request can wait a scheduler's second, the hostile request or not.

The memory is sampled from /proc/PID/status (VmRSS) while the hostile request runs; its growth is the highest
sample less the one before."""

from __future__ import annotations

import base64
import gzip
import io
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.api import JSON, check_answers
from tests.support.hostile import (
    MAX_GROWTH_MB,
    MAX_WORK_SECONDS,
    SMALL,
    RssSampler,
    cpu_seconds,
    engine_metric,
    noul_questions,
)
from tests.support.media import lying_jpeg
from tests.support.servers import ServerProcess, serving

pytestmark = pytest.mark.slow  # real server processes
SLACK_SECONDS = 1.0  # what a busy CI machine may add to a small decide, on top of twice its idle time


@pytest.fixture(scope="module")
def server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's own server, not the session's: these tests bound its memory growth, which memory freed by other
    modules' requests would hide."""
    yield from serving(tiny_release, tmp_path_factory, "hostile-server.log")


def small_decide_seconds(http: httpx.Client) -> float:
    started = time.monotonic()
    response = http.post("/v1/systemone", json=SMALL)
    took = time.monotonic() - started
    assert response.status_code == 200, response.text
    check_answers(SMALL, response.json())
    return took


def while_hostile(server: ServerProcess, send: Callable[[httpx.Client], httpx.Response]) -> httpx.Response:
    """Runs `send` from its own client while another client keeps sending small decides; checks the small ones'
    latency and the server's memory; returns the hostile request's answer."""
    answer: dict[str, httpx.Response] = {}
    hostile_answered = 0.0
    with httpx.Client(base_url=server.url, timeout=300) as http:
        idle = max(small_decide_seconds(http) for _ in range(5))
        sampler = RssSampler(server.process.pid)

        def hostile() -> None:
            nonlocal hostile_answered
            with httpx.Client(base_url=server.url, timeout=300) as own:
                answer["response"] = send(own)
            hostile_answered = time.monotonic()

        thread = threading.Thread(target=hostile)
        thread.start()
        time.sleep(0.2)  # the hostile request is on its way in, or being worked on
        spans = []  # (sent, answered) of each small decide
        while thread.is_alive() or not spans:
            sent = time.monotonic()
            spans.append((sent, sent + small_decide_seconds(http)))
        thread.join()
        growth = sampler.stop()
        idle = max(idle, *(small_decide_seconds(http) for _ in range(5)))
    response = answer["response"]
    assert response.status_code < 500, response.text[:500]
    assert growth < MAX_GROWTH_MB, f"the server grew by {growth:.0f} MB"
    bound = 2 * idle + SLACK_SECONDS
    latencies = [answered - sent for sent, answered in spans]
    assert statistics.median(latencies) <= bound, f"small decides took {latencies} s, {idle:.2f} s idle"
    if hostile_answered - spans[0][0] > bound:  # worked on long enough that a small decide could wait for it
        assert any(answered < hostile_answered for _, answered in spans), (
            f"no small decide was answered in the {hostile_answered - spans[0][0]:.1f} s the hostile request took")
    assert server.alive()
    return response


def test_thousands_of_questions_with_a_huge_x_max_length_are_refused_before_work(server: ServerProcess) -> None:
    body = {"state": "The parcel never came.", "questions": noul_questions(2_800), "x_max_length": 1_048_576}
    response = while_hostile(server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 413, response.text[:500]
    detail = response.json()["detail"]
    assert detail["error_type"] == "token_budget_exceeded"
    assert "at most 16,384 tokens per request" in detail["message"]
    assert detail["max_tokens_per_request"] == 16384


def test_five_thousand_questions_with_truncate_state_are_refused_before_work(server: ServerProcess) -> None:
    body = {"state": "The parcel never came. " * 200, "questions": noul_questions(5_000),
            "x_overflow": "truncate_state", "x_max_length": 1_048_576}
    response = while_hostile(server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 413, response.text[:500]
    assert response.json()["detail"]["part"] == "schema"


def test_gzip_body_of_many_empty_members_is_refused_at_once(server: ServerProcess) -> None:
    empty_member = gzip.compress(b"")
    body = empty_member * 200_000
    headers = {**JSON, "content-encoding": "gzip"}
    response = while_hostile(server, lambda http: http.post("/v1/systemone", content=body, headers=headers))
    assert response.status_code == 422, response.text[:500]
    assert "members" in response.json()["detail"][0]["msg"]


def test_x_gzip_is_gzip(server: ServerProcess, client: httpx.Client) -> None:
    body = gzip.compress(json.dumps(SMALL).encode())
    response = client.post("/v1/systemone", content=body, headers={**JSON, "content-encoding": "x-gzip"})
    assert response.status_code == 200, response.text[:500]
    check_answers(SMALL, response.json())


def h264_video(width: int, height: int, frames: int) -> bytes:
    """An MP4 of `frames` black frames, compressed as far as H.264 goes (a few bytes a frame)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "51", "preset": "ultrafast"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(black):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def test_small_full_hd_video_of_many_frames_is_bounded(server: ServerProcess) -> None:
    """A 26 KB video of 400 full-HD frames costs at most MAX_WORK_SECONDS of the server's CPU (its own time,
    whatever the machine's load does to the wall clock) and at most MAX_GROWTH_MB, while others are answered."""
    video = h264_video(1920, 1080, 400)
    assert len(video) < 64_000
    body = {**SMALL, "videos": [f"data:video/mp4;base64,{base64.b64encode(video).decode()}"]}
    with httpx.Client(base_url=server.url, timeout=300) as http:
        before = cpu_seconds(server.process.pid)
        response = http.post("/v1/systemone", json=body)
        work = cpu_seconds(server.process.pid) - before
    assert response.status_code in (200, 413, 422), response.text[:500]
    assert work <= MAX_WORK_SECONDS, f"the video took {work:.1f} s of the server's CPU"
    response = while_hostile(server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code in (200, 413, 422), response.text[:500]


def test_jpeg_whose_header_lies_about_its_size_is_refused(server: ServerProcess) -> None:
    image = lying_jpeg(4000, 4000)
    assert len(image) < 1000
    Image.open(io.BytesIO(image)).convert("RGB")  # the decoder alone would take it: 16 MP from these few bytes
    body = {**SMALL, "images": [f"data:image/jpeg;base64,{base64.b64encode(image).decode()}"]}
    response = while_hostile(server, lambda http: http.post("/v1/systemone", json=body))
    assert response.status_code == 422, response.text[:500]
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "images", 0]
    assert "4000×4000" in problem["msg"] and "bytes" in problem["msg"]


def test_over_size_bodies_back_to_back_are_refused_unread(server: ServerProcess) -> None:
    """One client sends bodies over the size limit back to back; each is refused from its Content-Length, before
    its bytes are read, and the small decides of another client keep their pace."""
    body = b"{" + b" " * (40 * 2**20) + b"}"
    statuses = []

    def send(http: httpx.Client) -> httpx.Response:
        started = time.monotonic()
        while True:
            try:
                response = http.post("/v1/systemone", content=body, headers=JSON)
            except httpx.TransportError:  # the server may close the connection before the body is sent
                statuses.append(413)
                http.close()
                http = httpx.Client(base_url=server.url, timeout=300)
                continue
            statuses.append(response.status_code)
            if time.monotonic() - started > 5:
                return response

    response = while_hostile(server, send)
    assert response.status_code == 413
    assert set(statuses) == {413}


def test_errors_are_bounded_and_in_our_words(server: ServerProcess, client: httpx.Client) -> None:
    # 2,000 questions fit the token ceiling from their count (more are refused 413 before they are validated)
    many_bad = {"state": "x", "questions": {f"q{i}": {"type": "nope"} for i in range(2_000)}}
    response = client.post("/v1/systemone", json=many_bad)
    assert response.status_code == 422
    assert len(response.content) < 64 * 1024
    assert response.json()["detail"][-1]["type"] == "too_many_problems"

    response = client.post("/v1/systemone", json={**SMALL, "model": "m" * 2**20})
    assert response.status_code == 422 and len(response.content) < 2048

    response = client.post("/v1/systemone", content=b'{"state": ' + b"7" * 5000 + b"}", headers=JSON)
    assert response.status_code == 422
    assert "digits" in response.text and "set_int_max_str_digits" not in response.text
    questions = json.dumps(SMALL["questions"]).encode()
    for digits, status in ((100, 200), (101, 422)):  # the limit counts digits: a minus sign is none
        body = b'{"state": -' + b"7" * digits + b', "questions": ' + questions + b"}"
        response = client.post("/v1/systemone", content=body, headers=JSON)
        assert response.status_code == status, response.text[:300]
    assert f"a number of {digits} digits" in response.text

    not_utf8 = b'{"state": "caf\xe9", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}'
    response = client.post("/v1/systemone", files={"request": (None, not_utf8)})
    assert response.status_code == 422, response.text[:300]
    assert "not UTF-8" in response.json()["detail"][0]["msg"]


def test_no_redirect_and_only_allowed_hosts(server: ServerProcess, client: httpx.Client) -> None:
    response = client.post("/v1/systemone/", json=SMALL, headers={"host": "evil.example"})
    assert response.status_code in (400, 421) and "location" not in response.headers
    response = client.post("/v1/systemone/", json=SMALL)
    assert response.status_code == 404 and "location" not in response.headers
    response = client.post("/v1/systemone", json=SMALL, headers={"host": f"rebound.example:{server.port}"})
    assert response.status_code == 421
    for host in ("localhost", "127.0.0.1", "[::1]"):
        response = client.post("/v1/systemone", json=SMALL, headers={"host": f"{host}:{server.port}"})
        assert response.status_code == 200, (host, response.text[:300])


@pytest.fixture(scope="module")
def deadline_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that sells big requests (no token ceiling to speak of) but answers within half a second."""
    yield from serving(tiny_release, tmp_path_factory, "deadline-server.log", "--request-timeout", "0.5",
                       "--max-tokens-per-request", "1048576")


def test_work_past_the_deadline_stops_in_the_engine(deadline_server: ServerProcess) -> None:
    """A request the engine cannot finish in time gets 503, and the engine stops working on it part-way: the batch
    counts as abandoned (raised between two layers, not finished), and the engine is idle again."""
    # ~15k tokens: seconds of work on the tiny CPU model even on an idle machine, so the half-second deadline always
    # falls inside it (100 questions alone once finished in time)
    body = {"state": "The parcel never came. " + "It was due on Monday. " * 400, "questions": noul_questions(100)}
    with httpx.Client(base_url=deadline_server.url, timeout=300) as http:
        assert engine_metric(http, "clef_engine_abandoned_batches_total") == 0
        response = http.post("/v1/systemone", json=body)
        answered = time.monotonic()
        assert response.status_code == 503, response.text[:300]
        assert response.json()["detail"]["error_type"] == "deadline_exceeded"
        while engine_metric(http, "clef_engine_busy") != 0:
            assert time.monotonic() - answered < 300, "the engine is still busy"
            time.sleep(0.05)
        assert engine_metric(http, "clef_engine_abandoned_batches_total") == 1


def test_impossible_chunk_size_is_refused_at_once(server: ServerProcess) -> None:
    """A chunked body announcing a chunk larger than the body limit gets 413 at once, not a wait for its bytes."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
        connection.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFF\r\n{\"state\"")
        answer = connection.recv(4096)  # within the socket's timeout, far below the server's request timeout
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"request_too_large" in answer
