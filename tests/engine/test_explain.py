"""Why (evidence attribution): `Engine.explain` and `"x_explain"` over HTTP, on the tiny release (CPU, float32).

Every `delta` is checked the way a user would check it: remove the segment by hand (delete the characters, delete
the field, paint the image region or the video frame in the mean colour and send the file again) and decide that
request alone."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from clef_engine import RequestError, TokenBudgetError
from clef_engine.explain import ENCODE_GROUP, REGION_GRID
from clef_engine.protocol import data_url
from clef_engine.runner import SHARED_SPLITS
from tests.support.api import TIMINGS, without_latency
from tests.support.bodies import QUESTIONS, SENTENCES, TEXT_STATE
from tests.support.media import png_bytes

EXACT = 1e-4  # the bound for float32 on the CPU (batched variants against each one decided alone)
# Over HTTP the answers are rounded to 4 decimals, so a difference of two of them is off by up to 1e-4 more.
ROUNDED = EXACT + 1e-4

JSON_STATE = {"customer": {"name": "Ada", "tier": "gold"}, "order": {"id": 1234, "late_days": 14},
              "message": "Refund me now!"}
VIDEO_FRAMES = np.random.default_rng(7).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)


def request(state=TEXT_STATE, **extra) -> dict:
    return {"state": state, "questions": QUESTIONS, **extra}


def alone(engine, variant: dict) -> list[list[float]]:
    """Per question, the options' probabilities (model order, unrounded) of a request decided by itself."""
    return engine.probabilities([variant])[0]


def answered(probabilities: list[list[float]]) -> list[int]:
    return [int(np.argmax(p)) for p in probabilities]


def check_deltas(engine, base_request: dict, explained: dict, variant_of) -> int:
    """Every segment's delta against deciding `variant_of(segment)` alone; returns how many were checked."""
    base = alone(engine, base_request)
    chosen = answered(base)
    variants = {}
    for q, question_id in enumerate(base_request["questions"]):
        segments = explained["x_explanations"][question_id]
        magnitudes = [abs(s["delta"]) for s in segments]
        assert magnitudes == sorted(magnitudes, reverse=True)  # ranked by effect
        for segment in segments:
            key = json.dumps({k: v for k, v in segment.items() if k != "delta"}, sort_keys=True)
            if key not in variants:
                variants[key] = alone(engine, variant_of(segment))
            expected = variants[key][q][chosen[q]] - base[q][chosen[q]]
            assert segment["delta"] == pytest.approx(expected, abs=EXACT), (question_id, segment)
    return len(variants)


def test_text_state_sentences(tiny_engine):
    explained = tiny_engine.explain(request())
    assert explained["answers"] == tiny_engine.decide(request())["answers"]
    # timed like every other answer (issue 36): its compute covers the record and each variant
    assert set(TIMINGS) <= set(explained) and explained["x_compute_ms"] > 0 and explained["x_queue_ms"] >= 0
    for segments in explained["x_explanations"].values():
        assert sorted(TEXT_STATE[s["start"]: s["end"]].strip() for s in segments) == sorted(SENTENCES)
        assert all(s["kind"] == "sentence" and s["text"] == TEXT_STATE[s["start"]: s["end"]] for s in segments)
    assert any(abs(s["delta"]) > EXACT for s in explained["x_explanations"]["angry"])  # the check below can fail

    def without(segment):
        return request(TEXT_STATE[: segment["start"]] + TEXT_STATE[segment["end"]:])

    assert check_deltas(tiny_engine, request(), explained, without) == 6


def test_text_state_lines(tiny_engine):
    explained = tiny_engine.explain(request(), unit="line")
    spans = sorted((s["start"], s["end"]) for s in explained["x_explanations"]["angry"])
    assert spans == [(0, TEXT_STATE.index("\n") + 1), (TEXT_STATE.index("\n") + 1, len(TEXT_STATE))]


