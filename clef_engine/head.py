"""The joint schema head (spec §4), batched over records, questions and options.

Parameter names and shapes match the release's `joint_head.safetensors`, so the real file loads strictly. The
forward pass takes a whole batch at once: spans are pooled with one gather + index_add, options and fields are
padded per record and attended with key-padding masks. Masked keys get exactly zero weight, so each record sees
only its own memory and its own options, as in the per-record reference loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .release import HeadConfig

QUESTION_TYPE_INDEX = {"noul": 0, "choice": 1, "score": 2}
LOGIT_SCALE_CAP = math.log(100.0)


class EvidenceRoutingLayer(nn.Module):
    """Options read the record's token memory: pre-norm cross-attention, then a pre-norm GELU feed-forward."""

    def __init__(self, width: int, heads: int, feedforward: int):
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward), nn.GELU(), nn.Dropout(0.0), nn.Linear(feedforward, width)
        )

    def forward(self, options: torch.Tensor, memory: torch.Tensor, memory_padding: torch.Tensor | None) -> torch.Tensor:
        memory = self.memory_norm(memory)
        attended, _ = self.attention(
            self.query_norm(options), memory, memory, key_padding_mask=memory_padding, need_weights=False
        )
        options = options + attended
        return options + self.feedforward(self.feedforward_norm(options))


@dataclass
class HeadBatch:
    """Where every question and option of a batch sits, as index tensors (built once on the CPU by `layout`).

    Hidden states come as one flat [rows, hidden] tensor; `record_rows[b]` lists the rows of record b's tokens
    (padded with row 0 where the record is shorter than the longest; `memory_padding` marks those).
    """

    record_rows: torch.Tensor  # [B, T] long
    memory_padding: torch.Tensor  # [B, T] bool, True = not a token of the record
    last_rows: torch.Tensor  # [B] row of each record's last token
    question_rows: torch.Tensor  # [Kq] rows of all question-span tokens
    question_segment: torch.Tensor  # [Kq] question index of each
    question_count: torch.Tensor  # [Q] tokens per question span
    question_record: torch.Tensor  # [Q]
    question_slot: torch.Tensor  # [Q] position among its record's questions
    question_type: torch.Tensor  # [Q]
    option_rows: torch.Tensor  # [Ko]
    option_token_ids: torch.Tensor  # [Ko] token ids, for the lexical (output-embedding) mean
    option_segment: torch.Tensor  # [Ko] option index of each
    option_count: torch.Tensor  # [O]
    option_question: torch.Tensor  # [O]
    option_record: torch.Tensor  # [O]
    option_record_slot: torch.Tensor  # [O] position among its record's options
    option_question_slot: torch.Tensor  # [O] position among its question's options
    max_options_per_record: int
    max_options_per_question: int
    max_questions_per_record: int

    def to(self, device: torch.device) -> HeadBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return HeadBatch(**moved)


