"""HTTP behaviour of `python -m clef_engine serve` beyond answering: JSON assets, placeholders, content types, CORS,
auth challenges, slow and idle connections, deadlines, the OpenAPI document and /docs, metrics registries. Every
test speaks to a real server process on the tiny release, as a client would."""

from __future__ import annotations

import json
import math
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clef_engine.protocol import data_url
from tests.support.api import JSON, check_answers
from tests.support.bodies import make_request, multipart
from tests.support.media import b64, gif, pixel_bomb, plain_png
from tests.support.servers import ServerProcess, serving

pytestmark = pytest.mark.slow  # real server processes
ALLOWED_ORIGIN = "http://allowed.test"
HEADER_TIMEOUT = 1.5
KEEP_ALIVE_TIMEOUT = 1
SAFETY_SECONDS = 30  # what a busy machine may add to a timer, as a limit on waiting only


# --- servers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Short connection timeouts, and CORS for one origin."""
    yield from serving(tiny_release, tmp_path_factory, "tight-server.log",
                      "--header-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT),
                      "--cors-origin", ALLOWED_ORIGIN)


# --- JSON assets and placeholders -------------------------------------------------------------------------------


def test_json_assets_reach_the_engine_like_multipart_ones(client: httpx.Client) -> None:
    photo = plain_png(40, 24)
    request = {"state": "see P1", "questions": {"red": {"type": "noul", "instructions": "Is P1 red?"}}}
    as_json = client.post("/v1/systemone", json=request | {"assets": {"P1": {"format": "png", "data_base64": b64(
        photo)}}})
    assert as_json.status_code == 200, as_json.text
    assert as_json.json()["x_token_counts"]["media"] > 0

    body, content_type = multipart(request | {"assets": {"P1": {"type": "image", "part": "photo"}}},
                                   {"photo": photo})
    as_parts = client.post("/v1/systemone", content=body, headers={"content-type": content_type})
    assert as_parts.status_code == 200, as_parts.text
    # The same image and the same text: the same tokens and the same answer.
    assert as_parts.json()["x_token_counts"] == as_json.json()["x_token_counts"]
    assert as_parts.json()["answers"] == as_json.json()["answers"]

    # And the same as the Clef way of sending it: an image, with "[image 1]" written in the text.
    direct = client.post("/v1/systemone", json={"state": "see [image 1]", "images": [data_url("image/png", photo)],
                                                "questions": {"red": {"type": "noul",
                                                                      "instructions": "Is [image 1] red?"}}})
    assert direct.json()["x_token_counts"] == as_json.json()["x_token_counts"]
    assert direct.json()["answers"] == as_json.json()["answers"]

    without = client.post("/v1/systemone", json=request)
    assert without.json()["x_token_counts"]["media"] == 0


@pytest.mark.parametrize(("case", "data"), [
    ("bad base64", None),
    ("gif", gif()),
    ("pixel bomb", pixel_bomb()),
    ("text", b"just some text, no image"),
], ids=["bad base64", "gif", "pixel bomb", "text"])
def test_bad_json_assets_get_4xx_naming_the_asset(client: httpx.Client, case: str, data: bytes | None) -> None:
    encoded = "not base64 at all!" if data is None else b64(data)
    request = {"state": "look at photo", "questions": {"q": {"type": "noul"}},
               "assets": {"photo": {"format": "png", "data_base64": encoded}}}
    response = client.post("/v1/systemone", json=request)
    assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
    problems = response.json()["detail"]
    assert any(problem["loc"][:3] == ["body", "assets", "photo"] for problem in problems), (case, problems)
    assert all("photo" in problem["msg"] for problem in problems), (case, problems)

    if data is not None:  # the same bytes as a multipart part are refused the same way
        body, content_type = multipart({k: v for k, v in request.items() if k != "assets"}
                                       | {"assets": {"photo": {"part": "file"}}}, {"file": data})
        response = client.post("/v1/systemone", content=body, headers={"content-type": content_type})
        assert 400 <= response.status_code < 500, (case, response.text)
        assert any(problem["loc"][:3] == ["body", "assets", "photo"] for problem in response.json()["detail"])


