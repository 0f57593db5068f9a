"""The batched joint head against the plain per-record, per-option computation of spec §4."""

from __future__ import annotations

import random
import re

import pytest
import torch

from clef_engine.model.encoding import EncodedRecord
from clef_engine.model.head import JointSchemaHead, layout, option_probabilities
from clef_engine.model.reference import reference_decide, reference_logits
from clef_engine.model.release import HeadConfig
from clef_engine.protocol import Question
from tests.support.bodies import REQUEST

SPEC_NAMES = """
prior_logit_scale ()  joint_logit_scale ()  residual_gate ()
hidden_norm.weight (5120)  hidden_norm.bias (5120)
memory_projection.weight (1024,5120)  question_projection.weight (1024,5120)
option_question_projection.weight (1024,5120)  global_projection.weight (1024,5120)
option_context_projection.weight (1024,5120)  option_lexical_projection.weight (1024,5120)
type_embedding.weight (3,1024)
"""


def spec_state_dict_shapes(routing_layers: int = 2, layers: int = 4) -> dict[str, tuple[int, ...]]:
    """The names and shapes the spec lists for Clef (hidden 5120, width 1024, ff 4096)."""
    shapes = {name: tuple(int(d) for d in dims.split(",") if d)
              for name, dims in re.findall(r"(\S+) \(([\d,]*)\)", SPEC_NAMES)}
    w, ff = 1024, 4096
    for i in range(routing_layers):
        p = f"evidence_layers.{i}."
        for norm in ("query_norm", "memory_norm", "feedforward_norm"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (w,)
        shapes[p + "attention.in_proj_weight"] = (3 * w, w)
        shapes[p + "attention.in_proj_bias"] = (3 * w,)
        shapes[p + "attention.out_proj.weight"] = (w, w)
        shapes[p + "attention.out_proj.bias"] = (w,)
        shapes[p + "feedforward.0.weight"], shapes[p + "feedforward.0.bias"] = (ff, w), (ff,)
        shapes[p + "feedforward.3.weight"], shapes[p + "feedforward.3.bias"] = (w, ff), (w,)
    shapes["option_summary_norm.weight"] = shapes["option_summary_norm.bias"] = (w,)
    for i in range(layers):
        p = f"layers.{i}."
        for attention in ("self_attn", "multihead_attn"):
            shapes[p + attention + ".in_proj_weight"] = (3 * w, w)
            shapes[p + attention + ".in_proj_bias"] = (3 * w,)
            shapes[p + attention + ".out_proj.weight"] = (w, w)
            shapes[p + attention + ".out_proj.bias"] = (w,)
        shapes[p + "linear1.weight"], shapes[p + "linear1.bias"] = (ff, w), (ff,)
        shapes[p + "linear2.weight"], shapes[p + "linear2.bias"] = (w, ff), (w,)
        for norm in ("norm1", "norm2", "norm3"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (w,)
    for norm in ("field_norm", "option_norm"):
        shapes[norm + ".weight"] = shapes[norm + ".bias"] = (w,)
    shapes["residual_scorer.0.weight"], shapes["residual_scorer.0.bias"] = (w, 4 * w), (w,)
    shapes["residual_scorer.3.weight"], shapes["residual_scorer.3.bias"] = (1, w), (1,)
    return shapes


def test_state_dict_names_and_shapes_match_the_release():
    with torch.device("meta"):
        head = JointSchemaHead(HeadConfig(hidden_size=5120))
    ours = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    assert ours == spec_state_dict_shapes()


@pytest.mark.parametrize(("hidden", "parameters"), [(5120, 128_056_324), (4096, 121_762_820)])
def test_parameter_count_matches_published_head_sizes(hidden, parameters):
    with torch.device("meta"):
        head = JointSchemaHead(HeadConfig(hidden_size=hidden))
    assert sum(p.numel() for p in head.parameters()) == parameters


def test_strict_load_rejects_a_foreign_state_dict(tiny_engine):
    state = tiny_engine.runner.head.state_dict()
    state.pop("residual_gate")
    with pytest.raises(RuntimeError, match="residual_gate"):
        JointSchemaHead(tiny_engine.runner.head.config).load_state_dict(state, strict=True)


def random_record(rng: random.Random, n_questions: int, max_options: int, vocab: int) -> EncodedRecord:
    """A record with random token ids and non-overlapping spans laid out like the real encoding."""
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(5, 40))]  # prefix + state
    questions, question_spans, option_spans = [], [], []
    for j in range(n_questions):
        kind = rng.choice(["noul", "choice", "score"])
        n_options = 2 if kind == "noul" else rng.randint(2, max_options if kind == "choice" else 10)
        ids += [rng.randrange(vocab) for _ in range(3)]
        start = len(ids)
        ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        question_spans.append((start, len(ids)))
        spans = []
        for _ in range(n_options):
            ids.append(rng.randrange(vocab))
            start = len(ids)
            ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            spans.append((start, len(ids)))
        option_spans.append(spans)
        option_ids = tuple(str(k) for k in range(n_options))
        questions.append(Question(f"q{j}", kind, "", option_ids, (None,) * n_options, option_ids))
    ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]  # suffix
    return EncodedRecord(ids, questions, question_spans, option_spans, {"total": len(ids)})