def layout(records: list, row_offsets: list[int], lengths: list[int], max_length: int | None = None) -> HeadBatch:
    """Index tensors for `records` (EncodedRecord-like: input_ids, question_spans, option_spans, question_types)
    whose tokens start at flat row `row_offsets[b]`."""
    max_tokens = max_length or max(lengths)
    positions = torch.arange(max_tokens)
    lengths_t = torch.tensor(lengths)
    record_rows = torch.tensor(row_offsets)[:, None] + positions.clamp(max=max_tokens - 1)[None, :]
    memory_padding = positions[None, :] >= lengths_t[:, None]
    record_rows = torch.where(memory_padding, torch.zeros_like(record_rows), record_rows)

    q_rows, q_seg, q_count, q_record, q_slot, q_type = [], [], [], [], [], []
    o_rows, o_ids, o_seg, o_count, o_question, o_record, o_rslot, o_qslot = [], [], [], [], [], [], [], []
    max_options_per_record = max_options_per_question = max_questions_per_record = 1
    for b, record in enumerate(records):
        offset = row_offsets[b]
        record_options = 0
        for j, ((q_start, q_end), spans) in enumerate(zip(record.question_spans, record.option_spans)):
            q = len(q_count)
            q_rows.extend(range(offset + q_start, offset + q_end))
            q_seg.extend([q] * (q_end - q_start))
            q_count.append(q_end - q_start)
            q_record.append(b)
            q_slot.append(j)
            q_type.append(QUESTION_TYPE_INDEX[record.question_types[j]])
            for k, (o_start, o_end) in enumerate(spans):
                o = len(o_count)
                o_rows.extend(range(offset + o_start, offset + o_end))
                o_ids.extend(record.input_ids[o_start:o_end])
                o_seg.extend([o] * (o_end - o_start))
                o_count.append(o_end - o_start)
                o_question.append(q)
                o_record.append(b)
                o_rslot.append(record_options)
                o_qslot.append(k)
                record_options += 1
            max_options_per_question = max(max_options_per_question, len(spans))
        max_options_per_record = max(max_options_per_record, record_options)
        max_questions_per_record = max(max_questions_per_record, len(record.question_spans))

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    return HeadBatch(
        record_rows=record_rows,
        memory_padding=memory_padding,
        last_rows=long([row_offsets[b] + lengths[b] - 1 for b in range(len(records))]),
        question_rows=long(q_rows), question_segment=long(q_seg), question_count=long(q_count),
        question_record=long(q_record), question_slot=long(q_slot), question_type=long(q_type),
        option_rows=long(o_rows), option_token_ids=long(o_ids), option_segment=long(o_seg),
        option_count=long(o_count), option_question=long(o_question), option_record=long(o_record),
        option_record_slot=long(o_rslot), option_question_slot=long(o_qslot),
        max_options_per_record=max_options_per_record,
        max_options_per_question=max_options_per_question,
        max_questions_per_record=max_questions_per_record,
    )


