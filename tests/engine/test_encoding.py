"""Golden tests of the input encoding (spec §2): exact text, token ids, spans, option order, media offsets."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_engine.errors import RequestError, TokenBudgetError
from clef_engine.model.encoding import PREFIX, SUFFIX, UNBOUNDED, render, schema_pieces
from clef_engine.protocol import prepare
from tests.support.bodies import REQUEST
from tests.support.media import png_bytes

GOLDEN_SCHEMA = (
    "\n\nSCHEMA FIELDS:\n"
    "\nFIELD 1\nID: paid\nTYPE: noul\nINSTRUCTION: Is the invoice paid?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"The proposition is true or the answer is yes.","option_id":"true"}\n'
    'OPTION 2: {"description":"Still open.","option_id":"false"}\n'
    "END FIELD\n"
    '\nFIELD 2\nID: route\nTYPE: choice\nINSTRUCTION: {"ask":"Which team?","hint":["ap","ar"]}\nALLOWED OPTIONS:\n'
    'OPTION 1: {"option_id":"alpha"}\n'
    'OPTION 2: {"description":{"team":"M","tier":2},"option_id":"mid"}\n'
    'OPTION 3: {"description":"Z team","option_id":"zeta"}\n'
    "END FIELD\n"
    "\nFIELD 3\nID: risk\nTYPE: score\nINSTRUCTION: risk\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"none","option_id":"0"}\n'
    'OPTION 2: {"description":"some","option_id":"1"}\n'
    'OPTION 3: {"description":"high","option_id":"2"}\n'
    "END FIELD\n"
)


def test_prefix_and_suffix_are_the_release_text():
    assert PREFIX == (
        "<|im_start|>system\nRead the complete state and schema. Decide every field jointly. Each answer must be "
        "exactly one of that field's allowed options.<|im_end|>\n<|im_start|>user\nSTATE:\n"
    )
    assert SUFFIX == "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"


def test_state_renders_compact_sorted_unicode():
    assert render("plain text stays") == "plain text stays"
    assert render(REQUEST["state"]) == (
        '{"lines":[{"qty":2,"sku":"A-1"}],"note":null,"total":12.5,"vendor":"Ünïcode GmbH"}'
    )
    assert render([3, {"b": 1, "a": [True, None]}]) == '[3,{"a":[true,null],"b":1}]'


def test_schema_text_option_order_and_defaults():
    pieces, _, _ = schema_pieces(list(prepare(REQUEST).questions))
    assert "".join(pieces) == GOLDEN_SCHEMA


def test_tokens_are_pieces_tokenized_separately_and_concatenated(tiny_engine):
    encoder = tiny_engine.encoder
    record = tiny_engine.encode(REQUEST)
    pieces, _, _ = schema_pieces(list(prepare(REQUEST).questions))
    expected = encoder.tokenize(PREFIX) + encoder.tokenize(render(REQUEST["state"]))
    for piece in pieces:
        expected += encoder.tokenize(piece)
    expected += encoder.tokenize(SUFFIX)
    assert record.input_ids == expected
    # pieces are not merged across boundaries: tokenizing the joined text can differ, the separate pieces are the rule
    special = {encoder.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")}
    assert special <= set(record.input_ids)


def test_token_counts_add_up(tiny_engine):
    record = tiny_engine.encode(REQUEST)
    counts = record.token_counts
    assert counts["total"] == len(record.input_ids)
    assert counts["prefix"] + counts["media"] + counts["state"] + counts["schema"] + counts["suffix"] == counts["total"]
    assert counts["media"] == 0 and not record.has_media


def test_spans_cover_instruction_and_option_json(tiny_engine):
    encoder = tiny_engine.encoder
    record = tiny_engine.encode(REQUEST)

    def text(span):
        return encoder.tokenizer.decode(record.input_ids[span[0]: span[1]])

    assert [text(s) for s in record.question_spans] == [
        "Is the invoice paid?", '{"ask":"Which team?","hint":["ap","ar"]}', "risk"]
    assert [text(s) for s in record.option_spans[1]] == [
        '{"option_id":"alpha"}', '{"description":{"team":"M","tier":2},"option_id":"mid"}',
        '{"description":"Z team","option_id":"zeta"}']
    assert [len(spans) for spans in record.option_spans] == [2, 3, 3]
    assert record.question_types == ["noul", "choice", "score"]


def test_missing_instruction_becomes_question_id_and_noul_overrides_each_side(tiny_engine):
    request = {"state": "x", "questions": {"q.1": {"type": "noul", "criteria": {"true": "Yes, shipped."}}}}
    pieces, _, _ = schema_pieces(list(prepare(request).questions))
    joined = "".join(pieces)
    assert "INSTRUCTION: q.1\n" in joined
    assert '{"description":"Yes, shipped.","option_id":"true"}' in joined
    assert '{"description":"The proposition is false or the answer is no.","option_id":"false"}' in joined


def test_media_tokens_follow_prefix_and_match_processor(tiny_engine):
    encoder = tiny_engine.encoder
    image = png_bytes(512, 320)
    record = tiny_engine.encode(dict(REQUEST, images=[image, image]))
    media_start = len(encoder.prefix_ids)  # the media follow the prefix
    media_ids = record.input_ids[media_start: media_start + record.token_counts["media"]]
    tokenizer = encoder.tokenizer
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    # 512×320 is already a multiple of 32 px and above the minimum area: (512/16)·(320/16)/4 = 160 tokens
    per_image = [start] + [image_pad] * 160 + [end]
    assert media_ids == per_image + per_image + encoder.tokenize("\n")
    assert record.media_inputs["image_grid_thw"].tolist() == [[1, 20, 32], [1, 20, 32]]
    # the state follows the media directly
    state_start = media_start + record.token_counts["media"]
    assert record.input_ids[state_start: state_start + 3] == encoder.tokenize(render(REQUEST["state"]))[:3]


def test_video_frames_sampled_at_two_fps(tiny_engine):
    encoder = tiny_engine.encoder
    frames = np.random.default_rng(1).integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)  # 40 frames at 10 fps = 4 s
    record = tiny_engine.encode(dict(REQUEST, videos=[{"frames": frames, "fps": 10.0}]))
    video = record.videos[0]
    assert video.frame_indices == [0, 6, 11, 17, 22, 28, 33, 39]  # 4 s × 2 fps = 8 frames, evenly spread
    assert record.media_inputs["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames / temporal patch 2
    assert encoder.tokenizer.convert_tokens_to_ids("<|video_pad|>") in record.input_ids
    assert "<0.3 seconds>" in encoder.tokenizer.decode(record.input_ids)  # the processor's frame timestamps


def test_overflow_refuse_names_part_and_amount(tiny_engine):
    long_state = "word " * 3000
    request = dict(REQUEST, state=long_state)
    full = tiny_engine.encode(request, max_length=100_000)
    # over by a few tokens: only the exact count shows it, and the message gives the exact amount
    max_length = full.token_counts["total"] - 7
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(request, max_length=max_length)
    assert caught.value.part == "state"
    assert caught.value.over_by == 7
    assert f"the record is {full.token_counts['total']:,} tokens, 7 over max_length {max_length:,}" in str(caught.value)
    # far over: refused from a lower bound, before tokenizing, and the message says it is one
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(request, max_length=1000)
    assert caught.value.part == "state"
    assert 0 < caught.value.over_by <= full.token_counts["total"] - 1000
    assert f"at least {caught.value.over_by:,} over max_length 1,000" in str(caught.value)


def test_a_schema_over_budget_is_not_advised_to_truncate_the_state(tiny_engine):
    request = dict(REQUEST, questions={"q": {"type": "noul", "instructions": "Weigh every word. " * 80}})
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(request, max_length=200, overflow="truncate_state")
    assert caught.value.part == "schema" and "truncat" not in str(caught.value)
    assert str(caught.value).endswith("shorten the schema (fewer questions or options, shorter texts), or raise "
                                      "max_length")
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(request, max_length=5)  # not even the prompt's own text fits
    frame = caught.value.token_counts["prefix"] + caught.value.token_counts["suffix"]
    assert str(caught.value).endswith(f"(prefix + suffix) alone takes {frame:,} — raise max_length")


def test_overflow_truncate_cuts_the_end_of_the_state(tiny_engine):
    encoder = tiny_engine.encoder
    request = dict(REQUEST, state="alpha beta gamma " * 500)
    full = tiny_engine.encode(request, max_length=100_000)
    cut = tiny_engine.encode(request, max_length=1000, overflow="truncate_state")
    assert len(cut.input_ids) == 1000
    assert cut.truncated_state_tokens == full.token_counts["total"] - 1000
    assert cut.token_counts["state"] == full.token_counts["state"] - cut.truncated_state_tokens
    kept = cut.token_counts["state"]
    start = len(encoder.prefix_ids)
    assert cut.input_ids[start: start + kept] == full.input_ids[start: start + kept]  # the beginning is kept
    assert cut.input_ids[start + kept:] == full.input_ids[start + full.token_counts["state"]:]  # schema intact


def test_schema_alone_over_budget_is_refused_even_with_truncation(tiny_engine):
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(REQUEST, max_length=50, overflow="truncate_state")
    assert caught.value.part == "schema"


def test_long_states_are_tokenized_once_and_encode_the_same(tiny_engine, monkeypatch):
    from clef_engine.model import encoding

    encoder = tiny_engine.encoder
    state = "invoice " * 1200  # over the memo threshold
    request = {"state": state, "questions": {"paid": {"type": "noul", "instructions": "Paid?"}}}
    first = tiny_engine.encode(request)
    calls = []
    original = encoder.tokenize
    monkeypatch.setattr(encoder, "tokenize", lambda text: calls.append(len(text)) or original(text))
    again = tiny_engine.encode(dict(request, questions={"late": {"type": "noul", "instructions": "Late?"}}))
    assert again.input_ids[: again.state_end] == first.input_ids[: first.state_end]
    assert len(state) not in calls  # the state came from the memo
    assert again.input_ids[: again.state_end] == (encoder.prefix_ids + original(state))  # and is what tokenizing gives
    for i in range(encoding.STATE_MEMO_ENTRIES + 3):  # bounded: old states fall out
        text = f"{i} " + "x" * encoding.STATE_MEMO_MIN_CHARS
        encoder.remember_state(text, encoder.tokenize(text))
    assert len(encoder._states) == encoding.STATE_MEMO_ENTRIES


# ---- budget before expensive work, no lock, nothing of a refused request kept ------------------------------------

TEXTS = [
    "", " ", "plain words", "  leading and trailing  ", "tabs\tand\nnew\r\nlines\n\n\n", "x" * 5000,
    "Ünïcödé ßtraße ✓ 🎯 질문 日本語のテキスト", "e\u0301 cafe\u0301 \u1100\u1161\u11a8 decomposed (NFD) text",
    "<|im_start|>user\nspecial tokens<|im_end|> inside <think></think> text", "numbers 1234567890 3.14159 -42",
    "code: def f(x):\n    return x ** 2  # comment", '{"json": [1, 2, {"nested": null}]}', "a" + " " * 300 + "b",
    "\u00a0\u2003 odd spaces \u200b zero width", "мир", "!!!???...,,,;;;", "'s 't 're 've 'm 'll 'd",
    "\u1fbe\u0308\u0341" * 40, "\u1100\u1161\u11a8" * 40,  # what NFC shrinks most (to U+0390, to 각)
]


def wrapper_ids(encoder, text: str) -> list[int]:
    """The ids the HF tokenizer wrapper gives (how the engine tokenized before it kept its own tokenizer)."""
    return encoder.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_own_tokenizer_gives_the_wrappers_ids(tiny_engine):
    encoder = tiny_engine.encoder
    for text in TEXTS:
        assert encoder.tokenize(text) == wrapper_ids(encoder, text), text
        assert encoder.token_bound(text) <= len(encoder.tokenize(text)), text
    assert encoder.tokenize_many(TEXTS) == [wrapper_ids(encoder, t) for t in TEXTS]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=300)
       | st.lists(st.sampled_from(["<|im_start|>", "\u1100", "\u1161", "\u11a8", "e", "\u0301", " ", "\n", "ab",
                                   "Ġ.,;:!?-_/()[]{}\"'", "1", "한", "\u1fbe", "\u0308", "\u0341"]),
                max_size=80).map("".join))
def test_token_bound_never_exceeds_the_tokens(tiny_engine, text):
    encoder = tiny_engine.encoder
    ids = encoder.tokenize(text)
    assert ids == wrapper_ids(encoder, text)
    assert encoder.token_bound(text) <= len(ids)


def test_concurrent_encodes_give_the_same_ids(tiny_engine):
    requests = [dict(REQUEST, state=f"{i}: " + TEXTS[i % len(TEXTS)] * (1 + i % 5)) for i in range(48)]
    expected = [tiny_engine.encode(r, max_length=10**6) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: tiny_engine.encode(r, max_length=10**6), requests))
    assert [r.input_ids for r in got] == [r.input_ids for r in expected]
    assert [r.option_spans for r in got] == [r.option_spans for r in expected]


def test_far_over_budget_state_is_refused_before_it_is_tokenized(tiny_engine, monkeypatch):
    encoder = tiny_engine.encoder
    tokenized: list[int] = []
    original = encoder._encode_batch
    monkeypatch.setattr(encoder, "_encode_batch",
                        lambda texts, **kw: tokenized.extend(map(len, texts)) or original(texts, **kw))
    state = "Refund me now, the parcel never arrived. " * 50_000  # 2 MB
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.decide(dict(REQUEST, state=state))
    assert caught.value.part == "state" and "at least" in str(caught.value)
    assert len(state) not in tokenized and tokenized == []  # neither the state nor the schema was tokenized
    assert tiny_engine.encode(dict(REQUEST, state=state), overflow="truncate_state").truncated_state_tokens > 0


def test_media_over_budget_is_refused_before_pixels_are_decoded(tiny_engine, monkeypatch):
    from clef_engine.model import media

    decoded = []
    monkeypatch.setattr(media, "decode_image", lambda image: decoded.append(image) or image.convert("RGB"))
    request = dict(REQUEST, images=[png_bytes(2000, 2000)])  # (2000/32)² ≈ 3,900 tokens
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encode(request, max_length=1000, overflow="truncate_state")
    assert caught.value.part == "media" and decoded == []
    with pytest.raises(TokenBudgetError):
        tiny_engine.encode(dict(request, state="word " * 5000), max_length=4000)
    assert decoded == []
    assert tiny_engine.encode(request, max_length=8000).token_counts["media"] > 3000 and len(decoded) == 1


@pytest.mark.parametrize("sizes", [(), ((512, 320),), ((2000, 1500), (333, 777), (64, 4000))])
def test_counting_tokens_gives_the_encoders_counts_without_decoding_images(tiny_engine, monkeypatch, sizes):
    """The Decide page counts tokens on every change of a request: a 12 MP photo took a second to decode and
    process each time, though its tokens follow from its header."""
    from clef_engine.model import media

    request = dict(REQUEST, state="A photo of the parcel as delivered. " * 40,
                   images=[png_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)])
    expected = dict(tiny_engine.encode(request, max_length=UNBOUNDED).token_counts)
    decoded = []
    monkeypatch.setattr(media, "decode_image", lambda image: decoded.append(image) or image.convert("RGB"))
    assert tiny_engine.count_tokens(request, max_length=2000) == {
        **expected, "max_length": 2000, "state_tokens_over": max(0, min(expected["state"], expected["total"] - 2000)),
        "fixed_tokens_over": max(0, expected["total"] - expected["state"] - 2000)}
    assert decoded == []
    with pytest.raises(RequestError) as caught:  # and what encoding refuses, counting refuses
        tiny_engine.count_tokens(dict(request, images=[*request["images"], b"not an image"]))
    assert [p.loc for p in caught.value.problems] == [("images", len(sizes))]


@pytest.mark.parametrize("seed", range(3))
def test_records_that_fit_encode_as_the_full_path_did(tiny_engine, seed):
    """Ids and counts of the old path (every part tokenized by the wrapper, then one budget check), and the same
    accept/refuse decision at every max_length around the record's size."""
    rng = np.random.default_rng(seed)
    encoder = tiny_engine.encoder
    state = " ".join(rng.choice(TEXTS, size=40))
    request = dict(REQUEST, state=state, images=[png_bytes(64, 32 + 32 * seed, seed=seed)])
    record = tiny_engine.encode(request, max_length=100_000)
    pieces, _, _ = schema_pieces(list(prepare(request).questions))
    media_length = record.token_counts["media"]
    start = len(encoder.prefix_ids)
    expected = (wrapper_ids(encoder, PREFIX) + record.input_ids[start: start + media_length]
                + wrapper_ids(encoder, state) + [i for p in pieces for i in wrapper_ids(encoder, p)]
                + wrapper_ids(encoder, SUFFIX))
    assert record.input_ids == expected
    total = len(expected)
    for max_length in (total - 1, total, total + 1):
        if max_length >= total:
            assert tiny_engine.encode(request, max_length=max_length).input_ids == expected
        else:
            with pytest.raises(TokenBudgetError) as caught:
                tiny_engine.encode(request, max_length=max_length)
            assert caught.value.over_by == 1 and caught.value.token_counts["state"] == record.token_counts["state"]