def batched_vs_reference(head, embeddings, records, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(len(r), head.config.hidden_size, generator=generator) for r in records]
    flat = torch.cat(hidden)
    offsets = [0]
    for r in records[:-1]:
        offsets.append(offsets[-1] + len(r))
    batch = layout(records, offsets, [len(r) for r in records])
    with torch.inference_mode():
        batched = head(flat, embeddings, batch)
    worst, cursor = 0.0, 0
    for record, h in zip(records, hidden):
        for logits in reference_logits(head, h, embeddings, record):
            worst = max(worst, (batched[cursor: cursor + len(logits)] - logits).abs().max().item())
            cursor += len(logits)
    assert cursor == batched.shape[0]
    return worst


@pytest.mark.parametrize("seed", range(6))
def test_batched_head_equals_per_option_oracle(tiny_engine, seed):
    rng = random.Random(seed)
    head, embeddings = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    records = [random_record(rng, rng.randint(1, 12), rng.choice([3, 10, 40]), embeddings.shape[0])
               for _ in range(rng.randint(1, 5))]
    assert batched_vs_reference(head, embeddings, records, seed) <= 1e-5


@pytest.mark.slow  # 64 questions and 255 options through the reference head: the quick tier's slowest
def test_batched_head_at_the_published_limits(tiny_engine):
    """64 questions, choice questions up to 255 options, in a batch with a one-question record."""
    rng = random.Random(7)
    head, embeddings = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    big = random_record(rng, 64, 255, embeddings.shape[0])
    wide = random_record(rng, 1, 2, embeddings.shape[0])
    wide_spans, cursor = [], len(wide.input_ids)
    for _ in range(255):
        wide.input_ids += [rng.randrange(embeddings.shape[0]) for _ in range(2)]
        wide_spans.append((cursor, cursor + 2))
        cursor += 2
    wide.option_spans = [wide_spans]
    ids = tuple(str(k) for k in range(255))
    wide.questions = [Question("wide", "choice", "", ids, (None,) * 255, ids)]
    assert batched_vs_reference(head, embeddings, [big, wide], 7) <= 1e-5


def test_probabilities_are_a_softmax_per_question(tiny_engine):
    rng = random.Random(3)
    records = [random_record(rng, 5, 6, tiny_engine.runner.output_embeddings.shape[0]) for _ in range(3)]
    offsets = [0, len(records[0]), len(records[0]) + len(records[1])]
    batch = layout(records, offsets, [len(r) for r in records])
    hidden = torch.randn(sum(len(r) for r in records), tiny_engine.runner.head.config.hidden_size)
    with torch.inference_mode():
        logits = tiny_engine.runner.head(hidden, tiny_engine.runner.output_embeddings, batch)
        probabilities = option_probabilities(logits, batch)
    sums = torch.zeros(batch.question_count.shape[0]).index_add_(0, batch.option_question, probabilities)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
    assert (probabilities > 0).all()