def test_json_state_fields(tiny_engine):
    explained = tiny_engine.explain(request(JSON_STATE))
    paths = sorted(tuple(s["path"]) for s in explained["x_explanations"]["topic"])
    assert paths == [("customer", "name"), ("customer", "tier"), ("message",), ("order", "id"),
                     ("order", "late_days")]

    def without(segment):
        state = json.loads(json.dumps(JSON_STATE))
        parent = state
        for key in segment["path"][:-1]:
            parent = parent[key]
        del parent[segment["path"][-1]]
        return request(state)

    assert check_deltas(tiny_engine, request(JSON_STATE), explained, without) == 5


def test_image_regions(tiny_engine):
    image = png_bytes(64, 96, seed=11)
    base_request = request(images=[data_url("image/png", image)])
    explained = tiny_engine.explain(base_request)
    segments = explained["x_explanations"]["angry"]
    regions = [s for s in segments if s["kind"] == "region"]
    assert len(regions) == REGION_GRID**2 and {s["image"] for s in regions} == {0}
    # the boxes tile the image exactly once
    covered = np.zeros((96, 64), dtype=int)
    for s in regions:
        left, top, right, bottom = s["box"]
        covered[top:bottom, left:right] += 1
    assert (covered == 1).all()
    assert any(abs(s["delta"]) > EXACT for s in regions)
    pixels = np.array(Image.open(io.BytesIO(image)).convert("RGB"))
    mean = np.rint(pixels.reshape(-1, 3).mean(axis=0)).astype(np.uint8)

    def without(segment):
        if segment["kind"] == "sentence":
            state = TEXT_STATE[: segment["start"]] + TEXT_STATE[segment["end"]:]
            return request(state, images=[data_url("image/png", image)])
        left, top, right, bottom = segment["box"]
        painted = pixels.copy()
        painted[top:bottom, left:right] = mean
        buffer = io.BytesIO()
        Image.fromarray(painted).save(buffer, "PNG")  # sent again as a file, as a client would
        return request(images=[data_url("image/png", buffer.getvalue())])

    assert check_deltas(tiny_engine, base_request, explained, without) == 6 + REGION_GRID**2


def test_video_frames(tiny_engine):
    base_request = request(videos=[{"frames": VIDEO_FRAMES, "fps": 4.0}])
    record = tiny_engine.encode(base_request)
    explained = tiny_engine.explain(base_request, unit="frame")
    segments = explained["x_explanations"]["urgency"]
    assert sorted(s["frame"] for s in segments) == record.videos[0].frame_indices
    assert all(s["kind"] == "frame" and s["video"] == 0 for s in segments)
    assert any(abs(s["delta"]) > EXACT for s in segments)

    def without(segment):
        frames = VIDEO_FRAMES.copy()
        frames[segment["frame"]] = np.rint(frames[segment["frame"]].reshape(-1, 3).mean(axis=0)).astype(np.uint8)
        return request(videos=[{"frames": frames, "fps": 4.0}])

    assert check_deltas(tiny_engine, base_request, explained, without) == len(record.videos[0].frame_indices)


def test_the_variants_continue_after_the_tokens_they_share_with_the_record(tiny_engine, monkeypatch):
    """Issue 38: the record runs once, in a few chunks, and the variants continue from its states at the chunk
    ends in a few packs: each computes its tokens from its first change on (and those from the chunk end before),
    not its whole length again, and there is not a forward per variant (on the H200 that was slower than one pack of
    every variant whole)."""
    computed: list[int] = []
    layers = tiny_engine.runner.backbone._layers
    monkeypatch.setattr(tiny_engine.runner.backbone, "_layers",
                        lambda x, *args, **kwargs: computed.append(x.shape[0]) or layers(x, *args, **kwargs))
    state = " ".join(SENTENCES * 3)  # 18 sentences: more variants than the record has chunk ends
    explained = tiny_engine.explain(request(state))
    record = tiny_engine.encode(request(state))
    variants = [tiny_engine.encode(request(state[: s["start"]] + state[s["end"]:]))
                for s in explained["x_explanations"]["angry"]]
    shared = [next(i for i, (a, b) in enumerate(zip(record.input_ids, v.input_ids)) if a != b) for v in variants]
    assert min(shared) > 0 and max(shared) < record.state_end
    assert len(variants) > 2 * SHARED_SPLITS + 1  # enough variants for a forward each to show
    assert len(computed) <= 2 * SHARED_SPLITS + 1  # the record's chunks and the variants' packs
    assert sum(computed) >= len(record) + sum(len(v) - n for v, n in zip(variants, shared))
    assert sum(computed) < len(record) + sum(len(v) for v in variants)
    assert check_deltas(tiny_engine, request(state), explained,
                        lambda segment: request(state[: segment["start"]] + state[segment["end"]:])) == len(variants)


