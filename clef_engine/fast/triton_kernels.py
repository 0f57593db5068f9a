"""Fused Triton kernels for the packed backbone's elementwise work (CUDA; tests run them in Triton's interpreter).

Each kernel replaces a run of small PyTorch ops in `kernels.py` and rounds where that run rounds: every intermediate
the release path stores in bf16 is rounded to bf16 here too, so answers stay as close to the release path as the
PyTorch functions are; like them, they keep the residual stream in float32 where the release path rounds it
(see `kernels.rms_norm_torch`). What they save is memory passes and kernel launches on short records, where the
elementwise work between GEMMs is a large share of the GPU time (measured in bench/results/2026-11-29-h200-session2.md).

Inputs are token-major: `[N, ...]` rows, the last dim contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- residual add + RMSNorm ------------------------------------------------------------------------------------------


@triton.jit
def _add_and_norm_row(x_ptr, residual_ptr, sum_ptr, weight_ptr, row, cols, mask, D, eps,
                      HAS_RESIDUAL: tl.constexpr):
    """One row: residual + x stored in float32 at `sum_ptr` (the residual stream), and returned RMS-normed and
    weighted, in float32."""
    hidden = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        hidden += tl.load(residual_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(sum_ptr + row * D + cols, hidden, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(hidden * hidden, axis=0) / D + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return hidden * rstd * weight


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, sum_ptr, out_ptr, weight_ptr, D, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    normed = _add_and_norm_row(x_ptr, residual_ptr, sum_ptr, weight_ptr, row, cols, mask, D, eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * D + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.rms_norm_torch` in one pass."""
    shape = x.shape
    width = shape[-1]
    x2 = x.reshape(-1, width).contiguous()
    rows = x2.shape[0]
    out = torch.empty_like(x2, dtype=dtype or x2.dtype)
    total = torch.empty(x2.shape, dtype=torch.float32, device=x2.device)
    residual2 = residual.reshape(-1, width).contiguous() if residual is not None else x2
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows,)](x2, residual2, total, out, weight_plus_one, width, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=block,
                                  num_warps=8 if block >= 4096 else 4)
    return out.view(shape), total.view(shape)


