"""The kernels the packed backbone calls, each a small named function with a plain PyTorch fallback.

`select_kernels(device)` returns a `Kernels` set, one function per slot. On CUDA: fla's chunked gated-delta rule;
our fused Triton kernels (triton_kernels.py: add + RMSNorm, SiLU·mul, conv + SiLU, gated RMSNorm, q/k norm + RoPE,
output gate; the q/k L2 norm before fla's rule), used only if each matches its PyTorch function at start-up; torch's
flash varlen attention (and cuDNN's for one long record; attention.py), used only if they match per-record SDPA
and, for cuDNN, measure faster; cuBLAS's float32-output GEMM for the projections whose outputs join the residual
stream. On the CPU (and in tests) the PyTorch functions below, which compute exactly what transformers' Qwen3.5
modules compute, record by record. Tests can build a `Kernels` with any mix of these functions.

Shapes: packed token-major tensors, `[N, ...]` for N tokens of all records; `Segments` says where records start.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from .attention import (
    attention_after_prefix,
    attention_after_prefix_varlen,
    attention_after_prefixes,
    attention_after_prefixes_varlen,
    attention_chunk_cudnn,
    attention_sdpa,
    attention_varlen,
    attention_varlen_cudnn_long,
    chunk_attention_cudnn_pays,
    cudnn_long_attention_pays,
    prefix_varlen_matches_sdpa,
    varlen_matches_sdpa,
)
from .segments import Segments, make_segments

# FLA_DISABLE_BACKEND_DISPATCH (fla's backend registry would walk its backends on every call) is set by the
# engine's config (config.py), not as a side effect of importing this module.

# ---- RMSNorm (Qwen3.5's zero-centred gain: weight passed as 1 + w, in float32) --------------------------------------

def rms_norm_torch(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) in `dtype` (default x's), residual + x in float32).

    The residual stream stays in float32 (the release path rounds it to bf16 after every add): it is the one sum
    that carries every layer's output to the end, so its rounding error grows with depth, and keeping it costs only
    4 more bytes per element per call. `x` may come in float32 too (`residual_projection_float32`): the normed
    output is then asked for in the model's dtype, which the next projection reads. Float32 models compute exactly
    what the release path computes."""
    hidden = x.float() if residual is None else residual.float() + x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight_plus_one).to(dtype or x.dtype), hidden


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: norm(x) * weight * silu(gate) per head. x [N, H, V]; gate [N, H*V] -> [N*H, V]."""
    n, heads, width = x.shape
    dtype = x.dtype
    hidden = x.reshape(n * heads, width).float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = weight * hidden.to(dtype)
    return (hidden * F.silu(gate.reshape(n * heads, width).float())).to(dtype)


# ---- short causal convolution (kernel 4, SiLU), never across record boundaries -------------------------------------

def split_qkv(conv_out: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return conv_out[:, :key_dim], conv_out[:, key_dim: 2 * key_dim], conv_out[:, 2 * key_dim:]


def causal_conv_torch(x: torch.Tensor, weight: torch.Tensor, segments: Segments,
                      key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D], weight [D, W]: per record, transformers' causal_conv1d_fn (zero left padding, SiLU); returned
    split into (q, k, v) channel views."""
    outputs = []
    width = weight.shape[-1]
    for start, length in zip(segments.starts, segments.lengths):
        part = x[start: start + length].t()[None].to(weight.dtype)  # [1, D, L]
        out = F.conv1d(part, weight[:, None, :], None, padding=width - 1, groups=weight.shape[0])[..., :length]
        outputs.append(F.silu(out)[0].t().to(x.dtype))
    return split_qkv(torch.cat(outputs) if len(outputs) > 1 else outputs[0].contiguous(), key_dim)


def causal_conv_fla(x: torch.Tensor, weight: torch.Tensor, segments: Segments,
                    key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's Triton varlen conv (reads the strided projection output in place)."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x[None], weight, None, activation=None, cu_seqlens=segments.cu_seqlens,
                         chunk_indices=segments.chunk_indices)
    return split_qkv(F.silu(y[0]), key_dim)  # SiLU on the bf16-rounded conv output, as transformers' path does


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, segments: Segments,
                       key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused kernel: conv + SiLU, written as contiguous q, k, v (no copies before the gated-delta kernel)."""
    from .triton_kernels import conv_silu_split

    return conv_silu_split(x, weight, segments.positions, key_dim)


def causal_conv_after_torch(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, segments: Segments,
                            key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Continue one record's conv after earlier tokens (a cached state, or the previous chunk of a long record):
    `tail` holds their last W-1 inputs [W-1, D]; returned split into (q, k, v) like `causal_conv_torch`."""
    width = weight.shape[-1]
    extended = torch.cat([tail.to(x.dtype), x])
    part = extended.t()[None].to(weight.dtype)
    out = F.conv1d(part, weight[:, None, :], None, padding=width - 1, groups=weight.shape[0])
    out = out[..., width - 1: width - 1 + x.shape[0]]
    return split_qkv(F.silu(out)[0].t().to(x.dtype), key_dim)


