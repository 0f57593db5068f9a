"""The packed backbone's full attention kernels, block-diagonal causal over a pack's records: per-record SDPA (the
plain PyTorch functions), torch's flash varlen attention, cuDNN's for one long record (padded to a multiple of
CUDNN_LENGTH_STEP tokens so its per-length plans are shared) and for a long record's chunk after the chunks before it,
and the checks `select_kernels` (kernels.py) runs before it uses any of them."""

from __future__ import annotations

import functools
import inspect
import itertools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .segments import Segments, make_segments

# ---- full attention (block-diagonal causal) -------------------------------------------------------------------------

def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hk, D]: one causal SDPA call per record; KV heads repeated like transformers' repeat_kv."""
    repeat = q.shape[1] // k.shape[1]
    outputs = []
    for start, length in zip(segments.starts, segments.lengths):
        q_r, k_r, v_r = (x[start: start + length].transpose(0, 1)[None] for x in (q, k, v))
        if repeat > 1:
            k_r, v_r = k_r.repeat_interleave(repeat, dim=1), v_r.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _varlen_function() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(k, v, kwargs) for torch's varlen_attn, whose keyword names changed across torch releases. K/V heads are
    passed as they are where the kernel takes fewer K/V heads than query heads (`_varlen_takes_grouped_heads`):
    repeating them writes six times the K/V, which after a long cached prefix costs more than the attention."""
    parameters = _varlen_parameters()
    kwargs: dict = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        elif not _varlen_takes_grouped_heads(q.device, q.dtype):
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return k.contiguous(), v.contiguous(), kwargs


def _grouped_heads_match(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_dim: int) -> bool:
    """Whether `attend(q, k, v)`, given fewer K/V heads than query heads (dim `heads_dim`), answers what it answers
    on the K/V heads repeated; False if it refuses the shapes."""
    try:
        repeat = q.shape[heads_dim] // k.shape[heads_dim]
        grouped = attend(q, k, v)
        repeated = attend(q, k.repeat_interleave(repeat, dim=heads_dim).contiguous(),
                          v.repeat_interleave(repeat, dim=heads_dim).contiguous())
        return _difference(grouped, repeated) <= 1e-2
    except Exception:  # noqa: BLE001 — refused: repeat the heads
        return False


@functools.cache
def _varlen_takes_grouped_heads(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether varlen_attn takes K/V with fewer heads than the queries (flash attention groups query heads natively;
    older torch builds refused the shapes). Checked once per device."""
    if _varlen_function() is None:
        return False
    generator = torch.Generator(device=device).manual_seed(3)
    lengths = [45, 83]
    q, k, v = (torch.randn(sum(lengths), heads, 64, device=device, dtype=dtype, generator=generator)
               for heads in (6, 2, 2))
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    kwargs: dict = {"is_causal": True} if "is_causal" in _varlen_parameters() else {"window_size": (-1, 0)}
    return _grouped_heads_match(
        lambda q, k, v: _varlen_function()(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs), q, k, v, 1)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    """varlen_attn's keyword names, read once (it is called in every attention layer of every forward)."""
    return frozenset(inspect.signature(_varlen_function()).parameters)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """torch's flash varlen attention over the whole pack (causal within each record)."""
    k, v, kwargs = _varlen_arguments(q, k, v)
    cu = segments.cu_seqlens_int32
    return _varlen_function()(q.contiguous(), k, v, cu, cu, segments.max_length, segments.max_length, **kwargs)


