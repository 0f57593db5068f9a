"""W8A8 FP8 (e4m3) for the backbone's projection GEMMs: `precision="fp8"` (config.py), opt-in.

Weights are quantized once at load, per output channel (one float32 scale per row of the [out, in] weight); the
activations that feed a projection are quantized per row (per token) by the kernel that produces them: the residual
add + RMSNorm before the q/k/v (or Gated DeltaNet in_proj) and MLP gate/up projections, SiLU·mul before the MLP down
projection, and a row-quantize kernel of its own for the attention and Gated DeltaNet outputs before their output
projections. The GEMM is `torch._scaled_mm` with row-wise scales, bf16 out. Attention, the gated-delta recurrence,
the norms, the embeddings, the joint head and the float32 residual stream are untouched.

Each kernel is a small named function with a plain PyTorch version (`*_torch`), as in kernels.py: the CPU and the
tests run those; on CUDA `select_fp8_kernels` checks `torch._scaled_mm` and every fused Triton kernel against them
at start-up and refuses FP8 with the reason when one disagrees, rather than falling back silently.

The transformers modules of the projections are replaced by `Fp8Linear` over views of the same FP8 weights, so the
bf16 weights are freed (Clef-27B: ~28 GiB of weights instead of ~51) and the padded path (records with media) runs
in FP8 too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ReleaseError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value: a row's amax maps to it
MIN_AMAX = 1e-12  # an all-zero row gets this amax (its values stay zero), never a division by zero
SCALED_MM_MULTIPLE = 16  # torch._scaled_mm wants K and N multiples of 16


@dataclass(frozen=True)
class Fp8Rows:
    """Activations quantized per row: row i is values[i] * scales[i]."""

    values: torch.Tensor  # [N, D] e4m3, row-major
    scales: torch.Tensor  # [N, 1] float32

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device


@dataclass(frozen=True)
class Fp8Weight:
    """A projection weight quantized per output channel: row o is values[o] * scales[0, o]. Stored [out, in]
    row-major, so `values.t()` is the column-major [in, out] operand `torch._scaled_mm` wants."""

    values: torch.Tensor  # [out, in] e4m3
    scales: torch.Tensor  # [1, out] float32

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def rows(self, start: int, end: int) -> Fp8Weight:
        """Output channels [start, end) as views (one projection of a fused weight)."""
        return Fp8Weight(self.values[start:end], self.scales[:, start:end])


# ---- the plain PyTorch versions (CPU, tests, and the references the fused kernels are checked against) -----------

def quantize_rows_torch(x: torch.Tensor) -> Fp8Rows:
    """x [N, D] per row: scale = amax / 448, values = x / scale clamped to ±448, as e4m3."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scales = rows.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    return Fp8Rows((rows / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scales)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A [out, in] weight per output channel (its rows), as `quantize_rows_torch` quantizes activation rows."""
    quantized = quantize_rows_torch(weight)
    return Fp8Weight(quantized.values, quantized.scales.reshape(1, -1).contiguous())