def causal_conv_after_triton(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, segments: Segments,
                             key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused conv + SiLU over the tail followed by the new inputs; the tail's own rows are dropped. The new
    tokens' positions (from `segments`, never 0 after earlier tokens) let every tap read back into the tail."""
    from .triton_kernels import conv_silu_split

    width = tail.shape[0]
    extended = torch.cat([tail.to(x.dtype), x])
    positions = torch.cat([segments.positions.new_zeros(width), segments.positions])
    q, k, v = conv_silu_split(extended, weight, positions, key_dim)
    return q[width:], k[width:], v[width:]


# ---- gated delta rule ------------------------------------------------------------------------------------------------

def gated_delta_torch(q, k, v, a, b, A_log, dt_bias, segments: Segments, initial_state=None,
                      output_final_state: bool = False):
    """q, k [N, H, K]; v [N, HV, V]; per record through transformers' own torch chunked rule.
    Returns (out [N, HV, V], final states [R, HV, K, V] or None)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    rule = getattr(qwen.torch_chunk_gated_delta_rule, "__wrapped__", qwen.torch_chunk_gated_delta_rule)
    beta = b.sigmoid()  # beta and g exactly as Qwen3_5GatedDeltaNet computes them
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
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
    """fla's chunked kernel over the whole pack (varlen via cu_seqlens); value heads grouped natively (GVA). The
    decay g = -exp(A_log) * softplus(a + dt_bias) is computed inside fla's cumsum kernel (float32, as the release
    path computes it); beta = sigmoid(b) stays a bf16 torch op, where the release path rounds it. q and k are
    L2-normed first by our kernel (the same formula as fla's `use_qk_l2norm_in_kernel`, without its autotuning per
    size class, see triton_kernels.l2norm)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from .triton_kernels import l2norm

    out, state = chunk_gated_delta_rule(
        l2norm(q)[None], l2norm(k)[None], v[None], g=a[None], beta=b.sigmoid()[None], initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, cu_seqlens=segments.cu_seqlens, chunk_indices=segments.chunk_indices)
    return out[0], state


# ---- full attention: q/k norm + RoPE, output gate -------------------------------------------------------------------