def test_placeholders_are_replaced_in_text_only(client: httpx.Client) -> None:
    """Asset names that are also keys, ids, types and option ids: only text changes (the old server turned the
    question type "noul" into "[image 1]")."""
    photo = plain_png(16, 16)

    def request(noul: str, choice: str) -> dict:
        return {
            "state": {"noul": f"a {noul} here", "type": [f"{choice} and {noul}"], "n": 3},
            "questions": {
                "noul": {"type": "noul", "instructions": f"Does {noul} show a cat?",
                         "criteria": {"true": f"{noul} shows one"}},
                "choice": {"type": "choice", "instructions": {"noul": f"which {choice}?"},
                           "criteria": {"noul": f"the {noul} option", "choice": None}},
                "score": {"type": "score", "criteria": [f"none in {noul}", {"noul": noul}]},
            },
        }

    with_assets = request("noul", "choice") | {"assets": {
        "noul": {"data_base64": b64(photo)}, "choice": {"data_base64": b64(photo)}}}
    response = client.post("/v1/systemone", json=with_assets)
    assert response.status_code == 200, response.text
    answers = response.json()["answers"]
    assert list(answers) == ["noul", "choice", "score"]
    assert [a["type"] for a in answers.values()] == ["noul", "choice", "score"]
    assert list(answers["choice"]["probabilities"]) == ["noul", "choice"]
    assert answers["score"]["legend"] == {"0": "none in [image 1]", "1": {"noul": "[image 1]"}}

    expected = request("[image 1]", "[image 2]") | {"images": [data_url("image/png", photo)] * 2}
    reference = client.post("/v1/systemone", json=expected)
    assert reference.status_code == 200, reference.text
    assert response.json()["x_token_counts"] == reference.json()["x_token_counts"]
    assert response.json()["answers"] == reference.json()["answers"]

    # "P1" must not eat the start of "P10".
    many = {"state": "P1 then P10", "questions": {"q": {"type": "noul"}},
            "assets": {"P1": {"data_base64": b64(photo)}, "P10": {"data_base64": b64(photo)}}}
    spelled = {"state": "[image 1] then [image 2]", "questions": {"q": {"type": "noul"}},
               "images": [data_url("image/png", photo)] * 2}
    assert client.post("/v1/systemone", json=many).json()["x_token_counts"] == \
        client.post("/v1/systemone", json=spelled).json()["x_token_counts"]


# --- health, content types, CORS --------------------------------------------------------------------------------


def test_health_names_the_model_without_its_path(client: httpx.Client, tiny_release: Path) -> None:
    health = client.get("/health").json()
    assert health["model"] == tiny_release.name
    assert str(tiny_release.parent) not in json.dumps(health)
    assert health["model"] == client.get("/v1/models").json()["models"][0]["name"]


def test_json_bodies_only_as_application_json(client: httpx.Client) -> None:
    body = json.dumps(make_request(0)).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8",
                         "application/jsonx", "application/x-json", None):
        headers = {"content-type": content_type} if content_type else {}
        response = client.post("/v1/systemone", content=body, headers=headers)
        assert response.status_code == 415, content_type
        detail = response.json()["detail"]
        assert detail["error_type"] == "unsupported_media_type"
        assert "application/json" in detail["message"] and "multipart/form-data" in detail["message"]
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON ; charset=UTF-8"):
        response = client.post("/v1/systemone", content=body, headers={"content-type": content_type})
        assert response.status_code == 200, (content_type, response.text)
        check_answers(make_request(0), response.json())