def test_engine_answers_equal_the_reference_path(tiny_engine):
    """Whole path with real encoding: backbone + batched head vs backbone + per-option loop head."""

    requests = [REQUEST, dict(REQUEST, state="a much shorter state"), dict(REQUEST, state=["x"] * 50)]
    records = [tiny_engine.encode(r) for r in requests]
    ours = tiny_engine.runner.forward_padded(records)
    reference = reference_decide(tiny_engine.runner, records)
    worst = max(abs(a - b) for ro, rr in zip(ours, reference) for qo, qr in zip(ro, rr) for a, b in zip(qo, qr))
    assert worst <= 1e-5


# ---- the batched head's fast paths --------------------------------------------------------------------------------

def test_every_dropout_is_a_no_op(tiny_engine):
    """The batched forward skips dropout and calls the layers' parameters directly: exact only while every dropout
    has p=0 and the decoder layers are pre-norm with exact GELU."""
    for module in tiny_engine.runner.head.modules():
        if isinstance(module, torch.nn.Dropout):
            assert module.p == 0.0
        if isinstance(module, torch.nn.MultiheadAttention):
            assert module.dropout == 0.0 and module.batch_first and module._qkv_same_embed_dim
        if isinstance(module, torch.nn.TransformerDecoderLayer):
            assert module.norm_first and module.activation is torch.nn.functional.gelu


def test_one_record_has_no_padding_and_equals_the_oracle(tiny_engine):
    rng = random.Random(11)
    head, embeddings = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    record = random_record(rng, 64, 10, embeddings.shape[0])
    batch = layout([record], [0], [len(record)])
    assert batch.record_rows is None and batch.memory_padding is None and batch.record_options is None
    assert batch_vs_reference_one(head, embeddings, record, offset=0) <= 1e-5
    assert batch_vs_reference_one(head, embeddings, record, offset=5) <= 1e-5  # a record inside a larger pack


def batch_vs_reference_one(head, embeddings, record, offset: int) -> float:
    generator = torch.Generator().manual_seed(offset)
    flat = torch.randn(offset + len(record) + 3, head.config.hidden_size, generator=generator)
    with torch.inference_mode():
        batched = head(flat, embeddings, layout([record], [offset], [len(record)]))
        reference = torch.cat(reference_logits(head, flat[offset: offset + len(record)], embeddings, record))
    return (batched - reference).abs().max().item()


def test_mixed_batch_with_padding_equals_the_oracle(tiny_engine):
    """Records of different lengths, question and option counts: memory, options and fields all padded."""
    rng = random.Random(12)
    head, embeddings = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    records = [random_record(rng, n, 10, embeddings.shape[0]) for n in (1, 9, 3)]
    records[1].input_ids += [0] * 100  # the longest by far
    offsets = [0, len(records[0]), len(records[0]) + len(records[1])]
    batch = layout(records, offsets, [len(r) for r in records])
    assert batch.memory_padding.any() and batch.field_padding.any() and batch.question_option_padding.any()
    assert batched_vs_reference(head, embeddings, records, 12) <= 1e-5


def test_a_very_long_option_is_pooled_in_chunks(tiny_engine):
    """One span far longer than the others is cut into chunks (the grid stays ~2x the tokens) and gives the same
    answers."""
    rng = random.Random(13)
    head, embeddings = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    record = random_record(rng, 4, 10, embeddings.shape[0])
    start = len(record.input_ids)
    record.input_ids += [rng.randrange(embeddings.shape[0]) for _ in range(300)]
    record.option_spans[2][1] = (start, start + 300)
    batch = layout([record], [0], [len(record)])
    assert batch.option_chunk is not None
    assert batch.option_rows.numel() <= 2 * int(batch.option_count.sum()) + batch.option_rows.shape[1]
    assert batch_vs_reference_one(head, embeddings, record, offset=0) <= 1e-5
    assert batched_vs_reference(head, embeddings, [record, random_record(rng, 2, 3, embeddings.shape[0])], 13) <= 1e-5