def norm_rope_torch(source: torch.Tensor, offset: int, head_stride: int, heads: int, dim: int,
                    weight_plus_one: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm then RoPE of the heads read from the projection output: head h of token t is the `dim` values at
    source[t, offset + h * head_stride:]. Returns [N, heads, dim]. The rotary is partial (the first R of the dim
    values, cos/sin [N, R]), as transformers' apply_rotary_pos_emb."""
    n, rotary = source.shape[0], cos.shape[-1]
    x = source.as_strided((n, heads, dim), (source.stride(0), head_stride, 1), source.storage_offset() + offset)
    normed, _ = rms_norm_torch(x.contiguous(), weight_plus_one, eps)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = normed[..., :rotary], normed[..., rotary:]
    rotated_half = torch.cat((-x_rot[..., rotary // 2:], x_rot[..., : rotary // 2]), dim=-1)
    return torch.cat([x_rot * cos + rotated_half * sin, x_pass], dim=-1)


def norm_rope_triton(*args, **kwargs) -> torch.Tensor:
    from .triton_kernels import norm_rope

    return norm_rope(*args, **kwargs)


def sigmoid_gate_torch(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output [N, H, D] times sigmoid(gate [N, H, D]) -> [N, H*D]."""
    n = x.shape[0]
    return x.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    from .triton_kernels import sigmoid_gate

    return sigmoid_gate(x, gate)


# ---- MLP activation -------------------------------------------------------------------------------------------------

def silu_mul_torch(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


def silu_mul_triton(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    from .triton_kernels import silu_mul

    return silu_mul(gate_up, intermediate)


def rms_norm_triton(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add (kept in float32, see rms_norm_torch) and RMSNorm in one pass."""
    from .triton_kernels import add_rms_norm

    return add_rms_norm(x, weight_plus_one, eps, residual, dtype)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .triton_kernels import gated_rms_norm

    return gated_rms_norm(x, gate, weight, eps)


# ---- the projections whose outputs join the residual stream (attention o_proj, GDN out_proj, MLP down) ------------

def residual_projection_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in the weights' dtype, as the release path computes it (its output is rounded to bf16)."""
    return F.linear(x, weight)


def residual_projection_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same GEMM with its float32 accumulator written out as it is (cuBLAS's bf16 x bf16 -> float32): the
    output is added to the float32 residual stream next, so rounding it to bf16 first would only lose bits. Costs
    2 more bytes per output element, written once and read once by the add + norm."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


def residual_projection_matches(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if `residual_projection_float32` runs here and agrees with the GEMM in float32, else why not."""
    try:
        generator = torch.Generator(device=device).manual_seed(6)
        x = torch.randn(77, 320, device=device, dtype=dtype, generator=generator)
        weight = torch.randn(192, 320, device=device, dtype=dtype, generator=generator)
        got = residual_projection_float32(x, weight)
        want = F.linear(x.float(), weight.float())
        if got.dtype != torch.float32:
            return f"the float32-output GEMM returned {got.dtype}"
        error = ((got - want).abs().max() / want.abs().max()).item()
        if not error <= 1e-4:
            return f"the float32-output GEMM differs from float32 by {error:.3g} (relative)"
    except Exception as error:  # noqa: BLE001 — any failure means: keep the plain projection
        return f"the float32-output GEMM failed: {type(error).__name__}: {error}"[:300]
    return None


# ---- the set ---------------------------------------------------------------------------------------------------------

@dataclass
class Kernels:
    rms_norm: Callable = rms_norm_torch  # residual add + RMSNorm
    gated_rms_norm: Callable = gated_rms_norm_torch
    causal_conv: Callable = causal_conv_torch  # conv + SiLU, split into q, k, v
    causal_conv_after: Callable = causal_conv_after_torch  # the same after earlier tokens' last inputs
    gated_delta: Callable = gated_delta_torch
    attention: Callable = attention_sdpa
    attention_after_prefix: Callable = attention_after_prefix
    attention_after_prefixes: Callable = attention_after_prefixes  # a pack's records, each after its state
    attention_chunk: Callable = attention_after_prefix  # a long record's chunk after the chunks before it
    norm_rope: Callable = norm_rope_torch
    sigmoid_gate: Callable = sigmoid_gate_torch
    silu_mul: Callable = silu_mul_torch
    residual_projection: Callable = residual_projection_torch
    notes: dict = field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        names = {}
        for slot in fields(self)[:-1]:  # every kernel; then the notes
            fn = getattr(self, slot.name)
            names[slot.name] = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
        return names | self.notes

    @property
    def slow(self) -> list[str]:
        """Which of the two kernels that matter most on a GPU run on the per-record torch fallback."""
        return [name for name, fn in (("gated_delta", self.gated_delta), ("causal_conv", self.causal_conv))
                if fn in (gated_delta_torch, causal_conv_torch)]


def fla_importable() -> bool:
    return importlib.util.find_spec("fla") is not None


def triton_matches_torch(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
                         value_head_dim: int) -> str | None:
    """Run each fused Triton kernel against its PyTorch function on random data (two records, so boundaries are
    exercised); None if all agree to bf16 rounding, else what failed."""
    try:
        from .triton_kernels import l2norm  # Triton itself may be missing or broken
    except Exception as error:  # noqa: BLE001
        return f"Triton unavailable: {type(error).__name__}: {error}"
    try:
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=g)

        segments = make_segments([37, 90], device)
        n = segments.total
        checks = []
        x, residual, weight = rand(n, 320), rand(n, 320), 1 + 0.1 * rand(320).float()
        checks.append(("rms_norm", rms_norm_triton(x, weight, 1e-6, residual),
                       rms_norm_torch(x, weight, 1e-6, residual)))
        checks.append(("rms_norm (float32 in)", rms_norm_triton(x.float(), weight, 1e-6, residual, dtype),
                       rms_norm_torch(x.float(), weight, 1e-6, residual, dtype)))
        gate_up = rand(n, 2 * 200)
        checks.append(("silu_mul", silu_mul_triton(gate_up, 200), silu_mul_torch(gate_up, 200)))
        key_dim, value_dim = 2 * 64, 3 * 64
        projected = rand(n, 2 * key_dim + value_dim + 10)
        conv_weight = rand(2 * key_dim + value_dim, 4)
        mixed = projected[:, : 2 * key_dim + value_dim]
        checks.append(("causal_conv", causal_conv_triton(mixed, conv_weight, segments, key_dim),
                       causal_conv_torch(mixed, conv_weight, segments, key_dim)))
        later = make_segments([n], device, first_position=50)
        tail = rand(conv_weight.shape[-1] - 1, mixed.shape[1])
        checks.append(("causal_conv_after", causal_conv_after_triton(mixed, conv_weight, tail, later, key_dim),
                       causal_conv_after_torch(mixed, conv_weight, tail, later, key_dim)))
        heads_qk = rand(n, 2, value_head_dim)
        unit = heads_qk.float() * torch.rsqrt((heads_qk.float() ** 2).sum(-1, keepdim=True) + 1e-6)
        checks.append(("l2norm", l2norm(heads_qk), unit.to(dtype)))
        core, z = rand(n, 3, value_head_dim), rand(n, 3 * value_head_dim + 5)
        norm_weight = 1 + 0.1 * rand(value_head_dim)
        checks.append(("gated_rms_norm", gated_rms_norm_triton(core, z[:, : 3 * value_head_dim], norm_weight, 1e-6),
                       gated_rms_norm_torch(core, z[:, : 3 * value_head_dim], norm_weight, 1e-6)))
        source = rand(n, heads * 2 * head_dim + 2 * kv_heads * head_dim)
        rotary = max(2, head_dim // 4)
        angle = torch.arange(n, device=device, dtype=torch.float32)[:, None] * torch.linspace(
            0.01, 1.0, rotary, device=device)[None, :]
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        qk_weight = 1 + 0.1 * rand(head_dim).float()
        arguments = (source, 0, 2 * head_dim, heads, head_dim, qk_weight, cos, sin, 1e-6)
        checks.append(("norm_rope", norm_rope_triton(*arguments), norm_rope_torch(*arguments)))
        out = rand(n, heads, head_dim)
        gate = source[:, : heads * 2 * head_dim].view(n, heads, 2 * head_dim)[..., head_dim:]
        checks.append(("sigmoid_gate", sigmoid_gate_triton(out, gate), sigmoid_gate_torch(out, gate)))
        for name, got, want in checks:
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want):
                if a.dtype != b.dtype:
                    return f"Triton {name} returns {a.dtype}, PyTorch {b.dtype}"
                a, b = a.float().reshape(b.shape), b.float()
                # one bf16 rounding step apart at most (accumulation order may differ)
                if not torch.allclose(a, b, atol=2e-2, rtol=1.6e-2):
                    return f"Triton {name} differs from PyTorch by {(a - b).abs().max().item():.3g}"
    except Exception as error:  # noqa: BLE001 — any failure means: use the PyTorch functions
        return f"Triton kernels failed: {type(error).__name__}: {error}"[:500]
    return None


def _adopt(kernels: Kernels, note: str, problem: str | None, **slots: Callable) -> bool:
    """Put `slots` into `kernels` if their check found no `problem`, else keep the problem in `notes[note]`."""
    if problem is None:
        for name, fn in slots.items():
            setattr(kernels, name, fn)
    else:
        kernels.notes[note] = problem
    return problem is None


def select_kernels(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
                   value_head_dim: int = 128) -> Kernels:
    """The fastest set that works here (see the module docstring); `notes` say why a fallback was taken."""
    if device.type != "cuda":
        return Kernels(notes={"reason": "CPU: PyTorch reference kernels"})
    kernels = Kernels()
    fla = None if fla_importable() else "flash-linear-attention is not installed: per-record torch fallbacks"
    _adopt(kernels, "fla", fla, causal_conv=causal_conv_fla, gated_delta=gated_delta_fla)
    _adopt(kernels, "triton_fallback", triton_matches_torch(device, dtype, heads=heads, kv_heads=kv_heads,
                                                            head_dim=head_dim, value_head_dim=value_head_dim),
           rms_norm=rms_norm_triton, silu_mul=silu_mul_triton, causal_conv=causal_conv_triton,
           gated_rms_norm=gated_rms_norm_triton, causal_conv_after=causal_conv_after_triton,
           norm_rope=norm_rope_triton, sigmoid_gate=sigmoid_gate_triton)
    shape = (device, dtype, heads, kv_heads, head_dim)
    if _adopt(kernels, "attention_fallback", varlen_matches_sdpa(*shape), attention=attention_varlen):
        _adopt(kernels, "prefix_attention_fallback", prefix_varlen_matches_sdpa(*shape),
               attention_after_prefix=attention_after_prefix_varlen, attention_chunk=attention_after_prefix_varlen,
               attention_after_prefixes=attention_after_prefixes_varlen)
        _adopt(kernels, "chunk_attention", chunk_attention_cudnn_pays(*shape), attention_chunk=attention_chunk_cudnn)
        _adopt(kernels, "long_record_attention", cudnn_long_attention_pays(*shape),
               attention=attention_varlen_cudnn_long)
    if dtype != torch.float32:
        _adopt(kernels, "residual_projection", residual_projection_matches(device, dtype),
               residual_projection=residual_projection_float32)
    return kernels
