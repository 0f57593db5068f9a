"""The head's fast attention kernels on CUDA, beside the exact kernel in model/head.py (`attention_masked`): flash
attention told each row's real key count (`seqused_k`), and the keys split into pieces merged by log-sum-exp where
few queries over many keys would leave the GPU idle. Each is checked once per device against `attention_masked` and
used only where it agrees with it; the engine gives the head the one `head_attention_kernel` picks."""

from __future__ import annotations

import functools

import torch

from ..model.head import attention_masked


def attention_flash_counts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           counts: torch.Tensor | None) -> torch.Tensor:
    """The same with flash attention (CUDA, bf16/fp16): the rows as varlen sequences of equal padded length, each
    reading only its first `counts[b]` keys."""
    batch, queries, heads, dim = q.shape
    keys = k.shape[1]
    step = {"dtype": torch.int32, "device": q.device}
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(batch * queries, heads, dim), k.reshape(batch * keys, heads, dim),
        v.reshape(batch * keys, heads, dim), torch.arange(0, (batch + 1) * queries, queries, **step),
        torch.arange(0, (batch + 1) * keys, keys, **step), queries, keys, 0.0, False, False, seqused_k=counts)[0]
    return out.view(batch, queries, heads, dim)


# Few queries over many keys leave most of the GPU idle: flash attention runs one block per (row, head, 128 queries),
# so a head call of 65 fields over a 14k-token memory keeps 16 blocks busy on 132 SMs. Splitting the keys into pieces
# that run as blocks of their own and merging the pieces by their log-sum-exp (flash-decoding) fills the GPU.
SPLIT_MIN_KEYS = 4096  # below this the whole call takes a few microseconds: the merge would cost more than it saves
SPLIT_MIN_PIECE = 512  # keys per piece at least
SPLIT_MAX = 16