def attention_after_prefix(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix: int) -> torch.Tensor:
    """One record continuing after `prefix` cached tokens: q [n, Hq, D], k/v [prefix + n, Hk, D]. Query heads are
    folded onto their KV head (no KV copy) and an explicit mask keeps it causal (key j visible to query t iff
    j <= prefix + t)."""
    n, heads, dim = q.shape
    kv_heads = k_all.shape[1]
    repeat = heads // kv_heads
    grouped = q.view(n, kv_heads, repeat, dim).permute(1, 2, 0, 3).reshape(kv_heads, repeat * n, dim)
    keys = torch.arange(k_all.shape[0], device=q.device)
    allowed = keys[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None]  # [n, P+n]
    allowed = allowed.repeat(repeat, 1)
    out = F.scaled_dot_product_attention(grouped[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
                                         attn_mask=allowed[None, None])
    return out[0].view(kv_heads, repeat, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def attention_after_prefix_varlen(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                                  prefix: int) -> torch.Tensor:
    """The same with flash varlen: with fewer queries than keys its causal mask is aligned to the last key (query t
    sees keys <= prefix + t); `select_kernels` checks that against the masked SDPA before using it."""
    n, total = q.shape[0], k_all.shape[0]
    k_all, v_all, kwargs = _varlen_arguments(q, k_all, v_all)
    cu_q, cu_k = _boundaries(n, total, q.device)
    return _varlen_function()(q.contiguous(), k_all, v_all, cu_q, cu_k, n, total, **kwargs)


def attention_after_prefixes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[torch.Tensor],
                             values: list[torch.Tensor], segments: Segments) -> torch.Tensor:
    """Records that each continue after cached keys/values [P_r, Hk, D] (its state's; a sweep's variants share
    one): q [N, Hq, D] and k/v [N, Hk, D] are the pack's own; each record through `attention_after_prefix`."""
    return torch.cat([attention_after_prefix(q[start: start + n], torch.cat([cached_k, k[start: start + n]]),
                                             torch.cat([cached_v, v[start: start + n]]), cached_k.shape[0])
                      for cached_k, cached_v, start, n in zip(keys, values, segments.starts, segments.lengths)])


PREFIX_COPY_ROWS = 1 << 17  # K/V rows one call of the packed version below copies the cached keys into


def attention_after_prefixes_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[torch.Tensor],
                                    values: list[torch.Tensor], segments: Segments) -> torch.Tensor:
    """The same in one flash varlen call per group of records: each record's keys are its cached ones then its own
    (copied together, a group's copies within PREFIX_COPY_ROWS rows), and the causal mask, aligned to each record's
    last key as in `attention_after_prefix_varlen`, lets its query t see the cached keys and its own up to t. One
    record at a time, a sweep's twenty variants spent more time launching than computing."""
    outputs, group, rows = [], [], 0

    def attend(group: list) -> torch.Tensor:
        first, last = group[0][2], group[-1][2] + group[-1][3]
        k_all = torch.cat([part for cached_k, _, start, n in group for part in (cached_k, k[start: start + n])])
        v_all = torch.cat([part for _, cached_v, start, n in group for part in (cached_v, v[start: start + n])])
        k_all, v_all, kwargs = _varlen_arguments(q[first:last], k_all, v_all)
        queries = [n for *_, n in group]
        keys_per = [cached_k.shape[0] + n for cached_k, _, _, n in group]
        cu_q, cu_k = (torch.tensor(list(itertools.accumulate(counts, initial=0)), dtype=torch.int32).to(
            q.device, non_blocking=True) for counts in (queries, keys_per))
        return _varlen_function()(q[first:last].contiguous(), k_all, v_all, cu_q, cu_k, max(queries),
                                  max(keys_per), **kwargs)

    for record in zip(keys, values, segments.starts, segments.lengths):
        size = record[0].shape[0] + record[3]
        if group and rows + size > PREFIX_COPY_ROWS:
            outputs.append(attend(group))
            group, rows = [], 0
        group.append(record)
        rows += size
    outputs.append(attend(group))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


