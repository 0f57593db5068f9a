"""The plain computation of spec §4, one record, one question, one option at a time.

This is how the release's reference code computes the head (Python loops, no batching). The engine never uses it to
answer; tests use it as the oracle for the batched head, and the benchmark uses it as the baseline.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .encoding import EncodedRecord
from .head import LOGIT_SCALE_CAP, QUESTION_TYPE_INDEX, JointSchemaHead


@torch.inference_mode()
def reference_logits(head: JointSchemaHead, hidden: torch.Tensor, output_embeddings: torch.Tensor,
                     record: EncodedRecord) -> list[torch.Tensor]:
    """Logits per question for one record; `hidden` is [T, D] for the record's real tokens only."""
    width = head.config.width
    normed = head.hidden_norm(hidden)
    memory = head.memory_projection(normed)[None]  # [1, T, W]
    global_state = normed[-1]
    ids = record.input_ids

    questions, contexts, lexicals = [], [], []
    queries: list[torch.Tensor] = []
    for (q_start, q_end), spans in zip(record.question_spans, record.option_spans):
        question = normed[q_start:q_end].mean(0)
        questions.append(question)
        context = [normed[s:e].mean(0) for s, e in spans]
        lexical = [output_embeddings[torch.tensor(ids[s:e], device=hidden.device)].mean(0).to(hidden.dtype)
                   for s, e in spans]
        contexts.append(context)
        lexicals.append(lexical)
        queries.extend(head.option_context_projection(c) + head.option_lexical_projection(lex)
                       + head.option_question_projection(question) for c, lex in zip(context, lexical))

    routed = torch.stack(queries)[None]  # all options of the record as one sequence
    for layer in head.evidence_layers:
        routed = layer(routed, memory)
    routed = routed[0]

    fields, option_rows, cursor = [], [], 0
    for j, question in enumerate(questions):
        count = len(record.option_spans[j])
        options = routed[cursor: cursor + count]
        option_rows.append(options)
        cursor += count
        base = head.question_projection(question)
        weights = torch.softmax(torch.stack([o @ base for o in options]) / math.sqrt(width), dim=0)
        summary = sum(w * o for w, o in zip(weights, options))
        type_index = torch.tensor(QUESTION_TYPE_INDEX[record.question_types[j]], device=hidden.device)
        fields.append(base + head.option_summary_norm(summary) + head.global_projection(global_state)
                      + head.type_embedding(type_index))

    field_sequence = torch.stack(fields)[None]
    for layer in head.layers:
        field_sequence = layer(field_sequence, memory)
    field_sequence = head.field_norm(field_sequence[0])

    prior_scale = head.prior_logit_scale.clamp(max=LOGIT_SCALE_CAP).exp()
    joint_scale = head.joint_logit_scale.clamp(max=LOGIT_SCALE_CAP).exp()
    gate = torch.sigmoid(head.residual_gate)
    logits = []
    for j, question in enumerate(questions):
        field = field_sequence[j]
        per_option = []
        for k in range(len(record.option_spans[j])):
            option = head.option_norm(option_rows[j][k])
            prior = prior_scale * F.cosine_similarity(lexicals[j][k], question + global_state, dim=0)
            pair = torch.cat([field, option, field * option, (field - option).abs()])
            joint = joint_scale * F.cosine_similarity(field, option, dim=0) + head.residual_scorer(pair)[0]
            per_option.append(prior + gate * joint)
        logits.append(torch.stack(per_option))
    return logits


@torch.inference_mode()
def reference_decide(runner: Any, records: list[EncodedRecord]) -> list[list[list[float]]]:
    """The release code's path end to end on a model runner's weights: padded backbone batch, then the per-record
    loop head."""
    from .backbone import run_padded

    hidden = run_padded(runner.model, records, runner.pad_token_id)
    out = []
    for b, record in enumerate(records):
        logits = reference_logits(runner.head, hidden[b, : len(record)].to(runner.dtype), runner.output_embeddings,
                                  record)
        out.append([torch.softmax(q.float(), dim=0).tolist() for q in logits])
    return out
