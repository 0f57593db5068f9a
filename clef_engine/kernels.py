"""The kernels the packed backbone calls, each a small named function with a plain PyTorch fallback.

`select_kernels(device)` returns a `Kernels` set: on CUDA with flash-linear-attention installed, fla's Triton kernels
(varlen causal conv, chunked gated-delta rule, fused RMSNorm / gated RMSNorm) and torch's varlen flash attention
(used only if a self-check against per-record SDPA passes); on the CPU (and in tests) the PyTorch functions below,
which compute exactly what transformers' Qwen3.5 modules compute, record by record. Tests can build a `Kernels` with
any mix of these functions.

Shapes: packed token-major tensors, `[N, ...]` for N tokens of all records; `Segments` says where records start.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# fla's backend registry walks its backends on every call; nothing but Triton runs on an H200
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

CHUNK = 64  # fla's chunk size for both the conv and the gated-delta kernels


@dataclass
class Segments:
    """Where each record of a pack starts; built on the host once per batch (no device syncs afterwards)."""

    lengths: list[int]
    starts: list[int]
    positions: torch.Tensor  # [N] long, restarting at `first_position` for every record
    cu_seqlens: torch.Tensor | None  # [R+1] long on the device (None for a single record: no varlen needed)
    cu_seqlens_int32: torch.Tensor | None
    chunk_indices: torch.Tensor | None  # fla's per-chunk (record, chunk) table, precomputed on the host
    max_length: int

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def count(self) -> int:
        return len(self.lengths)


def make_segments(lengths: list[int], device: torch.device, *, first_position: int = 0) -> Segments:
    starts, cursor = [], 0
    for length in lengths:
        starts.append(cursor)
        cursor += length
    positions = torch.cat([torch.arange(first_position, first_position + n) for n in lengths])
    positions = positions.to(device, non_blocking=True)
    if len(lengths) == 1:  # no varlen for fla; the attention kernel still takes [0, n]
        cu_single = torch.tensor([0, lengths[0]], dtype=torch.int32).to(device, non_blocking=True)
        return Segments(lengths, starts, positions, None, cu_single, None, lengths[0])
    cu_host = torch.tensor([0] + [s + n for s, n in zip(starts, lengths)], dtype=torch.long)
    chunk_counts = [(n + CHUNK - 1) // CHUNK for n in lengths]
    chunk_indices = torch.tensor([[r, c] for r, count in enumerate(chunk_counts) for c in range(count)],
                                 dtype=torch.long).reshape(-1, 2)
    return Segments(lengths, starts, positions, cu_host.to(device, non_blocking=True),
                    cu_host.to(torch.int32).to(device, non_blocking=True),
                    chunk_indices.to(device, non_blocking=True), max(lengths))


# ---- RMSNorm (Qwen3.5's zero-centred gain: weight passed as 1 + w, in float32) --------------------------------------

def rms_norm_torch(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) — the residual add in x's dtype, as the decoder layer does it."""
    if residual is not None:
        x = residual + x
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight_plus_one).type_as(x), x