@functools.lru_cache(maxsize=64)
def _boundaries(queries: int, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[0, queries] and [0, keys] on the device, made once: a CUDA graph cannot capture their host-to-device copy."""
    return (torch.tensor([0, queries], dtype=torch.int32).to(device),
            torch.tensor([0, keys], dtype=torch.int32).to(device))


LONG_RECORD_TOKENS = 4097  # above the CUDA-graph limit: attention is a large share of a long record's time
# cuDNN builds an execution plan for every new sequence length (~50 ms on the H200), and records arrive at every
# length: one long record's attention runs padded to a multiple of this, so nearby lengths share one plan, and
# `warm_long_attention` and `warm_chunk_attention` build the plans of the usual lengths while the engine warms up.
# Zero keys after the last real token change nothing before it (causal).
CUDNN_LENGTH_STEP = 256


def cudnn_length(n: int) -> int:
    """The padded length one record of `n` tokens runs cuDNN attention at."""
    return -(-n // CUDNN_LENGTH_STEP) * CUDNN_LENGTH_STEP


def _padded_heads_first(x: torch.Tensor, rows: int, offset: int, times: int) -> torch.Tensor:
    """x [m, H, D] at rows [offset, offset + m) of zeros [rows, H * times, D], as [1, H * times, rows, D]: one copy
    that pads (and repeats heads if asked)."""
    out = x.new_zeros(rows, x.shape[1], times, x.shape[2])
    out[offset: offset + x.shape[0]] = x[:, :, None, :]
    return out.view(rows, -1, x.shape[2]).transpose(0, 1)[None]


def attention_varlen_cudnn_long(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Flash varlen, except one long record: cuDNN's fused attention (Hopper wgmma kernels) at `cudnn_length`,
    K/V heads grouped natively where cuDNN takes them so, else repeated. Chosen by `select_kernels` only where it
    agreed with the varlen result and was faster on this GPU."""
    if segments.count != 1 or segments.total < LONG_RECORD_TOKENS:
        return attention_varlen(q, k, v, segments)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, padded = q.shape[0], cudnn_length(q.shape[0])
    grouped = _cudnn_takes_grouped_heads(q.device, q.dtype)
    repeat = 1 if grouped else q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(_padded_heads_first(q, padded, 0, 1),
                                             _padded_heads_first(k, padded, 0, repeat),
                                             _padded_heads_first(v, padded, 0, repeat), is_causal=True,
                                             enable_gqa=repeat == 1 and q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)[:n]


def attention_with_lse_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention on [1, H, L, D] tensors: (out [1, H, Lq, D], log-sum-exp [1, H, Lq] in float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    return out, lse.reshape(q.shape[:3]).float()


def attention_chunk_cudnn(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix: int,
                          attend=attention_with_lse_cudnn, grouped: bool | None = None) -> torch.Tensor:
    """A chunk of a long record after `prefix` earlier tokens on cuDNN's fused attention, which has no causal mask
    aligned to the last key: the chunk's queries attend (1) to the earlier keys up to the last multiple of
    CUDNN_LENGTH_STEP before the chunk, with no mask, and (2) causally to the rest (the few earlier keys after that
    multiple, then their own chunk), the queries shifted down by those few rows so that a top-left causal mask
    lets each see every earlier key and its own chunk's up to itself; the two merged by their log-sum-exp. Both
    calls' lengths are multiples of CUDNN_LENGTH_STEP, so nearby lengths share cuDNN's plans.
    q [n, Hq, D], k_all/v_all [prefix + n, Hk, D]."""
    n, heads = q.shape[:2]
    base = prefix - prefix % CUDNN_LENGTH_STEP
    lead = prefix - base
    rows = cudnn_length(lead + n)
    if grouped is None:
        grouped = _cudnn_takes_grouped_heads(q.device, q.dtype)
    repeat = 1 if grouped else heads // k_all.shape[1]
    queries = _padded_heads_first(q, rows, lead, 1)
    out, lse = attend(queries, _padded_heads_first(k_all[base:], rows, 0, repeat),
                      _padded_heads_first(v_all[base:], rows, 0, repeat), True)
    if base:
        earlier_k, earlier_v = (x[:base].transpose(0, 1)[None] for x in (k_all, v_all))
        if repeat > 1:
            earlier_k, earlier_v = (x.repeat_interleave(repeat, dim=1) for x in (earlier_k, earlier_v))
        out_earlier, lse_earlier = attend(queries, earlier_k, earlier_v, False)
        weight = torch.sigmoid(lse_earlier - lse)[..., None]  # the earlier keys' share of the softmax mass
        out = (out.float() + (out_earlier.float() - out.float()) * weight).to(q.dtype)
    return out[0].transpose(0, 1)[lead: lead + n]


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference between two answers: what the start-up checks compare with a tolerance."""
    return (got.float() - want.float()).abs().max().item()


def _ms_per_call(fn, device: torch.device, *args, repeats: int = 3) -> float:
    """Mean wall milliseconds of `fn(*args)` on the GPU, after one untimed call: how the start-up checks choose
    between two kernels that agree."""
    fn(*args)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats * 1000


def chunk_attention_cudnn_pays(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                               chunk: int = 8192) -> str | None:
    """None if `attention_chunk_cudnn` answers as the masked SDPA (after a prefix at and off a multiple of the
    step) and runs faster than flash varlen on a chunk after two chunks; else why not."""
    try:
        generator = torch.Generator(device=device).manual_seed(7)

        def rand(n: int, h: int) -> torch.Tensor:
            return torch.randn(n, h, dim, device=device, dtype=dtype, generator=generator)

        for prefix, n in ((700, 300), (512, 256), (100, 37)):
            q, k, v = rand(n, heads), rand(prefix + n, kv_heads), rand(prefix + n, kv_heads)
            error = _difference(attention_chunk_cudnn(q, k, v, prefix), attention_after_prefix(q, k, v, prefix))
            if not error <= 2e-2:
                return f"cuDNN chunk attention differs from the masked SDPA by {error:.3g} (prefix {prefix})"
        q, k, v = rand(chunk, heads), rand(3 * chunk, kv_heads), rand(3 * chunk, kv_heads)
        timings = [_ms_per_call(fn, device, q, k, v, 2 * chunk)
                   for fn in (attention_after_prefix_varlen, attention_chunk_cudnn)]
        if timings[1] >= timings[0]:
            return f"cuDNN chunk attention not faster ({timings[1]:.2f} vs {timings[0]:.2f} ms)"
    except Exception as error:  # noqa: BLE001 — any failure means: keep flash varlen
        return f"cuDNN chunk attention unavailable: {type(error).__name__}: {error}"[:300]
    return None


@functools.cache
def _cudnn_takes_grouped_heads(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN SDPA with enable_gqa computes what it computes on repeated K/V. Checked once per device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device=device).manual_seed(4)
    q, k, v = (torch.randn(1, heads, 256, 64, device=device, dtype=dtype, generator=generator) for heads in (6, 2, 2))

    def attend(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return _grouped_heads_match(attend, q, k, v, 1)


def warm_long_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                        max_tokens: int) -> int:
    """Build cuDNN's plan for every padded length of one long record up to `max_tokens` (so that no request pays
    for one); returns how many lengths were run. Longest first, then the cache emptied: in ascending order every
    call's buffers would outgrow the blocks cached before it, and the caching allocator would keep them all (45 GB
    reserved after one warm-up on the H200: the user paths' run 3 in bench/README.md's run history)."""
    lengths = range(cudnn_length(max_tokens), cudnn_length(LONG_RECORD_TOKENS) - 1, -CUDNN_LENGTH_STEP)
    if not lengths:
        return 0
    generator = torch.Generator(device=device).manual_seed(5)
    q = torch.randn(lengths[0], heads, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(lengths[0], kv_heads, dim, device=device, dtype=dtype, generator=generator)
    for n in lengths:
        attention_varlen_cudnn_long(q[:n], k[:n], k[:n], make_segments([n], device))
    torch.cuda.synchronize(device)
    del q, k
    torch.cuda.empty_cache()
    return len(lengths)


def warm_chunk_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                         chunk: int, tokens: int) -> None:
    """Build cuDNN's plans of `attention_chunk_cudnn` for a record's second chunk of `tokens` tokens (after a first
    of `chunk`). A record a little over one chunk ends in a short chunk whose padded length is new to the process,
    and its two plans then cost a first user more than the chunk's whole forward (the Clef-Flash 16k user path,
    docs/performance.md)."""
    generator = torch.Generator(device=device).manual_seed(5)
    q = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(chunk + tokens, kv_heads, dim, device=device, dtype=dtype, generator=generator)
    attention_chunk_cudnn(q, k, k, chunk)
    torch.cuda.synchronize(device)


def cudnn_long_attention_pays(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                              dim: int, tokens: int = 8192) -> str | None:
    """None if cuDNN attention on one long record matches flash varlen and is faster here; else why not."""
    try:
        generator = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(tokens, h, dim, device=device, dtype=dtype, generator=generator)
                   for h in (heads, kv_heads, kv_heads))
        segments = make_segments([tokens], device)
        want = attention_varlen(q, k, v, segments)
        error = _difference(attention_varlen_cudnn_long(q, k, v, segments), want)
        if not error <= 2e-2:
            return f"cuDNN attention differs from flash varlen by {error:.3g}"
        timings = [_ms_per_call(fn, device, q, k, v, segments)
                   for fn in (attention_varlen, attention_varlen_cudnn_long)]
        if timings[1] >= timings[0]:
            return f"cuDNN attention not faster at {tokens} tokens ({timings[1]:.2f} vs {timings[0]:.2f} ms)"
    except Exception as error:  # noqa: BLE001 — any failure means: keep flash varlen
        return f"cuDNN attention unavailable: {type(error).__name__}: {error}"[:300]
    return None


def varlen_matches_sdpa(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> str | None:
    """Run torch's varlen attention against per-record SDPA on random data; None if it agrees, else why not."""
    if _varlen_function() is None:
        return "torch.nn.attention.varlen is not available"
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        lengths = [70, 130, 1]
        n = sum(lengths)
        q, k, v = (torch.randn(n, h, dim, device=device, dtype=dtype, generator=generator)
                   for h in (heads, kv_heads, kv_heads))
        segments = make_segments(lengths, device)
        error = _difference(attention_varlen(q, k, v, segments), attention_sdpa(q, k, v, segments))
        if not error <= 2e-2:
            return f"varlen attention differs from SDPA by {error:.3g}"
        single = make_segments([130], device)
        error = _difference(attention_varlen(q[:130], k[:130], v[:130], single),
                            attention_sdpa(q[:130], k[:130], v[:130], single))
        if not error <= 2e-2:
            return f"varlen attention (one record) differs from SDPA by {error:.3g}"
    except Exception as error:  # noqa: BLE001 — any failure means: use the fallback
        return f"varlen attention failed: {type(error).__name__}: {error}"
    return None


