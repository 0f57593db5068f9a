"""Fuzzing the HTTP API: at least 1,000 generated bodies sent to one real server process on the tiny release, none
of which may get a 5xx or kill it. Random JSON, wrong types, broken encodings and content types, media the processors
cannot take (extreme aspect ratios, 0- and 1-frame videos, PNG bytes labelled video/mp4, GIFs, bad base64), JSON
assets, and placeholder names that collide with keys, ids and types.

The fuzz test records every bad answer instead of stopping at the first and reports all of them (grouped) at its
end; the media cases are also sent one by one, each its own test, so a failure names its case."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.api import INTERNAL_NAMES, check_answers
from tests.support.bodies import make_request
from tests.support.media import b64, gif, h264_mp4, lying_jpeg, pixel_bomb, plain_png
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow  # real server processes
FUZZ_EXAMPLES = 1000
MAX_422_BYTES = 64 * 1024
PNG_OK = plain_png(8, 8)
MEDIA = {
    "png 8x8": PNG_OK,
    "png 201x1": plain_png(201, 1),
    "png 1x300": plain_png(1, 300),
    "png 20 MP header": pixel_bomb(),
    "gif": gif(),
    "mp4 1 frame": h264_mp4(1),
    "mp4 0 frames": h264_mp4(0),
    "mp4 3 frames": h264_mp4(3),
    "jpeg lying header": lying_jpeg(4000, 4000),
    "text": b"hello, not media",
    "empty": b"",
}
# (content type to declare, media name): honest labels and lying ones.
MEDIA_ITEMS = [
    ("image/png", "png 8x8"), ("image/png", "png 201x1"), ("image/png", "png 1x300"), ("image/png", "png 20 MP header"),
    ("image/gif", "gif"), ("image/png", "gif"), ("image/jpeg", "png 8x8"), ("image/png", "text"),
    ("image/png", "empty"), ("video/mp4", "mp4 1 frame"), ("video/mp4", "mp4 0 frames"), ("video/mp4", "mp4 3 frames"),
    ("video/mp4", "png 8x8"), ("video/webm", "mp4 1 frame"), ("image/png", "mp4 1 frame"), ("video/mp4", "text"),
    ("image/jpeg", "jpeg lying header"),
]
COLLIDING_NAMES = ["noul", "type", "state", "questions", "choice", "score", "criteria", "instructions", "true",
                   "false", "0", "billing", "tone", "P1", "P10", "[image 1]", "images", ""]


def media_item(content_type: str, name: str, as_object: bool) -> object:
    payload = b64(MEDIA[name])
    if as_object:
        return {"content_type": content_type, "base64": payload}
    return f"data:{content_type};base64,{payload}"


# --- the media cases one by one --------------------------------------------------------------------------------


@pytest.mark.parametrize(("content_type", "name"), MEDIA_ITEMS, ids=[f"{t} {n}" for t, n in MEDIA_ITEMS])
@pytest.mark.parametrize("field", ["images", "videos"])
def test_media_case_gets_an_answer_or_a_4xx(client: httpx.Client, content_type: str, name: str, field: str) -> None:
    request = make_request(0) | {field: [media_item(content_type, name, as_object=False)]}
    response = client.post("/v1/systemone", json=request)
    assert response.status_code in (200, 413, 422), (response.status_code, response.text[:500])
    assert not INTERNAL_NAMES.search(response.text), response.text[:500]
    if response.status_code == 200:
        check_answers(request, response.json())
    else:
        assert any(problem["loc"][:2] == ["body", field] for problem in response.json()["detail"]), response.text


@pytest.mark.parametrize("name", list(MEDIA), ids=list(MEDIA))
def test_json_asset_case_gets_an_answer_or_a_4xx_naming_it(client: httpx.Client, name: str) -> None:
    request = make_request(1) | {"state": "look at noul", "assets": {"noul": {"data_base64": b64(MEDIA[name])}}}
    response = client.post("/v1/systemone", json=request)
    assert response.status_code in (200, 413, 422), (response.status_code, response.text[:500])
    if response.status_code == 200:
        assert response.json()["x_token_counts"]["media"] > 0
        assert response.json()["answers"]["billing"]["type"] == "noul"
    else:
        assert any(problem["loc"][:3] == ["body", "assets", "noul"] for problem in response.json()["detail"])


# --- generated bodies -------------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False,
                                                                                    allow_infinity=False) | st.text(
    max_size=30)
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=4) | st.dictionaries(
    st.text(max_size=12), children, max_size=4), max_leaves=12)
question_like = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["noul", "choice", "score", "box", "", "NOUL"]) | json_values,
    "instructions": json_values,
    "criteria": json_values | st.dictionaries(st.text(max_size=8), json_values | st.none(), max_size=5)
    | st.lists(json_values, max_size=12),
})
image_like = st.sampled_from(["data:image/png;base64,AAAA", "data:image/gif;base64,R0lGODlh", "data:,", "http://x",
                              "data:image/png;base64,!!!"]) | st.fixed_dictionaries(
    {}, optional={"content_type": st.sampled_from(["image/png", "image/jpeg", "text/plain"]) | json_values,
                  "base64": st.text(max_size=20) | json_values}) | json_values
request_like = st.fixed_dictionaries({}, optional={
    "model": json_values,
    "state": json_values,
    "questions": st.dictionaries(st.text(max_size=110) | st.sampled_from(["q", "a.b-c_1", "x" * 101]),
                                 question_like, max_size=4) | json_values,
    "images": st.lists(image_like, max_size=6) | json_values,
    "videos": st.lists(image_like, max_size=2) | json_values,
    "x_overflow": st.sampled_from(["refuse", "truncate_state", "drop"]) | json_values,
    "x_max_length": st.integers(-5, 40) | json_values,
    "assets": json_values | st.dictionaries(st.text(max_size=8), st.fixed_dictionaries(
        {}, optional={"type": json_values, "data_base64": st.text(max_size=12), "part": json_values}), max_size=2),
})


def _paths(value: object, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices)."""
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*path, index))
    return found


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """A valid request with 0–3 random edits (replace a subtree, delete it, or add a key), so the fuzz reaches the
    engine's encoding and the model too, not only the parser."""
    request = make_request(draw(st.integers(0, 5)))
    if draw(st.booleans()):
        request["x_max_length"] = draw(st.integers(1, 900))
        request["x_overflow"] = draw(st.sampled_from(["refuse", "truncate_state"]))
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(_paths(request)[1:]))
        parent = request
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(json_values | st.sampled_from(["", "\ud800", "x" * 300, None, [], {}]))
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(json_values)
        if not isinstance(request, dict) or not _paths(request)[1:]:
            break
    return json.dumps(request).encode()