@pytest.mark.parametrize(("state", "extra", "unit", "message"), [
    (TEXT_STATE, {}, "field", "JSON object or list"),
    (JSON_STATE, {}, "sentence", "need a text state"),
    (TEXT_STATE, {}, "region", "at least one image"),
    (TEXT_STATE, {}, "frame", "at least one video"),
    (TEXT_STATE, {}, "word", "unit must be one of"),
])
def test_a_unit_the_record_has_no_segments_of_is_refused(tiny_engine, state, extra, unit, message):
    with pytest.raises(RequestError, match=message) as caught:
        tiny_engine.explain(request(state, **extra), unit=unit)
    assert caught.value.problems[0].loc == ("x_explain", "unit")


def test_an_explanation_over_the_budget_is_refused_before_its_variants_are_encoded(tiny_engine, monkeypatch):
    # 400 fields: each variant carries at least the prefix, schema and suffix, which alone exceed the budget
    state = {f"field_{i}": i for i in range(400)}
    encoded = []
    encode = tiny_engine.encoder.encode  # what the engine and Why's variants (encode_many) encode with
    monkeypatch.setattr(tiny_engine.encoder, "encode", lambda *args, **options: encoded.append(1) or encode(*args,
                                                                                                          **options))
    # counted only as far as could fit: the segments past that are never even located
    with pytest.raises(TokenBudgetError, match=r"takes at least [\d,]+ tokens .* at least [\d,]+ variants") as caught:
        tiny_engine.explain(request(state))
    assert len(encoded) == 1  # the record itself, none of its variants
    assert caught.value.part == "explanation" and caught.value.over_by > 0
    assert caught.value.max_length == 4 * tiny_engine.token_budget


def test_why_tokenizes_its_variants_together_and_keeps_the_state_an_analyst_iterates_on(tiny_engine, monkeypatch):
    """A Why's text variants are tokenized in batches on every core, not one call each, and are not memoized: the
    long state an analyst decides again and again stays tokenized (20 variants of over 4,096 characters each
    pushed it out of the encoder's 16 states)."""
    kept = " ".join(["The customer wrote again about the same invoice."] * 100)  # long enough to be memoized
    tiny_engine.decide(request(kept))
    explained_state = " ".join(f"Sentence {i} says that the customer was charged twice for order {i} and asks for "
                               f"one refund, politely, {'again and again ' * 8}today." for i in range(20))
    encoder = tiny_engine.encoder
    texts_per_call: list[int] = []
    monkeypatch.setattr(encoder, "_encode_batch", lambda texts, **options: texts_per_call.append(len(texts)) or
                        encoder._text.encode_batch(texts, **options))
    explained = tiny_engine.explain(request(explained_state))
    assert len(explained["x_explanations"]["angry"]) == 20
    assert max(texts_per_call) == ENCODE_GROUP  # the first group's states in one call
    texts_per_call.clear()
    tiny_engine.decide(request(kept))
    assert texts_per_call == []  # its state (and schema) from the memo