def prefix_varlen_matches_sdpa(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                               dim: int) -> str | None:
    """Flash varlen with fewer queries than keys must align its causal mask to the last key (query t of the new
    tokens sees the prefix and new tokens up to t). Compare with the explicitly masked SDPA; None if they agree."""
    try:
        generator = torch.Generator(device=device).manual_seed(2)
        new, prefix = 37, 150
        q, k, v = (torch.randn(rows, h, dim, device=device, dtype=dtype, generator=generator)
                   for rows, h in ((new, heads), (prefix + new, kv_heads), (prefix + new, kv_heads)))
        error = _difference(attention_after_prefix_varlen(q, k, v, prefix), attention_after_prefix(q, k, v, prefix))
        if not error <= 2e-2:
            return f"varlen attention after a prefix differs from the masked SDPA by {error:.3g}"
        segments = make_segments([new, 20], device, first_position=[prefix, 90])
        q2, k2, v2 = (torch.randn(segments.total, h, dim, device=device, dtype=dtype, generator=generator)
                      for h in (heads, kv_heads, kv_heads))
        keys, values = [k[:prefix], k[:90]], [v[:prefix], v[:90]]
        error = _difference(attention_after_prefixes_varlen(q2, k2, v2, keys, values, segments),
                            attention_after_prefixes(q2, k2, v2, keys, values, segments))
        if not error <= 2e-2:
            return f"varlen attention of records after their prefixes differs from the masked SDPA by {error:.3g}"
    except Exception as error:  # noqa: BLE001 — any failure means: keep the masked SDPA
        return f"varlen attention after a prefix failed: {type(error).__name__}: {error}"[:300]
    return None