raw_bodies = (
    mutated_requests()
    | mutated_requests()
    | st.binary(max_size=300)
    | json_values.map(lambda v: json.dumps(v).encode())
    | request_like.map(lambda v: json.dumps(v).encode())
    | st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth)
    | st.integers(1, 3000).map(lambda depth: b'{"state":' + b"[" * depth + b"]" * depth + b', "questions": {}}')
    | st.sampled_from([b'{"state": Infinity}', b'{"a": 1e999}', b"\xff\xfe{}", b'{"state": "\\ud800"}'])
)
content_types = st.sampled_from(["application/json"] * 6 + [
    "text/plain", "multipart/form-data; boundary=xyz", "multipart/form-data", "application/x-www-form-urlencoded", ""])
# (header, whether the body really is compressed that way): mostly honest, sometimes lying or unsupported.
encodings = st.sampled_from([(None, False)] * 6 + [("gzip", True), ("zstd", True), ("gzip", False), ("zstd", False),
                                                   ("deflate", False)])


def encode_body(body: bytes, encoding: str | None, honest: bool) -> bytes:
    if not honest:
        return body
    if encoding == "gzip":
        return gzip.compress(body)
    from backports.zstd import compress

    return compress(body)


media_items = (
    st.builds(lambda pair, as_object: media_item(*pair, as_object), st.sampled_from(MEDIA_ITEMS), st.booleans())
    | st.builds(media_item, st.sampled_from(sorted({t for t, _ in MEDIA_ITEMS})), st.sampled_from(list(MEDIA)),
                st.booleans())
    | st.sampled_from(["data:video/mp4;base64,!!!", "data:image/png;base64,", "data:image/png,abc",
                       "data:;base64,AAAA"])
)
odd_ids = st.sampled_from(["with space", "질문", "🎯", "a/b", "", " ", "x" * 2000, "\u0000", "type", "noul", "\ud7ff"])


@st.composite
def requests_with_media(draw: st.DrawFn) -> bytes:
    """A valid request with images and/or videos, some of which the processors cannot take."""
    request = make_request(draw(st.integers(0, 5)))
    for field in draw(st.lists(st.sampled_from(["images", "videos"]), min_size=1, max_size=2, unique=True)):
        request[field] = draw(st.lists(media_items, min_size=0, max_size=3))
    return json.dumps(request).encode()


@st.composite
def requests_with_assets(draw: st.DrawFn) -> bytes:
    """A valid request whose text, keys and ids use the asset names, and JSON assets good and bad."""
    names = draw(st.lists(st.sampled_from(COLLIDING_NAMES) | st.text(max_size=6), min_size=1, max_size=3,
                          unique=True))
    request = make_request(draw(st.integers(0, 5)))
    request["state"] = {name: f"see {name} and {' '.join(names)}" for name in names} if draw(st.booleans()) \
        else " ".join(names)
    request["questions"] |= {name or "empty": {"type": draw(st.sampled_from(["noul", "choice", name])),
                                               "instructions": f"Is {name} fine?",
                                               "criteria": {name or "x": f"{name} yes", "other": None}}
                             for name in names[:2]}
    assets = {}
    for name in names:
        kind = draw(st.sampled_from(["good", "good", "media", "bad base64", "not an object", "part", "no data"]))
        if kind == "good":
            assets[name] = {"format": "png", "data_base64": b64(PNG_OK)}
        elif kind == "media":
            assets[name] = {"format": draw(st.sampled_from(["png", "gif", "jpeg", 5])),
                            "data_base64": b64(MEDIA[draw(st.sampled_from(list(MEDIA)))])}
        elif kind == "bad base64":
            assets[name] = {"data_base64": draw(st.sampled_from(["!!!", "AAA", "=", "QUJD\n", ""]))}
        elif kind == "not an object":
            assets[name] = draw(json_values)
        elif kind == "part":
            assets[name] = {"part": draw(st.text(max_size=5))}
        else:
            assets[name] = {"type": draw(st.sampled_from(["image", "video", None]))}
    request["assets"] = assets
    return json.dumps(request).encode()