# --- over HTTP -----------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a real server process
def test_http_x_explain_matches_the_engine_and_deciding_again(client, tiny_engine):
    image = png_bytes(64, 96, seed=11)
    body = request(images=[data_url("image/png", image)], model="jev-latest")
    reply = client.post("/v1/systemone", json=body | {"x_explain": True})
    assert reply.status_code == 200, reply.text
    explained = reply.json()
    plain = client.post("/v1/systemone", json=body)
    assert plain.status_code == 200 and "x_explanations" not in plain.json()
    assert explained["answers"] == plain.json()["answers"]
    # the same segments and deltas as the engine in this process (same release, same float32 CPU arithmetic)
    local = tiny_engine.explain(body)
    assert set(explained["x_explanations"]) == set(QUESTIONS)
    for question_id, segments in explained["x_explanations"].items():
        assert [s | {"delta": 0} for s in segments] == [s | {"delta": 0} for s in local["x_explanations"][question_id]]
        for got, want in zip(segments, local["x_explanations"][question_id]):
            assert got["delta"] == pytest.approx(want["delta"], abs=EXACT)
    assert explained["x_explain_tokens"] > explained["usage"]["input_tokens"]
    # deciding again over HTTP with a sentence deleted moves the rounded answer by delta
    base = plain.json()["answers"]["angry"]["noul"]
    sign = 1 if base >= 0.5 else -1  # the answered option: true when P(true) is the likelier
    for segment in [s for s in explained["x_explanations"]["angry"] if s["kind"] == "sentence"]:
        state = TEXT_STATE[: segment["start"]] + TEXT_STATE[segment["end"]:]
        again = client.post("/v1/systemone", json=body | {"state": state}).json()["answers"]["angry"]["noul"]
        assert segment["delta"] == pytest.approx(sign * (again - base), abs=ROUNDED)


@pytest.mark.slow  # a real server process
def test_http_x_explain_by_unit_on_a_json_state(client):
    reply = client.post("/v1/systemone", json=request(JSON_STATE) | {"x_explain": {"unit": "field"}})
    assert reply.status_code == 200, reply.text
    assert {tuple(s["path"]) for s in reply.json()["x_explanations"]["angry"]} == {
        ("customer", "name"), ("customer", "tier"), ("message",), ("order", "id"), ("order", "late_days")}


@pytest.mark.slow  # a real server process
def test_http_without_x_explain_answers_as_before(client):
    body = request(JSON_STATE, model="jev-latest")
    plain = client.post("/v1/systemone", json=body)
    off = client.post("/v1/systemone", json=body | {"x_explain": False})
    assert plain.status_code == off.status_code == 200
    assert without_latency(plain.content) == without_latency(off.content)
    assert set(plain.json()) == {"model", "answers", "usage", *TIMINGS, "x_token_counts", "x_truncated_state_tokens"}
    on = client.post("/v1/systemone", json=body | {"x_explain": True}).json()
    assert set(TIMINGS) <= set(on), "an explained answer carries the same timings as every other"
    assert {k: v for k, v in on.items() if k not in ("x_explanations", "x_explain_tokens", *TIMINGS)} == {
        k: v for k, v in plain.json().items() if k not in TIMINGS}


@pytest.mark.slow  # a real server process
@pytest.mark.parametrize(("option", "loc"), [
    ({"unit": "word"}, ["body", "x_explain", "unit"]),
    ("yes", ["body", "x_explain"]),
    ({"unit": "region"}, ["body", "x_explain", "unit"]),  # valid, but the record has no image
])
def test_http_bad_x_explain_is_422_naming_it(client, option, loc):
    reply = client.post("/v1/systemone", json=request() | {"x_explain": option})
    assert reply.status_code == 422, reply.text
    assert [p["loc"] for p in reply.json()["detail"]] == [loc]


@pytest.mark.slow  # a real server process
def test_http_explanation_over_the_budget_is_413_naming_its_cost(client, tiny_engine):
    # many short sentences: the record fits, its one-sentence-shorter copies together do not
    state = " ".join(f"Line {i} says the parcel {i} is late." for i in range(160))
    body = request(state)
    assert client.post("/v1/systemone", json=body).status_code == 200
    reply = client.post("/v1/systemone", json=body | {"x_explain": True})
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "token_budget_exceeded" and detail["part"] == "explanation"
    record = tiny_engine.encode(body)
    assert detail["token_counts"]["record"] == len(record) and detail["token_counts"]["variants"] == 160
    assert detail["token_counts"]["explanation"] > detail["max_length"]
    # refused as soon as the variants tokenized so far and the least the rest take are over: a lower bound then
    assert f"takes at least {detail['token_counts']['explanation']:,} tokens" in detail["message"]
    assert "x_overflow" not in detail["message"]  # truncating the state would not make it fit