def rms_norm_fp8_torch(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[Fp8Rows, torch.Tensor]:
    """(norm(residual + x) quantized per row, residual + x in float32): kernels.rms_norm_torch with its normed output
    quantized from float32 (never rounded to bf16 first)."""
    hidden = x.float() if residual is None else residual.float() + x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one
    return quantize_rows_torch(normed), hidden


def silu_mul_fp8_torch(gate_up: torch.Tensor, intermediate: int) -> Fp8Rows:
    """silu(gate) * up of the fused gate/up output [N, 2I], in float32, quantized per row."""
    gate, up = gate_up[:, :intermediate].float(), gate_up[:, intermediate:].float()
    return quantize_rows_torch(F.silu(gate) * up)


def linear_fp8_torch(x: Fp8Rows, weight: Fp8Weight) -> torch.Tensor:
    """x @ weight.T in bf16: the e4m3 products summed in float32, then each row's and column's scale, as
    `torch._scaled_mm` with row-wise scales computes it."""
    product = torch.mm(x.values.float(), weight.values.float().t())
    return (product * x.scales * weight.scales).to(torch.bfloat16)


# ---- the CUDA versions -----------------------------------------------------------------------------------------------

def linear_fp8_scaled_mm(x: Fp8Rows, weight: Fp8Weight) -> torch.Tensor:
    return torch._scaled_mm(x.values, weight.values.t(), scale_a=x.scales, scale_b=weight.scales,
                            out_dtype=torch.bfloat16)


def rms_norm_fp8_triton(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[Fp8Rows, torch.Tensor]:
    from .triton_kernels import add_rms_norm_fp8

    values, scales, total = add_rms_norm_fp8(x, weight_plus_one, eps, residual)
    return Fp8Rows(values, scales), total.view(x.shape)


def silu_mul_fp8_triton(gate_up: torch.Tensor, intermediate: int) -> Fp8Rows:
    from .triton_kernels import silu_mul_fp8

    return Fp8Rows(*silu_mul_fp8(gate_up, intermediate))


def quantize_rows_triton(x: torch.Tensor) -> Fp8Rows:
    from .triton_kernels import quantize_rows

    return Fp8Rows(*quantize_rows(x.reshape(-1, x.shape[-1])))


@dataclass
class Fp8Kernels:
    """The FP8 slots of a `kernels.Kernels` set (its `fp8`; None there means bf16)."""

    rms_norm: Callable = rms_norm_fp8_torch  # residual add + RMSNorm -> FP8 rows (q/k/v, in_proj, gate/up inputs)
    silu_mul: Callable = silu_mul_fp8_torch  # SiLU·mul -> FP8 rows (MLP down input)
    quantize_rows: Callable = quantize_rows_torch  # attention / Gated DeltaNet output -> FP8 rows
    linear: Callable = linear_fp8_torch  # FP8 rows x FP8 weight -> bf16

    SLOTS = ("rms_norm", "silu_mul", "quantize_rows", "linear")

    def describe(self) -> dict[str, str]:
        return {f"fp8.{name}": f"{getattr(self, name).__module__.rsplit('.', 1)[-1]}.{getattr(self, name).__name__}"
                for name in self.SLOTS}


def rows_differ(got: Fp8Rows, want: Fp8Rows) -> str | None:
    """None if two quantizations of the same rows agree: scales to float32 rounding, and values within one e4m3
    step (division and exp may round differently at a boundary) on at most 1% of the elements; else how they
    differ."""
    if got.values.dtype != E4M3 or got.scales.dtype != torch.float32:
        return f"returns {got.values.dtype} values and {got.scales.dtype} scales"
    if got.values.shape != want.values.shape or got.scales.shape != want.scales.shape:
        return f"returns shapes {tuple(got.values.shape)}/{tuple(got.scales.shape)}, not " \
               f"{tuple(want.values.shape)}/{tuple(want.scales.shape)}"
    if not torch.allclose(got.scales, want.scales, rtol=1e-5, atol=0):
        return f"scales differ by {(got.scales / want.scales - 1).abs().max().item():.3g} (relative)"
    a, b = got.values.float(), want.values.float()
    step = 0.125 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -9  # one e4m3 step, subnormals included
    if not bool(((a - b).abs() <= step * (1 + 1e-6)).all()):
        return f"values differ by more than one e4m3 step (up to {(a - b).abs().max().item():.3g} of ±448)"
    changed = int((a != b).sum().item())
    if changed > max(1, a.numel() // 100):
        return f"{changed} of {a.numel()} values differ by one e4m3 step (more than 1%)"
    return None


def _random(device: torch.device, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=torch.float32, generator=generator).to(dtype)
    return rand


def scaled_mm_matches(device: torch.device) -> str | None:
    """None if `torch._scaled_mm` (e4m3, row-wise scales, b column-major, bf16 out) computes the dequantized product
    here; else what it did."""
    try:
        rand = _random(device, 8)
        # rows and columns of very different magnitudes, so that a scale applied on the wrong side shows; M = 77
        # tokens (not a multiple of 16), as packs are
        x = quantize_rows_torch(rand(77, 320) * (0.01 + 10 * rand(77, 1).abs()))
        weight = quantize_weight(rand(192, 320) * (0.001 + rand(192, 1).abs()))
        want = F.linear(x.values.float() * x.scales, weight.values.float() * weight.scales.t())
        got = linear_fp8_scaled_mm(x, weight)
        if got.dtype != torch.bfloat16 or got.shape != want.shape:
            return f"torch._scaled_mm returned {got.dtype} {tuple(got.shape)}, not bfloat16 {tuple(want.shape)}"
        error = ((got.float() - want).abs().max() / want.abs().max()).item()
        if not error <= 1e-2:
            return f"torch._scaled_mm (row-wise scales) differs from the dequantized product by {error:.3g} (relative)"
    except Exception as error:  # noqa: BLE001 — any failure means: no FP8 here
        return f"torch._scaled_mm (e4m3, row-wise scales) failed: {type(error).__name__}: {error}"[:500]
    return None


def triton_fp8_matches_torch(device: torch.device) -> str | None:
    """None if every fused FP8 Triton kernel matches its PyTorch function (`rows_differ`) on random rows; else what
    failed."""
    try:
        from . import triton_kernels  # noqa: F401 — Triton itself may be missing or broken
    except Exception as error:  # noqa: BLE001
        return f"Triton unavailable: {type(error).__name__}: {error}"[:500]
    try:
        rand = _random(device, 9)
        n = 45
        x, residual, gain = rand(n, 320), rand(n, 320, dtype=torch.float32) * 4, 1 + 0.1 * rand(320).float()
        for name, previous in (("rms_norm", None), ("rms_norm (after a residual)", residual)):
            (got, got_sum), (want, want_sum) = (fn(x, gain, 1e-6, previous)
                                                for fn in (rms_norm_fp8_triton, rms_norm_fp8_torch))
            problem = rows_differ(got, want)
            if problem is None and not torch.allclose(got_sum, want_sum, rtol=1e-6, atol=1e-6):
                problem = "its float32 residual sum differs"
            if problem is not None:
                return f"Triton FP8 {name}: {problem}"
        gate_up = rand(n, 2 * 2500) * 3  # wider than one block of the kernel's loop, not a multiple of it
        problem = rows_differ(silu_mul_fp8_triton(gate_up, 2500), silu_mul_fp8_torch(gate_up, 2500))
        if problem is not None:
            return f"Triton FP8 silu_mul: {problem}"
        rows = rand(n, 3000) * (0.01 + 10 * rand(n, 1).abs())
        rows[3] = 0  # an all-zero row (a padding token's output can be one)
        problem = rows_differ(quantize_rows_triton(rows), quantize_rows_torch(rows))
        if problem is not None:
            return f"Triton FP8 quantize_rows: {problem}"
    except Exception as error:  # noqa: BLE001
        return f"Triton FP8 kernels failed: {type(error).__name__}: {error}"[:500]
    return None


def fp8_matches_torch(device: torch.device) -> str | None:
    """None if `torch._scaled_mm` and every fused FP8 Triton kernel compute what their PyTorch versions compute here;
    else what failed (the GEMM first)."""
    return scaled_mm_matches(device) or triton_fp8_matches_torch(device)


def select_fp8_kernels(device: torch.device) -> Fp8Kernels:
    """The FP8 slots for `device`: on CUDA `torch._scaled_mm` and the fused Triton kernels, checked first (a
    ReleaseError saying what disagreed if one does); elsewhere the PyTorch versions."""
    if device.type != "cuda":
        return Fp8Kernels()
    problem = fp8_matches_torch(device)
    if problem is not None:
        raise ReleaseError(f"precision fp8 refused on {torch.cuda.get_device_name(device)}: {problem}. "
                           "Use precision bf16 (the default).")
    return Fp8Kernels(rms_norm=rms_norm_fp8_triton, silu_mul=silu_mul_fp8_triton,
                      quantize_rows=quantize_rows_triton, linear=linear_fp8_scaled_mm)


# ---- the weights ----------------------------------------------------------------------------------------------------

class Fp8Linear(nn.Module):
    """A bias-free Linear over an FP8 weight (a view of a fused one): quantizes its input per row, then the FP8
    GEMM. What the transformers modules call in place of their projections (the padded path)."""

    def __init__(self, weight: Fp8Weight, kernels: Fp8Kernels):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_fp8", weight.values, persistent=False)
        self.register_buffer("weight_scale", weight.scales, persistent=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.kernels.quantize_rows(x.reshape(-1, x.shape[-1]))
        out = self.kernels.linear(rows, Fp8Weight(self.weight_fp8, self.weight_scale))
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel scales"


# FastLayer attribute -> (the transformers submodule, its Linear children fused into it, in order; see packed._fuse)
PROJECTIONS = {
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
    "in_proj": ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "out_proj": ("linear_attn", ("out_proj",)),
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
}


def layer_projections(fast, layer) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(FastLayer attribute, parent module, child names) of every projection of one decoder layer."""
    return [(name, getattr(layer, parent), children) for name, (parent, children) in PROJECTIONS.items()
            if hasattr(fast, name)]


def unsupported_shapes(layers) -> list[str]:
    """The projections of these decoder layers that `torch._scaled_mm` cannot take (in or out features not a
    multiple of 16), named."""
    bad = []
    for index, layer in enumerate(layers):
        for parent_name, children in PROJECTIONS.values():
            parent = getattr(layer, parent_name, None)
            for child in children if parent is not None else ():
                out_features, in_features = getattr(parent, child).weight.shape
                if out_features % SCALED_MM_MULTIPLE or in_features % SCALED_MM_MULTIPLE:
                    bad.append(f"layer {index} {child} [{out_features}, {in_features}]")
    return bad


@torch.no_grad()
def quantize_layer(fast, layer, kernels: Fp8Kernels) -> None:
    """Quantize one decoder layer's projections in place: each fused weight of the FastLayer becomes an Fp8Weight,
    and each transformers Linear an Fp8Linear over its rows of it, so that nothing holds the bf16 weights."""
    for name, parent, children in layer_projections(fast, layer):
        modules = [getattr(parent, child) for child in children]
        if any(module.bias is not None for module in modules):
            raise ReleaseError(f"precision fp8: {type(parent).__name__}.{children[0]} has a bias; FP8 projections "
                               "are bias-free")
        quantized = quantize_weight(getattr(fast, name))
        setattr(fast, name, quantized)
        row = 0
        for child, module in zip(children, modules):
            rows = module.weight.shape[0]
            setattr(parent, child, Fp8Linear(quantized.rows(row, row + rows), kernels))
            row += rows


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of every distinct storage the modules' parameters and buffers use (fused views counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
