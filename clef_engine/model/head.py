"""The joint schema head (spec §4), batched over records, questions and options.

Parameter names and shapes match the release's `joint_head.safetensors`, so the real file loads strictly. Spans are
pooled as padded gathers summed in float32, options and fields are padded per record, and each attention reads only
a record's real keys (flash attention's `seqused_k` on CUDA, an additive mask elsewhere): padding keys get exactly
zero weight, as in the per-record reference loop. A batch of one record needs no padding at all. The layers run as
small functions of the modules' parameters (`attend`, `route`, `decode`; the modules' own forwards serve the
reference loop): the same math in eval mode, with fewer kernels and less Python.

Precision: the GEMMs run in the weights' dtype (bf16 on a GPU); what lies between them (span means, the residual
streams, LayerNorms, the routing softmax, cosines, logits) stays in float32 where the release code rounds to bf16.
Those tensors have one row per option or question, so this costs a few small casts; the memory ([tokens, width])
stays in the weights' dtype. With float32 weights every cast is a no-op and the math is the release code's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.weak import WeakIdKeyDictionary

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

    def forward(self, options: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        memory = self.memory_norm(memory)
        attended, _ = self.attention(self.query_norm(options), memory, memory, need_weights=False)
        options = options + attended
        return options + self.feedforward(self.feedforward_norm(options))


@dataclass
class HeadBatch:
    """Where every question and option of a batch sits, as index tensors (built once on the CPU by `layout`).

    Hidden states come as one flat [rows, hidden] tensor. Every tensor here is a view into `buffer`, so `to` moves
    the whole batch in one host-to-device copy. Spans (question instructions, option texts) are [chunks, longest]
    grids of rows with a keep mask; where one span is far longer than the rest, spans are cut into chunks of about
    the mean length (`*_chunk`: the span of each chunk; None when every span is one chunk), so a grid never holds
    much more than twice the span tokens. Grid slots past the end point at row / index 0 and are masked.
    """

    buffer: torch.Tensor  # uint8: the bytes of every tensor below
    memory_start: int  # first row of the record's tokens, when there is one record
    memory_length: int
    record_rows: torch.Tensor | None  # [B, T] rows of record b's tokens; None for one record (no padding)
    memory_padding: torch.Tensor | None  # [B, T] bool, True = not a token of the record; None for one record
    last_rows: torch.Tensor  # [B] row of each record's last token
    question_rows: torch.Tensor  # [Cq, Lq] rows of question-span tokens
    question_keep: torch.Tensor  # [Cq, Lq] bool
    question_chunk: torch.Tensor | None  # [Cq] question of each chunk
    question_count: torch.Tensor  # [Q] tokens per question span
    question_record: torch.Tensor  # [Q]
    question_slot: torch.Tensor  # [Q] position among its record's questions
    question_type: torch.Tensor  # [Q]
    record_questions: torch.Tensor | None  # [B, Qmax] question of each slot; None for one record
    field_padding: torch.Tensor | None  # [B, Qmax] bool, True = no question there
    option_rows: torch.Tensor  # [Co, Lo] rows of option-span tokens
    option_token_ids: torch.Tensor  # [Co, Lo] their token ids, for the lexical (output-embedding) mean
    option_keep: torch.Tensor  # [Co, Lo] bool
    option_chunk: torch.Tensor | None  # [Co] option of each chunk
    option_count: torch.Tensor  # [O]
    option_question: torch.Tensor  # [O]
    option_record: torch.Tensor  # [O]
    option_record_slot: torch.Tensor  # [O] position among its record's options
    option_question_slot: torch.Tensor  # [O] position among its question's options
    record_options: torch.Tensor | None  # [B, Omax] option of each slot; None for one record
    question_options: torch.Tensor  # [Q, Kmax] option of each slot
    question_option_padding: torch.Tensor  # [Q, Kmax] bool, True = no option there

    def to(self, device: torch.device | str) -> HeadBatch:
        """The batch on `device` in one copy of `buffer` (staged in pinned memory for CUDA, so the copy does not
        block the host)."""
        device = torch.device(device)
        if self.buffer.device == device:
            return self
        source = self.buffer
        if device.type == "cuda" and not source.is_pinned():
            source = source.pin_memory()
        return self.with_buffer(source.to(device, non_blocking=True))

    def with_buffer(self, buffer: torch.Tensor) -> HeadBatch:
        """The same views (offset, shape, dtype) into another copy of `buffer`."""
        typed = {torch.int64: buffer.view(torch.int64), torch.bool: buffer.view(torch.bool)}
        views = {}
        for f in fields(self):
            view = getattr(self, f.name)
            if f.name != "buffer" and isinstance(view, torch.Tensor):
                views[f.name] = typed[view.dtype].as_strided(view.shape, view.stride(), view.storage_offset())
        return replace(self, buffer=buffer, **views)


def _pack(arrays: dict[str, np.ndarray | None]) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One uint8 buffer with every array's bytes, and a tensor view of each: int64 arrays first (so each starts
    8-byte aligned), then bool arrays; the length is rounded up to 8 bytes so the whole buffer views as int64."""
    present = {name: a for name, a in arrays.items() if a is not None}
    ints = [name for name, a in present.items() if a.dtype != np.bool_]  # stored as int64
    bools = [name for name, a in present.items() if a.dtype == np.bool_]
    int_bytes = 8 * sum(present[name].size for name in ints)
    bool_bytes = sum(present[name].size for name in bools)
    buffer = torch.empty(int_bytes + -(-bool_bytes // 8) * 8, dtype=torch.uint8)
    raw = buffer.numpy()
    if ints:
        np.concatenate([present[name].reshape(-1) for name in ints], out=raw[:int_bytes].view(np.int64))
    if bools:
        np.concatenate([present[name].reshape(-1) for name in bools], out=raw[int_bytes: int_bytes + bool_bytes])
    views: dict[str, torch.Tensor | None] = dict.fromkeys(arrays)
    for names, typed, start in ((ints, buffer.view(torch.int64), 0), (bools, buffer.view(torch.bool), int_bytes)):
        for name in names:
            shape = present[name].shape
            strides = (shape[1], 1) if len(shape) == 2 else (1,)
            views[name] = typed.as_strided(shape, strides, start)
            start += present[name].size
    return buffer, views


def _pairs(spans: Iterable[Iterable[int]]) -> np.ndarray:
    """(start, end) spans as an [n, 2] int64 array (fromiter over a flat chain: twice as fast as np.array)."""
    return np.fromiter(chain.from_iterable(spans), dtype=np.int64).reshape(-1, 2)


def _first_index(counts: np.ndarray) -> np.ndarray:
    """Index of each group's first item when groups of `counts` items lie one after another."""
    return np.cumsum(counts) - counts


def _grid(first: np.ndarray, counts: np.ndarray, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Groups of consecutive indices (first[i] .. first[i] + counts[i] - 1) as a [groups, width] grid and its keep
    mask; slots past a group's end hold index 0 (valid, and masked by the caller)."""
    width = int(counts.max(initial=0)) if width is None else width
    position = np.arange(width, dtype=np.int64)
    keep = position[None, :] < counts[:, None]
    return np.where(keep, first[:, None] + position, 0), keep


def _span_grid(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_grid` of token spans, cutting spans into chunks of the mean length when padding every span to the longest
    would more than double the tokens read; returns (rows, keep, span of each chunk or None)."""
    spans, total = len(counts), int(counts.sum())
    if spans * int(counts.max(initial=0)) <= 2 * total:
        rows, keep = _grid(first, counts)
        return rows, keep, None
    width = -(-total // spans)
    pieces = -(-counts // width)
    chunk_span = np.repeat(np.arange(spans, dtype=np.int64), pieces)
    skipped = (np.arange(len(chunk_span), dtype=np.int64) - _first_index(pieces)[chunk_span]) * width
    rows, keep = _grid(first[chunk_span] + skipped, np.minimum(counts[chunk_span] - skipped, width), width)
    return rows, keep, chunk_span


def layout(records: list, row_offsets: list[int], lengths: list[int]) -> HeadBatch:
    """Index tensors for `records` (EncodedRecord-like: input_ids, question_spans, option_spans, question_types)
    whose tokens start at flat row `row_offsets[b]`. Built with numpy from the spans: no Python work per token."""
    long = np.int64
    n_records = len(records)
    offsets = np.asarray(row_offsets, dtype=long)
    token_counts = np.asarray(lengths, dtype=long)
    questions_per_record = np.array([len(r.question_spans) for r in records], dtype=long)
    question_spans = _pairs(chain.from_iterable(r.question_spans for r in records))
    options_per_question = np.array([len(spans) for r in records for spans in r.option_spans], dtype=long)
    option_spans = _pairs(chain.from_iterable(chain.from_iterable(r.option_spans for r in records)))
    question_type = np.array([QUESTION_TYPE_INDEX[t] for r in records
                              for t in r.question_types[: len(r.question_spans)]], dtype=long)
    n_questions, n_options = len(question_spans), len(option_spans)

    question_record = np.repeat(np.arange(n_records, dtype=long), questions_per_record)
    question_first = _first_index(questions_per_record)  # first question of each record
    question_slot = np.arange(n_questions, dtype=long) - question_first[question_record]
    option_question = np.repeat(np.arange(n_questions, dtype=long), options_per_question)
    option_first = _first_index(options_per_question)  # first option of each question
    option_question_slot = np.arange(n_options, dtype=long) - option_first[option_question]
    option_record = question_record[option_question]
    options_per_record = np.bincount(option_record, minlength=n_records).astype(long)
    record_option_first = _first_index(options_per_record)
    option_record_slot = np.arange(n_options, dtype=long) - record_option_first[option_record]

    question_count = question_spans[:, 1] - question_spans[:, 0]
    question_rows, question_keep, question_chunk = _span_grid(
        question_spans[:, 0] + offsets[question_record], question_count)
    option_count = option_spans[:, 1] - option_spans[:, 0]
    option_rows, option_keep, option_chunk = _span_grid(option_spans[:, 0] + offsets[option_record], option_count)
    option_ids = np.zeros(option_rows.shape, dtype=long)
    option_ids[option_keep] = np.fromiter(  # kept slots in row-major order = the span tokens in order
        chain.from_iterable(r.input_ids[s:e] for r in records for spans in r.option_spans for s, e in spans),
        dtype=long, count=int(option_count.sum()))
    question_options, question_option_keep = _grid(option_first, options_per_question)

    arrays: dict[str, np.ndarray | None] = dict(
        record_rows=None, memory_padding=None, record_questions=None, field_padding=None, record_options=None,
        last_rows=offsets + token_counts - 1,
        question_rows=question_rows, question_keep=question_keep, question_chunk=question_chunk,
        question_count=question_count, question_record=question_record, question_slot=question_slot,
        question_type=question_type,
        option_rows=option_rows, option_token_ids=option_ids, option_keep=option_keep, option_chunk=option_chunk,
        option_count=option_count, option_question=option_question, option_record=option_record,
        option_record_slot=option_record_slot, option_question_slot=option_question_slot,
        question_options=question_options, question_option_padding=~question_option_keep,
    )
    if n_records > 1:  # records of different lengths and schemas: pad per record, mask the padding
        record_rows, memory_keep = _grid(offsets, token_counts)
        record_questions, field_keep = _grid(question_first, questions_per_record)
        record_options, _ = _grid(record_option_first, options_per_record)
        arrays.update(record_rows=record_rows, memory_padding=~memory_keep, record_questions=record_questions,
                      field_padding=~field_keep, record_options=record_options)
    buffer, views = _pack(arrays)
    return HeadBatch(buffer=buffer, memory_start=int(offsets[0]), memory_length=int(token_counts[0]), **views)


def segment_mean(source: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, count: torch.Tensor,
                 chunk: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of source[index] over each grid row's kept slots ([S, L] grid -> [S, D]); with `chunk`, grid rows are
    pieces of spans, added up per span. Sums in float32 so long spans do not lose precision in bf16; a gather and a
    reduction rather than an index_add, whose float atomics are slow on the GPU. Returned in float32."""
    sums = (source[index] * keep[..., None]).sum(1, dtype=torch.float32)
    if chunk is not None:
        sums = sums.new_zeros(count.shape[0], sums.shape[-1]).index_add_(0, chunk, sums)
    return sums / count[:, None]


def pooling_matrix(segment: torch.Tensor, spans: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows] segment ids -> [..., spans, rows] 0/1 matrix, 1 where row r adds to span s (-1: to no span). Built
    on the device from the segment ids, so only those travel from the host."""
    return (segment[..., None, :] == torch.arange(spans, device=segment.device)[:, None]).to(dtype)


@functools.cache
def _bmm_writes_float32(device: torch.device) -> bool:
    """Whether this torch has bmm's out_dtype (bf16 inputs, float32 output) on `device`; asked once, eagerly."""
    try:
        x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        return torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def pooled_sums(pooling: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pooling @ rows in float32 ([G, spans, rows] x [G, rows, D] -> [G, spans, D]): span sums as a batch of GEMMs
    instead of a padded gather, a mask and a reduction. On CUDA a bf16/fp16 GEMM accumulates in float32 and writes
    float32 (bmm's out_dtype), so nothing is rounded to bf16 on the way out; elsewhere (or on a torch without
    out_dtype) the plain float32 product."""
    if rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16) and _bmm_writes_float32(rows.device):
        return torch.bmm(pooling.to(rows.dtype), rows, out_dtype=torch.float32)
    return pooling.float() @ rows.float()


# ---- the layers as plain functions of the modules' parameters (eval mode: every dropout has p=0) --------------

_float32_copies = WeakIdKeyDictionary()  # parameter -> ((its version, its storage), its float32 copy)


def _float32(parameter: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a (bf16) parameter, made once and kept while the parameter lives unchanged: otherwise the
    head casts its LayerNorm and scoring parameters on every call, some forty small kernels. A parameter written in
    place (load_state_dict: a new version) or moved (`.to`: new storage) gets a new copy."""
    if parameter.dtype == torch.float32:
        return parameter
    if parameter.requires_grad and torch.is_grad_enabled():  # a copy would cut the gradient
        return parameter.float()
    state = (parameter._version, parameter.data_ptr())
    kept = _float32_copies.get(parameter)
    if kept is None or kept[0] != state:
        kept = (state, parameter.detach().float())
        _float32_copies[parameter] = kept
    return kept[1]


def _norm(norm: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """LayerNorm computed and returned in `dtype` (float32 unless said otherwise; bf16 weights are exact in it)."""
    if dtype == torch.float32:
        weight, bias = _float32(norm.weight), _float32(norm.bias)
    else:
        weight, bias = norm.weight.to(dtype), norm.bias.to(dtype)
    return F.layer_norm(x.to(dtype), norm.normalized_shape, weight, bias, norm.eps)


def _linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The GEMM in the weight's dtype: a float32 input is rounded to it once, here."""
    return F.linear(x.to(linear.weight.dtype), linear.weight, linear.bias)


# ---- the head's attention ----------------------------------------------------------------------------------------
# A few queries (options, fields) over keys padded after their end: per record in a batch, to a bucket in a head graph.
# On CUDA, flash attention told each row's real key count (`seqused_k`) needs no mask and no per-shape plan: cuDNN
# builds a plan for every new shape (43-73 ms on the H200), and the head meets a new shape with nearly every new
# schema or memory length; the memory-efficient kernel, which takes the mask, is 2.5-4x slower per call
# (bench/results/2026-12-01-h200-diagnose.json, `head_kernels`). The engine gives the head that kernel where the
# device runs it (fast/head_kernels.py); this module's default, and the exact path: SDPA with the additive mask.
NO_PLAN_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# q [B, Lq, H, d], k and v [B, T, H, d], each row's real key count [B] or None (all real) -> [B, Lq, H, d]
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def key_counts(padding: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] padding (True after each row's last key) -> [B] int32 real key counts; None: every key is real."""
    return None if padding is None else (~padding).sum(-1, dtype=torch.int32)


def attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, Lq, H, d] over k, v [B, T, H, d], keys past `counts[b]` masked out: SDPA with the additive
    mask (on CUDA, kernels that build no per-shape plan). Returns [B, Lq, H, d]."""
    mask = None
    if counts is not None:
        keys = k.shape[1]
        aligned = -(-keys // 16) * 16  # 16-aligned rows: the memory-efficient kernel takes the mask as is
        mask = torch.zeros(counts.shape[0], 1, 1, aligned, dtype=q.dtype, device=q.device)[..., :keys]
        padding = torch.arange(keys, device=q.device) >= counts[:, None]
        mask = mask.masked_fill_(padding[:, None, None, :], float("-inf"))
    backends = NO_PLAN_BACKENDS if q.is_cuda else None
    with sdpa_kernel(list(backends)) if backends is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def attend(attention: nn.MultiheadAttention, query: torch.Tensor, memory: torch.Tensor,
           counts: torch.Tensor | None, kernel: AttentionKernel) -> torch.Tensor:
    """nn.MultiheadAttention(query, memory, memory) with need_weights=False and a key-padding mask given as each
    row's real key count (`counts`, None: all real), the heads attended by `kernel`; `memory is query` is
    self-attention (one packed projection). Runs in the weights' dtype; returns it."""
    weight, bias, width = attention.in_proj_weight, attention.in_proj_bias, query.shape[-1]
    if memory is query:
        q, k, v = F.linear(query.to(weight.dtype), weight, bias).chunk(3, dim=-1)
    else:
        q = F.linear(query.to(weight.dtype), weight[:width], bias[:width])
        k, v = F.linear(memory.to(weight.dtype), weight[width:], bias[width:]).chunk(2, dim=-1)
    heads = attention.num_heads
    q, k, v = (x.unflatten(-1, (heads, width // heads)) for x in (q, k, v))
    out = kernel(q, k, v, counts)
    return _linear(attention.out_proj, out.flatten(-2))


def route(layer: EvidenceRoutingLayer, options: torch.Tensor, memory: torch.Tensor,
          memory_counts: torch.Tensor | None, kernel: AttentionKernel) -> torch.Tensor:
    """EvidenceRoutingLayer.forward: options read the normed memory, then the pre-norm feed-forward. `options` is
    the float32 residual stream; the memory's norm stays in the memory's dtype (a GEMM reads it next)."""
    options = options + attend(layer.attention, _norm(layer.query_norm, options),
                               _norm(layer.memory_norm, memory, memory.dtype), memory_counts, kernel)
    first, gelu, _, second = layer.feedforward
    return options + _linear(second, F.gelu(_linear(first, _norm(layer.feedforward_norm, options)),
                                            approximate=gelu.approximate))


def decode(layer: nn.TransformerDecoderLayer, fields: torch.Tensor, memory: torch.Tensor,
           field_counts: torch.Tensor | None, memory_counts: torch.Tensor | None,
           kernel: AttentionKernel) -> torch.Tensor:
    """nn.TransformerDecoderLayer.forward with norm_first=True: self-attention, cross-attention over the (un-normed)
    memory, feed-forward, each pre-norm and residual (`fields` is the float32 residual stream)."""
    normed = _norm(layer.norm1, fields)
    fields = fields + attend(layer.self_attn, normed, normed, field_counts, kernel)
    fields = fields + attend(layer.multihead_attn, _norm(layer.norm2, fields), memory, memory_counts, kernel)
    return fields + _linear(layer.linear2, layer.activation(_linear(layer.linear1, _norm(layer.norm3, fields))))


class JointSchemaHead(nn.Module):
    def __init__(self, config: HeadConfig, attention: AttentionKernel = attention_masked):
        """`attention`: the kernel of every attention in the batched forward; the engine gives a faster one where
        the device has it (fast/head_kernels.py)."""
        super().__init__()
        hidden, width = config.hidden_size, config.width
        self.config = config
        self.attention = attention
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
        return self.decide_from_memory(*self.token_memory(hidden), output_embeddings, batch)

    def decide_from_memory(self, normed: torch.Tensor, memory_flat: torch.Tensor, output_embeddings: torch.Tensor,
                           batch: HeadBatch) -> torch.Tensor:
        if batch.record_rows is None:  # one record: its memory is a slice and nothing needs padding
            start, end = batch.memory_start, batch.memory_start + batch.memory_length
            memory = memory_flat[start:end][None]  # [1, T, W]
            global_state = normed[end - 1: end]  # [1, D], broadcast over the record's questions and options
            memory_counts = None
        else:
            memory = memory_flat[batch.record_rows]  # [B, T, W]
            global_state = normed[batch.last_rows]  # [B, D]
            memory_counts = key_counts(batch.memory_padding)
        question = segment_mean(normed, batch.question_rows, batch.question_keep, batch.question_count,
                                batch.question_chunk)
        context = segment_mean(normed, batch.option_rows, batch.option_keep, batch.option_count, batch.option_chunk)
        lexical = segment_mean(output_embeddings, batch.option_token_ids, batch.option_keep, batch.option_count,
                               batch.option_chunk)
        return self.decide_from_means(question, context, lexical, global_state, memory, memory_counts, batch)

    def decide_from_means(self, question: torch.Tensor, context: torch.Tensor, lexical: torch.Tensor,
                          global_state: torch.Tensor, memory: torch.Tensor, memory_counts: torch.Tensor | None,
                          batch: HeadBatch) -> torch.Tensor:
        """Steps 3-6 of spec §4 from the span means (float32, [Q, D] / [O, D] / [O, D]), the records' last normed
        states ([B, D]) and their memory ([B, T, W], `memory_counts` each row's real tokens or None: all). A batch
        without `record_options` holds one record: its options and fields are one sequence each, unpadded, and
        `field_padding` (if given) masks padding fields."""
        width = self.config.width
        one = batch.record_options is None
        queries = (_linear(self.option_context_projection, context).float()
                   + _linear(self.option_lexical_projection, lexical)
                   + _linear(self.option_question_projection, question)[batch.option_question])  # float32 stream
        routed = queries[None] if one else queries[batch.record_options]  # [B, Omax, W]
        for layer in self.evidence_layers:
            routed = route(layer, routed, memory, memory_counts, self.attention)
        routed = routed[0] if one else routed[batch.option_record, batch.option_record_slot]  # [O, W]

        # Each question's options, summed with softmax weights of their affinity to the question (padded slots: 0).
        field_base = _linear(self.question_projection, question).float()  # [Q, W]
        options = routed[batch.question_options]  # [Q, Kmax, W]
        affinity = torch.bmm(options, field_base[:, :, None])[..., 0] / math.sqrt(width)
        affinity = affinity.masked_fill_(batch.question_option_padding, float("-inf"))
        routing_weights = torch.softmax(affinity, dim=-1)
        summary = torch.bmm(routing_weights[:, None, :], options)[:, 0]  # [Q, W]
        global_fields = _linear(self.global_projection, global_state)
        fields = (field_base + _norm(self.option_summary_norm, summary)
                  + (global_fields if one else global_fields[batch.question_record])
                  + F.embedding(batch.question_type, self.type_embedding.weight))  # float32 stream

        fields = fields[None] if one else fields[batch.record_questions]  # [B, Qmax, W]
        field_counts = key_counts(batch.field_padding)
        for layer in self.layers:
            fields = decode(layer, fields, memory, field_counts, memory_counts, self.attention)
        fields = _norm(self.field_norm, fields)
        fields = fields[0] if one else fields[batch.question_record, batch.question_slot]  # [Q, W]

        field_of_option = fields[batch.option_question]
        option_vectors = _norm(self.option_norm, routed)
        record_state = global_state if one else global_state[batch.option_record]
        prior = _float32(self.prior_logit_scale).clamp(max=LOGIT_SCALE_CAP).exp() * F.cosine_similarity(
            lexical, question[batch.option_question] + record_state.float(), dim=-1
        )
        pair = torch.cat([field_of_option, option_vectors, field_of_option * option_vectors,
                          (field_of_option - option_vectors).abs()], dim=-1)
        first, gelu, _, second = self.residual_scorer
        hidden = F.gelu(_linear(first, pair), approximate=gelu.approximate)
        # the last layer is one dot product per option: in float32, like the logit it adds to
        residual = F.linear(hidden.float(), _float32(second.weight), _float32(second.bias))
        joint = (_float32(self.joint_logit_scale).clamp(max=LOGIT_SCALE_CAP).exp()
                 * F.cosine_similarity(field_of_option, option_vectors, dim=-1) + residual[:, 0])
        return prior + torch.sigmoid(_float32(self.residual_gate)) * joint


def option_probabilities(logits: torch.Tensor, batch: HeadBatch) -> torch.Tensor:
    """Softmax over each question's options (no temperature), flat like the logits; computed in float32."""
    padded = logits.float()[batch.question_options].masked_fill_(batch.question_option_padding, float("-inf"))
    return torch.softmax(padded, dim=-1)[batch.option_question, batch.option_question_slot]


def load_head(config: HeadConfig, state: dict[str, torch.Tensor], device: torch.device,
              dtype: torch.dtype) -> JointSchemaHead:
    """Build the head and load the release's weights strictly (a name or shape mismatch is an error)."""
    head = JointSchemaHead(config)
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
