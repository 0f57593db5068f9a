"""The batched joint head against the plain per-record, per-option computation of spec §4."""

from __future__ import annotations

import random
import re

import pytest
import torch

from clef_engine.encoding import EncodedRecord
from clef_engine.head import JointSchemaHead, layout, option_probabilities
from clef_engine.protocol import Question
from clef_engine.reference import reference_decide, reference_logits
from clef_engine.release import HeadConfig

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
    state = tiny_engine.head.state_dict()
    state.pop("residual_gate")
    with pytest.raises(RuntimeError, match="residual_gate"):
        JointSchemaHead(tiny_engine.head.config).load_state_dict(state, strict=True)


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
    head, embeddings = tiny_engine.head, tiny_engine.output_embeddings
    records = [random_record(rng, rng.randint(1, 12), rng.choice([3, 10, 40]), embeddings.shape[0])
               for _ in range(rng.randint(1, 5))]
    assert batched_vs_reference(head, embeddings, records, seed) <= 1e-5


def test_batched_head_at_the_published_limits(tiny_engine):
    """64 questions, choice questions up to 255 options, in a batch with a one-question record."""
    rng = random.Random(7)
    head, embeddings = tiny_engine.head, tiny_engine.output_embeddings
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
    records = [random_record(rng, 5, 6, tiny_engine.output_embeddings.shape[0]) for _ in range(3)]
    offsets = [0, len(records[0]), len(records[0]) + len(records[1])]
    batch = layout(records, offsets, [len(r) for r in records])
    hidden = torch.randn(sum(len(r) for r in records), tiny_engine.head.config.hidden_size)
    with torch.inference_mode():
        probabilities = option_probabilities(tiny_engine.head(hidden, tiny_engine.output_embeddings, batch), batch)
    sums = torch.zeros(batch.question_count.shape[0]).index_add_(0, batch.option_question, probabilities)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
    assert (probabilities > 0).all()


def test_engine_answers_equal_the_reference_path(tiny_engine):
    """Whole path with real encoding: backbone + batched head vs backbone + per-option loop head."""
    from tests.test_encoding import REQUEST

    requests = [REQUEST, dict(REQUEST, state="a much shorter state"), dict(REQUEST, state=["x"] * 50)]
    records = [tiny_engine.encode(r) for r in requests]
    ours = tiny_engine.forward_padded(records)
    reference = reference_decide(tiny_engine, records)
    worst = max(abs(a - b) for ro, rr in zip(ours, reference) for qo, qr in zip(ro, rr) for a, b in zip(qo, qr))
    assert worst <= 1e-5