def test_head_batch_moves_in_one_copy(monkeypatch):
    rng = random.Random(14)
    records = [random_record(rng, 5, 6, 100), random_record(rng, 2, 3, 100)]
    batch = layout(records, [0, len(records[0])], [len(r) for r in records])
    tensors = {name: t for name, t in vars(batch).items() if isinstance(t, torch.Tensor) and name != "buffer"}
    assert len(tensors) > 20
    storage = batch.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors.values())  # all views of one buffer

    copy = batch.with_buffer(batch.buffer.clone())  # what `to` does after its one copy
    for name, t in tensors.items():
        moved = getattr(copy, name)
        assert moved.untyped_storage().data_ptr() == copy.buffer.untyped_storage().data_ptr()
        assert moved.dtype == t.dtype and torch.equal(moved, t), name

    copies = []
    original_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: copies.append(t.shape) or original_to(t, *a, **k))
    on_meta = batch.to(torch.device("meta"))
    assert copies == [batch.buffer.shape]
    assert all(getattr(on_meta, name).device.type == "meta" for name in tensors)
    assert batch.to(torch.device("cpu")) is batch  # already there: no copy


def slow_layout(records, offsets: list[int]) -> dict[str, list]:
    """The batch's indices built the plain way, one token at a time."""
    out = {k: [] for k in ("question_rows", "question_record", "question_slot", "question_type", "option_rows",
                           "option_ids", "option_question", "option_record", "option_record_slot",
                           "option_question_slot")}
    for b, record in enumerate(records):
        slot = 0
        for j, ((start, end), spans) in enumerate(zip(record.question_spans, record.option_spans)):
            q = len(out["question_record"])
            out["question_rows"].append([offsets[b] + i for i in range(start, end)])
            out["question_record"].append(b)
            out["question_slot"].append(j)
            out["question_type"].append({"noul": 0, "choice": 1, "score": 2}[record.questions[j].type])
            for k, (o_start, o_end) in enumerate(spans):
                out["option_rows"].append([offsets[b] + i for i in range(o_start, o_end)])
                out["option_ids"].append(record.input_ids[o_start:o_end])
                out["option_question"].append(q)
                out["option_record"].append(b)
                out["option_record_slot"].append(slot)
                out["option_question_slot"].append(k)
                slot += 1
    return out


def spans_of(grid: torch.Tensor, keep: torch.Tensor, chunk: torch.Tensor | None, count: int) -> list[list[int]]:
    """The kept grid entries of each span, chunks joined in order."""
    owner = range(grid.shape[0]) if chunk is None else chunk.tolist()
    spans = [[] for _ in range(count)]
    for row, span in enumerate(owner):
        spans[span] += grid[row][keep[row]].tolist()
    return spans


def clef_request(questions: int, options: int) -> dict:
    return {"state": "the invoice total is due " * 50, "questions": {
        f"q{j}": {"type": "choice", "instructions": f"Which vendor {j} applies to the order?",
                  "criteria": {f"v{k}": f"vendor {k}" for k in range(options)}}
        for j in range(questions)}}