def rms_norm_fla(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm (fp32 inside). The residual add stays a torch op in x's dtype: normalizing the rounded sum,
    as the decoder layer does, keeps bf16 answers closer to the release path than fla's fp32 fused add."""
    from fla.modules.norm.layernorm import layer_norm_fwd

    if residual is not None:
        x = residual + x
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y, _, _, _ = layer_norm_fwd(x2, weight_plus_one, None, eps=eps, residual=None, is_rms_norm=True)
    return y.view(shape), x


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: norm(x) * weight * silu(gate), over the last dim."""
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = weight * hidden.to(dtype)
    return (hidden * F.silu(gate.float())).to(dtype)


def gated_rms_norm_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd

    shape = x.shape
    y, _, _, _ = layer_norm_gated_fwd(x.reshape(-1, shape[-1]).contiguous(), gate.reshape(-1, shape[-1]).contiguous(),
                                      weight, None, activation="swish", eps=eps, is_rms_norm=True)
    return y.view(shape)


# ---- short causal convolution (kernel 4, SiLU), never across record boundaries -------------------------------------

def causal_conv_torch(x: torch.Tensor, weight: torch.Tensor, segments: Segments) -> torch.Tensor:
    """x [N, D], weight [D, W]: per record, transformers' causal_conv1d_fn (zero left padding, SiLU)."""
    outputs = []
    width = weight.shape[-1]
    for start, length in zip(segments.starts, segments.lengths):
        part = x[start: start + length].t()[None].to(weight.dtype)  # [1, D, L]
        out = F.conv1d(part, weight[:, None, :], None, padding=width - 1, groups=weight.shape[0])[..., :length]
        outputs.append(F.silu(out)[0].t().to(x.dtype))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0].contiguous()


def causal_conv_fla(x: torch.Tensor, weight: torch.Tensor, segments: Segments) -> torch.Tensor:
    """fla's Triton varlen conv (reads the strided projection output in place)."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x[None], weight, None, activation=None, cu_seqlens=segments.cu_seqlens,
                         chunk_indices=segments.chunk_indices)
    return F.silu(y[0])  # SiLU on the bf16-rounded conv output, as transformers' path does


def causal_conv_after(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Continue one record's conv after a cached prefix: `tail` holds the prefix's last W-1 inputs [W-1, D]."""
    width = weight.shape[-1]
    extended = torch.cat([tail.to(x.dtype), x])
    part = extended.t()[None].to(weight.dtype)
    out = F.conv1d(part, weight[:, None, :], None, padding=width - 1, groups=weight.shape[0])
    out = out[..., width - 1: width - 1 + x.shape[0]]
    return F.silu(out)[0].t().to(x.dtype)


# ---- gated delta rule ------------------------------------------------------------------------------------------------

def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) exactly as Qwen3_5GatedDeltaNet computes them."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_torch(q, k, v, a, b, A_log, dt_bias, segments: Segments, initial_state=None,
                      output_final_state: bool = False):
    """q, k [N, H, K]; v [N, HV, V]; per record through transformers' own torch chunked rule.
    Returns (out [N, HV, V], final states [R, HV, K, V] or None)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    rule = getattr(qwen.torch_chunk_gated_delta_rule, "__wrapped__", qwen.torch_chunk_gated_delta_rule)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    repeat = v.shape[1] // q.shape[1]
    outputs, states = [], []
    for r, (start, length) in enumerate(zip(segments.starts, segments.lengths)):
        end = start + length
        q_r, k_r = q[start:end][None], k[start:end][None]
        if repeat > 1:
            q_r, k_r = q_r.repeat_interleave(repeat, dim=2), k_r.repeat_interleave(repeat, dim=2)
        state_in = initial_state[r: r + 1] if initial_state is not None else None
        out, state = rule(q_r, k_r, v[start:end][None], g=g[start:end][None], beta=beta[start:end][None],
                          initial_state=state_in, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=True)
        outputs.append(out[0])
        if output_final_state:
            states.append(state)
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return out, (torch.cat(states) if output_final_state else None)


def gated_delta_fla(q, k, v, a, b, A_log, dt_bias, segments: Segments, initial_state=None,
                    output_final_state: bool = False):
    """fla's chunked kernel over the whole pack (varlen via cu_seqlens); value heads grouped natively (GVA)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g, beta = gdn_gates(a, b, A_log, dt_bias)
    out, state = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
        cu_seqlens=segments.cu_seqlens, chunk_indices=segments.chunk_indices)
    return out[0], state


# ---- full attention (block-diagonal causal) -------------------------------------------------------------------------