@st.composite
def requests_with_odd_ids(draw: st.DrawFn) -> bytes:
    request = make_request(draw(st.integers(0, 5)))
    request["questions"] = {draw(odd_ids | st.text(max_size=20)): question
                            for question in request["questions"].values()}
    return json.dumps(request).encode()


@st.composite
def multipart_bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    """The SDK's multipart shape, with parts good, bad and missing."""
    request = make_request(draw(st.integers(0, 5)))
    names = draw(st.lists(st.sampled_from(COLLIDING_NAMES[:8]), max_size=2, unique=True))
    request["assets"] = {name: {"part": draw(st.sampled_from(["file0", "file1", "missing"]))} for name in names}
    request["state"] = " ".join(names) or "no assets"
    fields: dict = {}
    if draw(st.integers(0, 9)):
        fields["request"] = (None, json.dumps(request).encode(), "application/json")
    for index in range(draw(st.integers(0, 2))):
        fields[f"file{index}"] = (f"f{index}", MEDIA[draw(st.sampled_from(list(MEDIA)))], "image/png")
    if not fields:
        fields["other"] = (None, b"x", "text/plain")
    built = httpx.Request("POST", "http://x", files=fields)
    return built.read(), built.headers["content-type"]


json_bodies = (
    raw_bodies
    | requests_with_media()
    | requests_with_media()
    | requests_with_assets()
    | requests_with_assets()
    | requests_with_odd_ids()
)
content_types = st.sampled_from(["application/json"] * 12 + [
    "application/json; charset=utf-8", "APPLICATION/JSON", "application/json; charset=latin-1", "text/plain",
    "multipart/form-data; boundary=xyz", "multipart/form-data", "application/x-www-form-urlencoded", "text/json",
    "application/json, text/plain", ""])
cases = st.one_of(
    st.tuples(json_bodies, content_types, encodings),
    st.tuples(multipart_bodies(), encodings).map(lambda pair: (pair[0][0], pair[0][1], pair[1])),
)
def test_no_fuzzed_body_gets_a_5xx(server: ServerProcess, client: httpx.Client) -> None:
    """Every generated body is answered with a 2xx/4xx in our words, the server is still up and answering correctly
    afterwards, and nothing it logged meanwhile is a traceback."""
    log_start = server.log_path.stat().st_size
    answers: Counter = Counter()
    failures: list[tuple[int, str, str]] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              phases=[Phase.explicit, Phase.generate], database=None)
    @given(case=cases)
    def send(case: tuple[bytes, str, tuple[str | None, bool]]) -> None:
        body, content_type, encoding = case
        headers = {"content-type": content_type} if content_type else {}
        if encoding[0]:
            headers["content-encoding"] = encoding[0]
        try:
            response = client.post("/v1/systemone", content=encode_body(body, *encoding), headers=headers)
        except httpx.TransportError as error:  # the server hung up or died: as bad as a 5xx
            answers["transport error"] += 1
            failures.append((0, repr(error), body[:300].decode("utf-8", "replace")))
            return
        answers[response.status_code] += 1
        ok = response.status_code in (200, 413, 415, 422) and not INTERNAL_NAMES.search(response.text)
        ok = ok and not (response.status_code == 422 and len(response.content) > MAX_422_BYTES)
        try:
            answer = response.json()
            ok = ok and ("answers" in answer if response.status_code == 200 else "detail" in answer)
            json.dumps(answer, allow_nan=False)
        except ValueError:
            ok = False
        if not ok:
            failures.append((response.status_code, response.text[:300], body[:300].decode("utf-8", "replace")))

    send()
    assert sum(answers.values()) >= FUZZ_EXAMPLES, answers
    assert answers[200] >= 50, answers  # the fuzz reaches the model, not only the parser
    by_answer = Counter(f"{status} {text[:120]}" for status, text, _ in failures)
    examples = {f"{status} {text[:120]}": body for status, text, body in failures}
    report = "\n".join(f"{n}x {answer}\n   e.g. body {examples[answer][:200]!r}"
                       for answer, n in by_answer.most_common())
    assert not failures, f"{len(failures)} of {sum(answers.values())} bodies got a bad answer:\n{report}"
    assert server.alive()
    response = client.post("/v1/systemone", json=make_request(7))
    assert response.status_code == 200
    check_answers(make_request(7), response.json())
    with open(server.log_path, "rb") as log:
        log.seek(log_start)
        logged = log.read().decode(errors="replace")
    assert "Traceback" not in logged, logged[-5000:]
