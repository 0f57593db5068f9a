"""Golden tests of the input encoding (spec §2): exact text, token ids, spans, option order, media offsets."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from clef_engine.errors import TokenBudgetError
from clef_engine.model.encoding import PREFIX, SUFFIX, render, schema_pieces
from clef_engine.protocol import parse_questions

REQUEST = {
    "state": {"vendor": "Ünïcode GmbH", "total": 12.5, "lines": [{"sku": "A-1", "qty": 2}], "note": None},
    "questions": {
        "paid": {"type": "noul", "instructions": "Is the invoice paid?", "criteria": {"false": "Still open."}},
        "route": {"type": "choice", "instructions": {"ask": "Which team?", "hint": ["ap", "ar"]},
                  "criteria": {"zeta": "Z team", "alpha": None, "mid": {"team": "M", "tier": 2}}},
        "risk": {"type": "score", "instructions": "", "criteria": ["none", "some", "high"]},
    },
}

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
    pieces, _, _ = schema_pieces(parse_questions(REQUEST))
    assert "".join(pieces) == GOLDEN_SCHEMA


def test_tokens_are_pieces_tokenized_separately_and_concatenated(tiny_engine):
    encoder = tiny_engine.encoder
    record = encoder.encode(REQUEST)
    pieces, _, _ = schema_pieces(parse_questions(REQUEST))
    expected = encoder.tokenize(PREFIX) + encoder.tokenize(render(REQUEST["state"]))
    for piece in pieces:
        expected += encoder.tokenize(piece)
    expected += encoder.tokenize(SUFFIX)
    assert record.input_ids == expected
    # pieces are not merged across boundaries: tokenizing the joined text can differ, the separate pieces are the rule
    special = {encoder.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")}
    assert special <= set(record.input_ids)


def test_token_counts_add_up(tiny_engine):
    record = tiny_engine.encoder.encode(REQUEST)
    counts = record.token_counts
    assert counts["total"] == len(record.input_ids)
    assert counts["prefix"] + counts["media"] + counts["state"] + counts["schema"] + counts["suffix"] == counts["total"]
    assert counts["media"] == 0 and record.media_offset is None


def test_spans_cover_instruction_and_option_json(tiny_engine):
    encoder = tiny_engine.encoder
    record = encoder.encode(REQUEST)

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
    pieces, _, _ = schema_pieces(parse_questions(request))
    joined = "".join(pieces)
    assert "INSTRUCTION: q.1\n" in joined
    assert '{"description":"Yes, shipped.","option_id":"true"}' in joined
    assert '{"description":"The proposition is false or the answer is no.","option_id":"false"}' in joined


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_media_tokens_follow_prefix_and_match_processor(tiny_engine):
    encoder = tiny_engine.encoder
    image = png_bytes(512, 320)
    record = encoder.encode(dict(REQUEST, images=[image, image]))
    assert record.media_offset == len(encoder.prefix_ids)
    media_ids = record.input_ids[record.media_offset: record.media_offset + record.token_counts["media"]]
    tokenizer = encoder.tokenizer
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    # 512×320 is already a multiple of 32 px and above the minimum area: (512/16)·(320/16)/4 = 160 tokens
    per_image = [start] + [image_pad] * 160 + [end]
    assert media_ids == per_image + per_image + encoder.tokenize("\n")
    assert record.media_inputs["image_grid_thw"].tolist() == [[1, 20, 32], [1, 20, 32]]
    # the state follows the media directly
    state_start = record.media_offset + record.token_counts["media"]
    assert record.input_ids[state_start: state_start + 3] == encoder.tokenize(render(REQUEST["state"]))[:3]


def test_video_frames_sampled_at_two_fps(tiny_engine):
    encoder = tiny_engine.encoder
    frames = np.random.default_rng(1).integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)  # 40 frames at 10 fps = 4 s
    record = encoder.encode(dict(REQUEST, videos=[{"frames": frames, "fps": 10.0}]))
    video = record.videos[0]
    assert video.frame_indices == [0, 6, 11, 17, 22, 28, 33, 39]  # 4 s × 2 fps = 8 frames, evenly spread
    assert record.media_inputs["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames / temporal patch 2
    assert encoder.tokenizer.convert_tokens_to_ids("<|video_pad|>") in record.input_ids
    assert "<0.3 seconds>" in encoder.tokenizer.decode(record.input_ids)  # the processor's frame timestamps


def test_overflow_refuse_names_part_and_amount(tiny_engine):
    long_state = "word " * 3000
    request = dict(REQUEST, state=long_state)
    full = tiny_engine.encoder.encode(request, max_length=100_000)
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encoder.encode(request, max_length=1000)
    assert caught.value.part == "state"
    assert caught.value.over_by == full.token_counts["total"] - 1000
    assert f"{caught.value.over_by} over max_length 1000" in str(caught.value)


def test_overflow_truncate_cuts_the_end_of_the_state(tiny_engine):
    encoder = tiny_engine.encoder
    request = dict(REQUEST, state="alpha beta gamma " * 500)
    full = encoder.encode(request, max_length=100_000)
    cut = encoder.encode(request, max_length=1000, overflow="truncate_state")
    assert len(cut.input_ids) == 1000
    assert cut.truncated_state_tokens == full.token_counts["total"] - 1000
    assert cut.token_counts["state"] == full.token_counts["state"] - cut.truncated_state_tokens
    kept = cut.token_counts["state"]
    start = len(encoder.prefix_ids)
    assert cut.input_ids[start: start + kept] == full.input_ids[start: start + kept]  # the beginning is kept
    assert cut.input_ids[start + kept:] == full.input_ids[start + full.token_counts["state"]:]  # schema intact


def test_schema_alone_over_budget_is_refused_even_with_truncation(tiny_engine):
    with pytest.raises(TokenBudgetError) as caught:
        tiny_engine.encoder.encode(REQUEST, max_length=50, overflow="truncate_state")
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
        encoder.tokenize_state(f"{i} " + "x" * encoding.STATE_MEMO_MIN_CHARS)
    assert len(encoder._states) == encoding.STATE_MEMO_ENTRIES