def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hk, D]: one causal SDPA call per record; KV heads repeated like transformers' repeat_kv."""
    repeat = q.shape[1] // k.shape[1]
    outputs = []
    for start, length in zip(segments.starts, segments.lengths):
        end = start + length
        q_r = q[start:end].transpose(0, 1)[None]
        k_r = k[start:end].transpose(0, 1)[None]
        v_r = v[start:end].transpose(0, 1)[None]
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


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """torch's flash varlen attention over the whole pack (causal within each record)."""
    varlen_attn = _varlen_function()
    parameters = inspect.signature(varlen_attn).parameters
    kwargs: dict = {}
    if "is_causal" in parameters:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    cu = segments.cu_seqlens_int32
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, segments.max_length,
                       segments.max_length, **kwargs)


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


# ---- the set ---------------------------------------------------------------------------------------------------------

@dataclass
class Kernels:
    rms_norm: Callable = rms_norm_torch
    gated_rms_norm: Callable = gated_rms_norm_torch
    causal_conv: Callable = causal_conv_torch
    gated_delta: Callable = gated_delta_torch
    attention: Callable = attention_sdpa
    notes: dict = field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        names = {name: f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
                 for name, fn in (("rms_norm", self.rms_norm), ("gated_rms_norm", self.gated_rms_norm),
                                  ("causal_conv", self.causal_conv), ("gated_delta", self.gated_delta),
                                  ("attention", self.attention))}
        names.update(self.notes)
        return names

    @property
    def slow(self) -> list[str]:
        """Which of the two kernels that matter most on a GPU run on the per-record torch fallback."""
        return [name for name, fn in (("gated_delta", self.gated_delta), ("causal_conv", self.causal_conv))
                if fn in (gated_delta_torch, causal_conv_torch)]


def fla_importable() -> bool:
    return importlib.util.find_spec("fla") is not None


def varlen_matches_sdpa(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> str | None:
    """Run torch's varlen attention against per-record SDPA on random data; None if it agrees, else why not."""
    if _varlen_function() is None:
        return "torch.nn.attention.varlen is not available"
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        lengths = [70, 130, 1]
        n = sum(lengths)
        q = torch.randn(n, heads, dim, device=device, dtype=dtype, generator=generator)
        k = torch.randn(n, kv_heads, dim, device=device, dtype=dtype, generator=generator)
        v = torch.randn(n, kv_heads, dim, device=device, dtype=dtype, generator=generator)
        segments = make_segments(lengths, device)
        got = attention_varlen(q, k, v, segments).float()
        want = attention_sdpa(q, k, v, segments).float()
        error = (got - want).abs().max().item()
        if not error <= 2e-2:
            return f"varlen attention differs from SDPA by {error:.3g}"
        single = make_segments([130], device)
        error = (attention_varlen(q[:130], k[:130], v[:130], single).float()
                 - attention_sdpa(q[:130], k[:130], v[:130], single).float()).abs().max().item()
        if not error <= 2e-2:
            return f"varlen attention (one record) differs from SDPA by {error:.3g}"
    except Exception as error:  # noqa: BLE001 — any failure means: use the fallback
        return f"varlen attention failed: {type(error).__name__}: {error}"
    return None


def select_kernels(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int) -> Kernels:
    """The fastest set that works here (see the module docstring); `notes` say why a fallback was taken."""
    if device.type != "cuda":
        return Kernels(notes={"reason": "CPU: PyTorch reference kernels"})
    kernels = Kernels()
    if fla_importable():
        kernels.rms_norm = rms_norm_fla
        # the gated norm stays torch: its bf16 rounding points match the release path (fla's is fp32 throughout)
        kernels.causal_conv = causal_conv_fla
        kernels.gated_delta = gated_delta_fla
    else:
        kernels.notes["fla"] = "flash-linear-attention is not installed: per-record torch fallbacks"
    problem = varlen_matches_sdpa(device, dtype, heads, kv_heads, head_dim)
    if problem is None:
        kernels.attention = attention_varlen
    else:
        kernels.notes["attention_fallback"] = problem
    return kernels