def key_splits(batch: int, queries: int, heads: int, keys: int, blocks_at_once: int) -> int:
    """Into how many pieces to split the keys: none for a call that fills more than an eighth of what the GPU runs at
    once (`blocks_at_once`; the options' 650 queries: the merge, which grows with the queries, costs what the split
    saves), else the largest power of two (up to SPLIT_MAX) that keeps the call's blocks within `blocks_at_once` and
    each piece at least SPLIT_MIN_PIECE keys (bench/results/2026-12-01-h200-diagnose.json, `head_split`)."""
    blocks = batch * heads * -(-queries // 128)
    if keys < SPLIT_MIN_KEYS or blocks * 8 > blocks_at_once:
        return 1
    splits = 1
    while (splits * 2 <= SPLIT_MAX and blocks * splits * 2 <= blocks_at_once
           and keys // (splits * 2) >= SPLIT_MIN_PIECE):
        splits *= 2
    return splits


@functools.cache
def blocks_at_once(device: torch.device) -> int:
    """Attention blocks the GPU runs at once, taken as two per SM (what `key_splits`' limits were measured with)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def partial_attention_flash(q, k, v, cu_q, cu_k, max_q, max_k, used_k):
    """Flash varlen over sequences (`cu_q`, `cu_k`), each reading its first `used_k` keys: (out [Nq, H, d],
    log-sum-exp [H, Nq] in float32). A sequence with no keys gives zeros and an infinite log-sum-exp."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                   seqused_k=used_k)[:2]  # then rng state and debug outputs


def attention_split_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor | None,
                         splits: int, partial=partial_attention_flash) -> torch.Tensor:
    """`attention_flash_counts` with each row's keys cut into `splits` pieces of equal padded length, every piece
    attended by `partial` as a sequence of its own (the queries repeated), and the pieces merged with weights
    softmax(log-sum-exp) over the pieces. Pieces past a row's real keys read nothing and get weight 0."""
    batch, queries, heads, dim = q.shape
    keys = k.shape[1]
    piece = -(-keys // splits)
    step = {"dtype": torch.int32, "device": q.device}
    starts = torch.clamp(torch.arange(0, splits * piece, piece, **step), max=keys)  # [S] first key of each piece
    ends = torch.clamp(starts + piece, max=keys)
    real = torch.full((batch,), keys, **step) if counts is None else counts.to(torch.int32)
    used = torch.clamp(torch.minimum(real[:, None], ends) - starts, min=0)  # [B, S] real keys per piece
    cu_k = torch.cat([(torch.arange(batch, **step)[:, None] * keys + starts).reshape(-1),
                      starts.new_full((1,), batch * keys)])
    cu_q = torch.arange(0, (batch * splits + 1) * queries, queries, **step)
    q_pieces = q[:, None].expand(batch, splits, queries, heads, dim).reshape(-1, heads, dim)
    out, lse = partial(q_pieces, k.reshape(-1, heads, dim), v.reshape(-1, heads, dim), cu_q, cu_k, queries, piece,
                       used.reshape(-1))
    lse = lse.view(heads, batch, splits, queries).permute(1, 2, 3, 0)  # [B, S, Lq, H]
    lse = lse.masked_fill(used[:, :, None, None] == 0, float("-inf"))
    weight = torch.softmax(lse, dim=1)
    out = out.view(batch, splits, queries, heads, dim).float() * weight[..., None]
    return out.sum(1).to(q.dtype)


def attention_flash_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          counts: torch.Tensor | None) -> torch.Tensor:
    """`attention_flash_counts`, the keys split where few queries would leave the GPU idle (`key_splits`)."""
    splits = key_splits(q.shape[0], q.shape[1], q.shape[2], k.shape[1], blocks_at_once(q.device))
    if splits == 1:
        return attention_flash_counts(q, k, v, counts)
    return attention_split_keys(q, k, v, counts, splits)


@functools.cache
def _flash_splits_keys(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attention_split_keys` on flash runs here and agrees with `attention_masked` (pieces past the real
    keys included); checked once per device."""
    generator = torch.Generator(device=device).manual_seed(12)
    q = torch.randn(2, 5, 4, 64, device=device, dtype=dtype, generator=generator)
    k, v = (torch.randn(2, 4096, 4, 64, device=device, dtype=dtype, generator=generator) for _ in range(2))
    counts = torch.tensor([4096, 1500], device=device, dtype=torch.int32)
    return _agrees_with_masked(lambda *a: attention_split_keys(*a, 8), q, k, v, (counts, None))


def _agrees_with_masked(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts_to_try) -> bool:
    """Whether `attention(q, k, v, counts)` runs and answers as `attention_masked` for every counts to try."""
    try:
        difference = max((attention(q, k, v, c) - attention_masked(q, k, v, c)).abs().max().item()
                         for c in counts_to_try)
    except (RuntimeError, TypeError):  # no flash kernel here, or a torch without seqused_k
        return False
    return difference < 2e-2


@functools.cache
def _flash_takes_counts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attention_flash_counts` runs here and agrees with `attention_masked`; checked once per device."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    generator = torch.Generator(device=device).manual_seed(11)
    q, k, v = (torch.randn(2, n, 4, 64, device=device, dtype=dtype, generator=generator) for n in (5, 37, 37))
    counts = torch.tensor([37, 20], device=device, dtype=torch.int32)
    return _agrees_with_masked(attention_flash_counts, q, k, v, (counts,))


FLASH_HEAD_DIMS = range(8, 257, 8)  # the head dimensions flash attention takes (multiples of 8, up to 256)


def head_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The kernel for the head's attention on `device` in `dtype` with heads of `head_dim` (a small head, such as the
    demo release's, has heads flash attention does not take: the exact kernel runs it)."""
    if head_dim not in FLASH_HEAD_DIMS or not _flash_takes_counts(device, dtype):
        return attention_masked
    return attention_flash_split if _flash_splits_keys(device, dtype) else attention_flash_counts