@pytest.mark.parametrize("extra", [False, True])
def test_layout_indices_equal_a_slow_construction(tiny_engine, extra):
    """64 questions x 10 options of a real encoding (alone, then padded in a batch with a small record)."""
    records = [tiny_engine.encode(clef_request(64, 10), max_length=2**31 - 1)]
    if extra:
        records.append(tiny_engine.encode(clef_request(2, 3), max_length=2**31 - 1))
    offsets = [3, 3 + len(records[0]) + 7][: len(records)]
    batch = layout(records, offsets, [len(r) for r in records])
    slow = slow_layout(records, offsets)
    n_questions, n_options = len(slow["question_record"]), len(slow["option_question"])
    questions = (batch.question_keep, batch.question_chunk, n_questions)
    options = (batch.option_keep, batch.option_chunk, n_options)
    assert spans_of(batch.question_rows, *questions) == slow["question_rows"]
    assert spans_of(batch.option_rows, *options) == slow["option_rows"]
    assert spans_of(batch.option_token_ids, *options) == slow["option_ids"]
    assert batch.question_count.tolist() == [len(r) for r in slow["question_rows"]]
    assert batch.option_count.tolist() == [len(r) for r in slow["option_rows"]]
    for name in ("question_record", "question_slot", "question_type", "option_question", "option_record",
                 "option_record_slot", "option_question_slot"):
        assert getattr(batch, name).tolist() == slow[name], name
    assert batch.last_rows.tolist() == [o + len(r) - 1 for o, r in zip(offsets, records)]
    options_of = [[o for o in range(n_options) if slow["option_question"][o] == q] for q in range(n_questions)]
    assert spans_of(batch.question_options, ~batch.question_option_padding, None, n_questions) == options_of
    if not extra:
        assert batch.record_rows is None and (batch.memory_start, batch.memory_length) == (3, len(records[0]))
        return
    rows = [list(range(o, o + len(r))) for o, r in zip(offsets, records)]
    assert spans_of(batch.record_rows, ~batch.memory_padding, None, 2) == rows
    questions_of = [[q for q in range(n_questions) if slow["question_record"][q] == b] for b in range(2)]
    assert spans_of(batch.record_questions, ~batch.field_padding, None, 2) == questions_of
    options_of_record = [[o for o in range(n_options) if slow["option_record"][o] == b] for b in range(2)]
    assert batch.record_options[0].tolist() == options_of_record[0]
    assert batch.record_options[1][: len(options_of_record[1])].tolist() == options_of_record[1]


def test_bf16_head_keeps_float32_between_its_gemms_and_is_closer_to_float32_than_the_release_loop(tiny_engine):
    """bf16 weights, bf16 hidden states: the batched head's logits come out in float32 and, on 64 questions × up to
    10 options, sit on average well under the release code's bf16 loop's distance from the float32 head (rounding
    the span means, residual streams, cosines and logits to bf16 as the release does gives about the same distance
    as the loop)."""
    import copy

    rng = random.Random(5)
    head32, embeddings32 = tiny_engine.runner.head, tiny_engine.runner.output_embeddings
    head16, embeddings16 = copy.deepcopy(head32).to(torch.bfloat16), embeddings32.to(torch.bfloat16)
    record = random_record(rng, 64, 10, embeddings32.shape[0])
    hidden = torch.randn(len(record), head32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    batch = layout([record], [0], [len(record)])
    with torch.inference_mode():
        truth = head32(hidden.float(), embeddings32, batch)
        ours = head16(hidden, embeddings16, batch)
        release = torch.cat(reference_logits(head16, hidden, embeddings16, record)).float()
    assert ours.dtype == torch.float32
    ours_distance = (ours - truth).abs().mean().item()
    release_distance = (release - truth).abs().mean().item()
    assert ours_distance <= 0.5 * release_distance, (ours_distance, release_distance)


def test_a_bf16_head_reloaded_in_place_answers_with_its_new_weights(tiny_engine):
    """The head keeps float32 copies of its bf16 LayerNorm and scoring parameters between calls; weights loaded in
    place afterwards must be the ones it answers with, exactly as a head built from them."""
    import copy

    rng = random.Random(9)
    embeddings = tiny_engine.runner.output_embeddings.to(torch.bfloat16)
    record = random_record(rng, 4, 5, embeddings.shape[0])
    hidden = torch.randn(len(record), tiny_engine.runner.head.config.hidden_size,
                         generator=torch.Generator().manual_seed(9))
    hidden = hidden.to(torch.bfloat16)
    batch = layout([record], [0], [len(record)])
    head = copy.deepcopy(tiny_engine.runner.head).to(torch.bfloat16)
    other = {name: value + 0.05 if "norm" in name or "scorer.3" in name or "scale" in name else value
             for name, value in head.state_dict().items()}
    fresh = JointSchemaHead(head.config).to(torch.bfloat16).eval()
    fresh.load_state_dict(other)
    with torch.inference_mode():
        before = head(hidden, embeddings, batch)
    head.load_state_dict(other)
    with torch.inference_mode():
        after, want = head(hidden, embeddings, batch), fresh(hidden, embeddings, batch)
    assert not torch.equal(before, want)
    assert torch.equal(after, want)