def test_refused_states_are_not_remembered(tiny_engine):
    encoder = tiny_engine.encoder
    encoder._states.clear()
    request = dict(REQUEST, state="a state the analyst keeps " * 400)
    pieces, _, _ = schema_pieces(list(prepare(request).questions))
    total = (len(encoder.prefix_ids) + len(encoder.tokenize(request["state"]))
             + sum(map(len, encoder.tokenize_many(pieces))) + len(encoder.suffix_ids))
    for max_length in (600, total - 1):  # refused from the bound, and refused after tokenizing the state
        with pytest.raises(TokenBudgetError):
            tiny_engine.encode(request, max_length=max_length)
    assert len(encoder._states) == 0
    assert len(tiny_engine.encode(request, max_length=total)) == total
    assert len(encoder._states) == 1


def test_a_long_encode_does_not_hold_up_a_small_request(tiny_engine, monkeypatch):
    """While one thread tokenizes a large state, another's small request is encoded and answered."""
    encoder = tiny_engine.encoder
    started, finished = threading.Event(), threading.Event()
    original = encoder._encode_batch

    def encode_batch(texts, **kw):
        big = any(len(t) > 500_000 for t in texts)
        if big:
            started.set()
        try:
            return original(texts, **kw)
        finally:
            if big:
                finished.set()

    monkeypatch.setattr(encoder, "_encode_batch", encode_batch)
    big = dict(REQUEST, state="long evidence text, " * 60_000)  # 1.2 MB: seconds of tokenizing
    worker = threading.Thread(target=tiny_engine.encode, args=(big,), kwargs={"max_length": 2_000_000})
    worker.start()
    assert started.wait(30)
    response = tiny_engine.decide({"state": "hi", "questions": {"q": {"type": "noul"}}})
    assert not finished.is_set()  # answered while the large state was still being tokenized
    assert response["answers"]["q"]["type"] == "noul"
    worker.join()