def test_no_cors_headers_unless_configured(client: httpx.Client, tight_server: ServerProcess) -> None:
    origin = {"origin": "http://evil.test"}
    response = client.post("/v1/systemone", json=make_request(0), headers=origin)
    assert response.status_code == 200
    assert not any(name.startswith("access-control-") for name in response.headers)
    preflight = client.options("/v1/systemone", headers=origin | {"access-control-request-method": "POST"})
    assert not any(name.startswith("access-control-") for name in preflight.headers)

    with httpx.Client(base_url=tight_server.url, timeout=60) as tight:
        allowed = tight.post("/v1/systemone", json=make_request(0), headers={"origin": ALLOWED_ORIGIN})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        preflight = tight.options("/v1/systemone", headers={"origin": ALLOWED_ORIGIN,
                                                            "access-control-request-method": "POST",
                                                            "access-control-request-headers": "content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        other = tight.post("/v1/systemone", json=make_request(0), headers=origin)
        assert "access-control-allow-origin" not in other.headers


# --- slow and idle connections, deadlines ----------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (read end of file or reset), or None if still open after `seconds`."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(4096):
                return time.monotonic() - started
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - started
    except TimeoutError:
        return None


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (what it sent before closing is read and dropped); never waits."""
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_slow_headers_and_idle_connections_are_closed_while_others_are_answered(tight_server: ServerProcess) -> None:
    host, port = "127.0.0.1", tight_server.port
    # A fresh server's first answer can take longer than the header window on a busy machine; it is not measured.
    assert httpx.post(f"{tight_server.url}/v1/systemone", json=make_request(1), timeout=60).status_code == 200
    silent = socket.create_connection((host, port))
    dripping = socket.create_connection((host, port))
    stop = threading.Event()
    drip_error: list[BaseException] = []

    def drip() -> None:  # a header line every 0.3 s: each byte would reset a plain keep-alive timer
        try:
            dripping.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
            while not stop.is_set():
                dripping.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.3)
        except OSError as error:
            drip_error.append(error)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    # The slow clients cost the others nothing: other requests are answered while the server still holds the silent
    # connection (a server serving one connection at a time would answer none before closing it).
    answered_while_held = 0
    with httpx.Client(base_url=tight_server.url, timeout=60) as http:
        while not _closed_by_server(silent):
            assert http.get("/health").status_code == 200
            answered_while_held += 1
            assert answered_while_held < 10_000, "a silent connection was kept open"
            time.sleep(0.05)
    assert answered_while_held >= 1

    # Closed at the header timeout, while it still sends a header line every 0.3 s (each would reset a plain
    # keep-alive timer); the wait is a safety limit only.
    closed_after = _closed_within(dripping, HEADER_TIMEOUT + SAFETY_SECONDS)
    stop.set()
    assert closed_after is not None, "a connection trickling its headers was kept open"

    # An idle keep-alive connection is closed too, after its answer.
    idle = socket.create_connection((host, port))
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    idle.settimeout(10)
    assert idle.recv(4096).startswith(b"HTTP/1.1 200")
    assert _closed_within(idle, KEEP_ALIVE_TIMEOUT + SAFETY_SECONDS) is not None, \
        "an idle keep-alive connection was kept open"
    for sock in (silent, dripping, idle):
        sock.close()
    assert tight_server.alive()


def timed_post(http: httpx.Client, body: dict) -> float:
    """Seconds until `body` is answered; at least that long when the server's own deadline (DEFAULT_REQUEST_TIMEOUT)
    ends it first, as on a machine many times slower than usual."""
    started = time.monotonic()
    response = http.post("/v1/systemone", json=body)
    took = time.monotonic() - started
    assert response.status_code == 200 or response.json()["detail"]["error_type"] == "deadline_exceeded", \
        response.text[:300]
    return took


def test_a_request_past_the_deadline_gets_a_clear_error(tiny_release: Path, client: httpx.Client,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    # The deadline is set from this machine's own speed (measured on the module's server without a deadline): far
    # under what the slow request needs and far over what a small one needs, so the test means the same on a fast
    # quiet machine and a slow busy one. A busy machine only adds to a time: the fastest of a few tries is the
    # request's own cost (the slowest would let one burst of load push the slow request past the token ceiling).
    slow = make_request(2) | {"state": "Tickets pile up while the queue is bounded. " * 600,
                              "x_max_length": 1 << 20}
    small_took = min(timed_post(client, make_request(3)) for _ in range(3))
    slow_took = min(timed_post(client, slow) for _ in range(2))
    while slow_took < 9 * small_took:  # make the slow one slower until the two are well apart, within the budget
        slower = slow | {"state": slow["state"] * 2}
        if client.post("/v1/systemone", json=slower).status_code == 413:  # over the token ceiling: as slow as it gets
            break
        slow = slower
        slow_took = min(timed_post(client, slow) for _ in range(2))
    request_timeout = round(math.sqrt(slow_took * small_took), 2)  # ≥ 3× either side
    server = ServerProcess(tiny_release, tmp_path_factory.mktemp("logs") / "deadline-server.log",
                           "--request-timeout", str(request_timeout))
    try:
        check_deadline(server, slow, request_timeout, slow_took)
    finally:
        server.stop()


def check_deadline(deadline_server: ServerProcess, slow: dict, request_timeout: float, slow_took: float) -> None:
    """`slow_took`: how long `slow` takes to be answered without a deadline, at least 3 × `request_timeout`."""
    with httpx.Client(base_url=deadline_server.url, timeout=120) as http:
        http.post("/v1/systemone", json=make_request(3))  # the first request of a process pays one-off costs
        started = time.monotonic()
        response = http.post("/v1/systemone", json=slow)
        waited = time.monotonic() - started
        assert response.status_code == 503, response.text
        detail = response.json()["detail"]
        assert detail["error_type"] == "deadline_exceeded"
        assert f"{request_timeout:g} seconds" in detail["message"]
        assert response.headers["retry-after"]
        # the error comes at the deadline, not once the work is done (a third of the way at the latest)
        assert request_timeout <= waited < slow_took, (waited, request_timeout, slow_took)
        # Others keep being answered meanwhile, and answers come back once the worker is free again.
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 200
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            small = http.post("/v1/systemone", json=make_request(3))
            if small.status_code == 200:
                break
            assert small.json()["detail"]["error_type"] == "deadline_exceeded"
        assert small.status_code == 200
        check_answers(make_request(3), small.json())
    assert "Traceback" not in deadline_server.log()


# --- OpenAPI, docs, metrics -------------------------------------------------------------------------------------


def test_openapi_document_and_docs_page(client: httpx.Client) -> None:
    from clef_engine import protocol
    from clef_engine.serve import openapi

    doc = client.get("/openapi.json")
    assert doc.status_code == 200
    spec = doc.json()
    assert spec["openapi"].startswith("3.1")
    assert {"/v1/systemone", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    own = protocol.SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schemas["SystemOneRequest"]["properties"] == own["properties"] | {"assets": openapi._ASSETS}  # HTTP only
    assert set(schemas["SystemOneResponse"]["properties"]) >= {"model", "answers", "usage"}
    post = spec["paths"]["/v1/systemone"]["post"]
    assert post["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("ValidationErrorBody")
    for status in ("401", "413", "415", "421", "429", "503"):
        assert post["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    # Every reference resolves inside the document.
    for ref in set(_refs(spec)):
        assert ref.rsplit("/", 1)[-1] in schemas, ref

    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/systemone" in page.text and "SystemOneRequest" in page.text
    for external in ("<script src", "<link", "https://", "http://"):
        assert external not in page.text, external  # nothing fetched from elsewhere: it works offline


def _refs(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        for key, child in value.items():
            if key == "$ref" and isinstance(child, str):
                yield child
            else:
                yield from _refs(child)
    elif isinstance(value, list):
        for child in value:
            yield from _refs(child)


def test_each_app_has_its_own_metrics_registry(tiny_engine: object) -> None:
    """Two API apps in one process (the workbench's and another) count separately and do not collide."""
    from starlette.testclient import TestClient

    from clef_engine.serve.server import create_app

    with TestClient(create_app(tiny_engine)) as first, TestClient(create_app(tiny_engine)) as second:
        assert first.post("/v1/systemone", json=make_request(0)).status_code == 200
        assert first.post("/v1/systemone", content=b"{", headers=JSON).status_code == 422
        text = first.get("/metrics").text
        assert 'clef_api_requests_total{path="/v1/systemone",status="200"} 1.0' in text
        assert 'clef_api_requests_total{path="/v1/systemone",status="422"} 1.0' in text
        assert "clef_engine_ready 1.0" in text
        assert 'path="/v1/systemone"' not in second.get("/metrics").text


def test_a_large_json_state_is_walked_once_and_a_bad_one_still_gets_its_422(tiny_engine: object,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating a 30 MB JSON state takes over a second: the server and the engine's encoder both validated the
    request, state included. The state is now validated once, by the encoder, and problems anywhere still get a
    422 naming them."""
    from starlette.testclient import TestClient

    from clef_engine import protocol
    from clef_engine.serve.server import create_app

    validate = protocol.SystemOneRequest.model_validate
    states_walked = []

    def counting(request, *args, **kwargs):
        states_walked.append(request.get("state") if isinstance(request, dict) else None)
        return validate(request, *args, **kwargs)

    monkeypatch.setattr(protocol.SystemOneRequest, "model_validate", counting)
    state = {"rows": [{"id": i, "note": f"row {i}"} for i in range(3)]}
    with TestClient(create_app(tiny_engine)) as client:
        reply = client.post("/v1/systemone", json={**make_request(0), "state": state})
        assert reply.status_code == 200, reply.text
        assert states_walked.count(state) == 1, states_walked
        bad = {**make_request(0), "state": state, "x_max_length": 0, "questions": {"q1": {"type": "ranking"}}}
        reply = client.post("/v1/systemone", json=bad)
        assert reply.status_code == 422
        assert {tuple(p["loc"][:3]) for p in reply.json()["detail"]} >= {("body", "x_max_length"),
                                                                        ("body", "questions", "q1")}
        reply = client.post("/v1/systemone", json={"questions": make_request(0)["questions"]})
        assert reply.status_code == 422 and ["body", "state"] in [p["loc"] for p in reply.json()["detail"]]


# --- found in the audit (issue 10): input that was silently dropped or oddly reported ------------------------------


def _split_compressed(compress, body: bytes) -> bytes:
    """`body` as two compressed members / frames back to back: a valid gzip (RFC 1952 §2.2) or zstd (RFC 8878 §3)
    stream whose decoded content is all of `body`."""
    middle = len(body) // 2
    return compress(body[:middle]) + compress(body[middle:])


def test_every_member_of_a_compressed_body_is_read_and_trailing_junk_refused(client: httpx.Client) -> None:
    import gzip

    from backports.zstd import compress as zstd_compress

    request = make_request(3)
    body = json.dumps(request).encode()
    for encoding, compress in (("gzip", gzip.compress), ("zstd", zstd_compress)):
        headers = {**JSON, "content-encoding": encoding}
        # Before: only the first member was decoded, the rest silently dropped (here: a 422 for half a JSON body).
        response = client.post("/v1/systemone", content=_split_compressed(compress, body), headers=headers)
        assert response.status_code == 200, (encoding, response.text)
        check_answers(request, response.json())
        # Before: bytes after the last member were ignored and the request answered.
        response = client.post("/v1/systemone", content=compress(body) + b"junk", headers=headers)
        assert response.status_code == 422, (encoding, response.text)
        problem = response.json()["detail"][0]
        assert problem["type"] == "decompression_error" and encoding in problem["msg"], problem


def test_a_multipart_part_sent_twice_is_refused(client: httpx.Client) -> None:
    # Before: the last 'request' (or asset) part of a name silently replaced the earlier ones and was answered.
    first, second = make_request(0), make_request(1)
    with_asset = json.dumps(second | {"assets": {"P1": {"part": "P1"}}}).encode()
    for name, fields in (
        ("request", [("request", (None, json.dumps(first).encode(), "application/json")),
                     ("request", (None, json.dumps(second).encode(), "application/json"))]),
        ("P1", [("request", (None, with_asset, "application/json")),
                ("P1", ("a.png", plain_png(32, 32), "image/png")), ("P1", ("b.png", plain_png(48, 48), "image/png"))]),
    ):
        built = httpx.Request("POST", "http://x", files=fields)
        response = client.post("/v1/systemone", content=built.read(),
                               headers={"content-type": built.headers["content-type"]})
        assert response.status_code == 422, (name, response.text)
        problem = response.json()["detail"][0]
        assert problem["loc"] == ["body", name] and "more than one part" in problem["msg"], problem