# ---- MLP activation: silu(gate) * up ---------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, WIDTH, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(gate_up_ptr + row * 2 * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * WIDTH + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu's bf16 output
    tl.store(out_ptr + row * WIDTH + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for the fused gate/up projection output [N, 2I]."""
    gate_up = gate_up.contiguous()
    rows = gate_up.shape[0]
    out = gate_up.new_empty(rows, intermediate)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(intermediate, block))](gate_up, out, intermediate, BLOCK=block, num_warps=4)
    return out


# ---- Gated DeltaNet: short causal conv + SiLU, split into q / k / v --------------------------------------------------


@triton.jit(do_not_specialize=["N"])  # pack sizes vary: one compiled variant for all
def _conv_silu_split_kernel(x_ptr, stride_x, weight_ptr, positions_ptr, q_ptr, k_ptr, v_ptr, N, C, KEY_DIM,
                            W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    channels = tl.program_id(1) * BC + tl.arange(0, BC)
    token_ok = tokens < N
    channel_ok = channels < C
    position = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        shift = W - 1 - j
        source = tokens - shift
        inside = token_ok & (position >= shift)  # the tap lies in the same record (positions restart per record)
        x = tl.load(x_ptr + source.to(tl.int64)[:, None] * stride_x + channels[None, :],
                    mask=inside[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + channels * W + j, mask=channel_ok, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    y = acc.to(q_ptr.dtype.element_ty).to(tl.float32)  # the conv's bf16 output, then SiLU on it
    y = (y / (1.0 + tl.exp(-y))).to(q_ptr.dtype.element_ty)
    row = tokens.to(tl.int64)[:, None]
    value_dim = C - 2 * KEY_DIM
    ok = token_ok[:, None] & channel_ok[None, :]
    is_q = (channels < KEY_DIM)[None, :]
    is_k = ((channels >= KEY_DIM) & (channels < 2 * KEY_DIM))[None, :]
    is_v = (channels >= 2 * KEY_DIM)[None, :]
    tl.store(q_ptr + row * KEY_DIM + channels[None, :], y, mask=ok & is_q)
    tl.store(k_ptr + row * KEY_DIM + (channels - KEY_DIM)[None, :], y, mask=ok & is_k)
    tl.store(v_ptr + row * value_dim + (channels - 2 * KEY_DIM)[None, :], y, mask=ok & is_v)


def conv_silu_split(mixed: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                    key_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (width W, zero history at every record start) + SiLU of `mixed` [N, C] (rows may be
    strided, e.g. a slice of the fused projection), written as contiguous q [N, key_dim], k [N, key_dim],
    v [N, C - 2 key_dim]. `positions` [N] restart at 0 for every record."""
    n, channels = mixed.shape
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    width = weight.shape[-1]
    weight = weight.contiguous()
    q = mixed.new_empty(n, key_dim)
    k = mixed.new_empty(n, key_dim)
    v = mixed.new_empty(n, channels - 2 * key_dim)
    bt, bc = 32, 128
    grid = (triton.cdiv(n, bt), triton.cdiv(channels, bc))
    _conv_silu_split_kernel[grid](mixed, mixed.stride(0), weight, positions, q, k, v, n, channels, key_dim,
                                  W=width, BT=bt, BC=bc, num_warps=4)
    return q, k, v


# ---- Gated DeltaNet: q / k L2 norm per head ----------------------------------------------------------------------


@triton.jit(do_not_specialize=["R"])
def _l2norm_kernel(x_ptr, out_ptr, R, eps, D: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < R)[:, None]
    offsets = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offsets, mask=row_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(out_ptr + offsets, (x * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [N, H, D] divided by its L2 norm over D (float32 inside, x's dtype out): what flash-linear-attention's
    `l2norm_fwd` computes for `use_qk_l2norm_in_kernel`. Its kernel is autotuned again for every 65,536 rows of
    input, a compile of many seconds the first time a pack of a new size class arrives; this one has one
    compiled variant for every length."""
    x = x.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    rows = x.numel() // width
    rows_per_program = 16
    _l2norm_kernel[(triton.cdiv(rows, rows_per_program),)](x, out, rows, eps, D=width, ROWS=rows_per_program,
                                                            num_warps=4)
    return out


# ---- Gated DeltaNet: gated RMSNorm (Qwen3_5RMSNormGated) ------------------------------------------------------------


@triton.jit(do_not_specialize=["R"])
def _gated_rms_norm_kernel(x_ptr, gate_ptr, gate_stride, weight_ptr, out_ptr, R, HEADS, eps,
                           V: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row = token * HEADS + head
    row_ok = (rows < R)[:, None]
    cols = tl.arange(0, V)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * V + cols, mask=row_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / V + eps)
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols).to(tl.float32)
    scaled = (weight * normed).to(out_ptr.dtype.element_ty).to(tl.float32)  # weight * normed in bf16
    token = rows64 // HEADS
    head = rows64 % HEADS
    gate = tl.load(gate_ptr + token * gate_stride + head * V + cols, mask=row_ok, other=0.0).to(tl.float32)
    out = scaled * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + rows64 * V + cols, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H, V] (contiguous), gate [N, H*V] (rows may be strided): norm(x) * weight * silu(gate) -> [N*H, V]."""
    n, heads, width = x.shape
    x = x.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(n * heads, width, dtype=x.dtype, device=x.device)
    rows_per_program = 16
    grid = (triton.cdiv(n * heads, rows_per_program),)
    _gated_rms_norm_kernel[grid](x, gate, gate.stride(0), weight, out, n * heads, heads, eps, V=width,
                                 ROWS=rows_per_program, num_warps=4)
    return out


# ---- full attention: q/k RMSNorm + partial RoPE, written contiguous -------------------------------------------------


@triton.jit
def _norm_rope_kernel(source_ptr, source_stride, head_stride, source_offset, weight_ptr, cos_ptr, sin_ptr, out_ptr,
                      HEADS, eps, D: tl.constexpr, R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    base = source_ptr + token * source_stride + source_offset + head * head_stride
    x = tl.load(base + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    weight = tl.load(weight_ptr + d)
    normed = (x * rstd * weight).to(out_ptr.dtype.element_ty).to(tl.float32)  # the q/k norm's bf16 output
    # rotate_half on the first R dims: partner of d is d + R/2 (negated) or d - R/2
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    partner = tl.where(d < R, partner, d)
    x_partner = tl.load(base + partner).to(tl.float32)
    weight_partner = tl.load(weight_ptr + partner)
    normed_partner = (x_partner * rstd * weight_partner).to(out_ptr.dtype.element_ty).to(tl.float32)
    rotated = tl.where(d < half, -normed_partner, normed_partner)
    rotary = d < R
    cos = tl.load(cos_ptr + token * R + d, mask=rotary, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * R + d, mask=rotary, other=0.0).to(tl.float32)
    a = (normed * cos).to(out_ptr.dtype.element_ty).to(tl.float32)  # q*cos, rotate_half(q)*sin and their sum
    b = (rotated * sin).to(out_ptr.dtype.element_ty).to(tl.float32)  # each rounded to bf16, as in transformers
    out = tl.where(rotary, a + b, normed)
    tl.store(out_ptr + (token * HEADS + head) * D + d, out.to(out_ptr.dtype.element_ty))


def norm_rope(source: torch.Tensor, offset: int, head_stride: int, heads: int, dim: int,
              weight_plus_one: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """For each token and head: RMSNorm (weight 1 + w) of the `dim` values at source[t, offset + h*head_stride:],
    then RoPE on the first cos.shape[-1] dims. Returns a contiguous [N, heads, dim]."""
    n = source.shape[0]
    out = source.new_empty(n, heads, dim)
    _norm_rope_kernel[(n, heads)](source, source.stride(0), head_stride, offset, weight_plus_one,
                                  cos.contiguous(), sin.contiguous(), out, heads, eps, D=dim, R=cos.shape[-1],
                                  num_warps=2)
    return out


# ---- full attention: output * sigmoid(gate) --------------------------------------------------------------------------


@triton.jit
def _sigmoid_gate_kernel(x_ptr, gate_ptr, gate_stride, gate_head_stride, out_ptr, HEADS, D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + (token * HEADS + head) * D + d).to(tl.float32)
    gate = tl.load(gate_ptr + token * gate_stride + head * gate_head_stride + d).to(tl.float32)
    sigmoid = (1.0 / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + (token * HEADS + head) * D + d, (x * sigmoid).to(out_ptr.dtype.element_ty))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] * sigmoid(gate [N, H, D], a strided view) -> [N, H*D]."""
    n, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty(n, heads * dim, dtype=x.dtype, device=x.device)
    _sigmoid_gate_kernel[(n, heads)](x, gate, gate.stride(0), gate.stride(1), out, heads, D=dim, num_warps=2)
    return out