def segment_mean(source: torch.Tensor, rows: torch.Tensor, segment: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of source[rows] per segment; sums in float32 so long spans do not lose precision in bf16."""
    sums = torch.zeros(count.shape[0], source.shape[-1], dtype=torch.float32, device=source.device)
    sums.index_add_(0, segment, source[rows].float())
    return (sums / count[:, None].float()).to(source.dtype)


def pad_segments(values: torch.Tensor, group: torch.Tensor, slot: torch.Tensor, groups: int, slots: int):
    """Scatter rows [n, w] into a padded [groups, slots, w] tensor; returns it and a [groups, slots] padding mask."""
    padded = values.new_zeros(groups, slots, values.shape[-1])
    padded[group, slot] = values
    padding = torch.ones(groups, slots, dtype=torch.bool, device=values.device)
    padding[group, slot] = False
    return padded, padding


class JointSchemaHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        hidden, width = config.hidden_size, config.width
        self.config = config
        self.prior_logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.joint_logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.residual_gate = nn.Parameter(torch.tensor(0.0))
        self.hidden_norm = nn.LayerNorm(hidden)
        self.memory_projection = nn.Linear(hidden, width, bias=False)
        self.question_projection = nn.Linear(hidden, width, bias=False)
        self.option_question_projection = nn.Linear(hidden, width, bias=False)
        self.global_projection = nn.Linear(hidden, width, bias=False)
        self.option_context_projection = nn.Linear(hidden, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden, width, bias=False)
        self.type_embedding = nn.Embedding(3, width)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(width, config.heads, config.feedforward) for _ in range(config.routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(width, config.heads, config.feedforward, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(config.layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width), nn.GELU(), nn.Dropout(0.0), nn.Linear(width, 1)
        )

    def token_memory(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (normalized hidden, memory) — what the head needs from the backbone, and what a state cache
        keeps for a prefix."""
        normed = self.hidden_norm(hidden)
        return normed, self.memory_projection(normed)

    def forward(self, hidden: torch.Tensor, output_embeddings: torch.Tensor, batch: HeadBatch) -> torch.Tensor:
        """Logits of every option of every question of every record, flat in batch order ([O])."""
        normed, memory_flat = self.token_memory(hidden)
        return self.decide_from_memory(normed, memory_flat, output_embeddings, batch)

    def decide_from_memory(self, normed: torch.Tensor, memory_flat: torch.Tensor, output_embeddings: torch.Tensor,
                           batch: HeadBatch) -> torch.Tensor:
        width = self.config.width
        n_records = batch.record_rows.shape[0]
        n_questions = batch.question_count.shape[0]
        memory = memory_flat[batch.record_rows]  # [B, T, W]
        memory_padding = batch.memory_padding
        global_state = normed[batch.last_rows]  # [B, D]

        question = segment_mean(normed, batch.question_rows, batch.question_segment, batch.question_count)
        context = segment_mean(normed, batch.option_rows, batch.option_segment, batch.option_count)
        lexical = segment_mean(output_embeddings, batch.option_token_ids, batch.option_segment, batch.option_count)
        lexical = lexical.to(normed.dtype)

        queries = (self.option_context_projection(context) + self.option_lexical_projection(lexical)
                   + self.option_question_projection(question)[batch.option_question])
        routed, _ = pad_segments(queries, batch.option_record, batch.option_record_slot, n_records,
                                 batch.max_options_per_record)
        for layer in self.evidence_layers:
            routed = layer(routed, memory, memory_padding)
        routed = routed[batch.option_record, batch.option_record_slot]  # [O, W]

        field_base = self.question_projection(question)  # [Q, W]
        affinity = (routed * field_base[batch.option_question]).sum(-1) / math.sqrt(width)
        affinity_padded = affinity.new_full((n_questions, batch.max_options_per_question), float("-inf"))
        affinity_padded[batch.option_question, batch.option_question_slot] = affinity
        routing_weights = torch.softmax(affinity_padded.float(), dim=-1).to(routed.dtype)
        options_padded, _ = pad_segments(routed, batch.option_question, batch.option_question_slot, n_questions,
                                         batch.max_options_per_question)
        summary = torch.bmm(routing_weights[:, None, :], options_padded)[:, 0]  # [Q, W]
        fields = (field_base + self.option_summary_norm(summary)
                  + self.global_projection(global_state)[batch.question_record]
                  + self.type_embedding(batch.question_type))

        fields_padded, field_padding = pad_segments(fields, batch.question_record, batch.question_slot, n_records,
                                                    batch.max_questions_per_record)
        for layer in self.layers:
            fields_padded = layer(fields_padded, memory, tgt_key_padding_mask=field_padding,
                                  memory_key_padding_mask=memory_padding)
        fields = self.field_norm(fields_padded)[batch.question_record, batch.question_slot]

        field_of_option = fields[batch.option_question]
        option_vectors = self.option_norm(routed)
        prior = self.prior_logit_scale.clamp(max=LOGIT_SCALE_CAP).exp() * F.cosine_similarity(
            lexical, question[batch.option_question] + global_state[batch.option_record], dim=-1
        )
        pair = torch.cat([field_of_option, option_vectors, field_of_option * option_vectors,
                          (field_of_option - option_vectors).abs()], dim=-1)
        joint = (self.joint_logit_scale.clamp(max=LOGIT_SCALE_CAP).exp()
                 * F.cosine_similarity(field_of_option, option_vectors, dim=-1)
                 + self.residual_scorer(pair).squeeze(-1))
        return prior + torch.sigmoid(self.residual_gate) * joint


def option_probabilities(logits: torch.Tensor, batch: HeadBatch) -> torch.Tensor:
    """Softmax over each question's options (no temperature), flat like the logits; computed in float32."""
    n_questions = batch.question_count.shape[0]
    padded = logits.new_full((n_questions, batch.max_options_per_question), float("-inf"), dtype=torch.float32)
    padded[batch.option_question, batch.option_question_slot] = logits.float()
    return torch.softmax(padded, dim=-1)[batch.option_question, batch.option_question_slot]


def load_head(config: HeadConfig, state: dict[str, torch.Tensor], device: torch.device,
              dtype: torch.dtype) -> JointSchemaHead:
    """Build the head and load the release's weights strictly (a name or shape mismatch is an error)."""
    head = JointSchemaHead(config)
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
