"""W8A8 FP8 (e4m3) with block scales for the backbone's in-layer projections: `precision="fp8"` (config.py), opt-in.

The scheme of DeepSeek-V3 and vLLM's block FP8: each projection weight is quantized once at load in 128x128 blocks
(one float32 scale per block of 128 output by 128 input channels), and its input activations per token in groups of
128 columns (one float32 scale per token and group), so that one outlier costs the precision of its block only, not
of its whole row or channel. Only the projections whose output stays in the layer run in FP8: attention q/k/v (and
gate), the Gated DeltaNet in_proj and the MLP gate/up. The projections that feed the residual stream (attention
o_proj, Gated DeltaNet out_proj, MLP down_proj) stay bf16, as do attention, the gated-delta recurrence, the norms,
the embeddings, the joint head and the float32 residual stream: an error there is added to every later layer's input.
Every FP8 projection's input comes out of the residual add + RMSNorm, which writes it quantized (a fused Triton kernel
on CUDA).

Each kernel is a small named function with a plain PyTorch version (`*_torch`), as in kernels.py: the CPU and the
tests run those. The plain GEMM dequantizes both operands to float32 and multiplies: the exact product of what was
quantized. On CUDA the GEMM is `torch._scaled_mm` with blockwise scales (1x128 activations x 128x128 weights, SM90
and cuBLAS >= 12.9); `select_fp8_kernels` checks it and the fused norm against the plain versions at start-up and
takes the plain version of one that disagrees, saying why in the kernels' notes.

The transformers modules of the FP8 projections are replaced by `Fp8Linear` over views of the same FP8 weights, so
their bf16 weights are freed and the padded path (records with media) runs in FP8 too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ReleaseError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value: a block's amax maps to it
MIN_AMAX = 1e-12  # an all-zero block gets this amax (its values stay zero), never a division by zero
BLOCK = 128  # activations: one scale per token per BLOCK columns; weights: one per BLOCK x BLOCK block
SCALE_ROW_ALIGN = 4  # a weight's block scales are stored in rows padded to this many (cuBLAS's 128x128 scale layout)
SCALED_MM_OUT_MULTIPLE = 16  # torch._scaled_mm wants N a multiple of 16; the blockwise recipe K a multiple of BLOCK


def _blocks(length: int) -> int:
    return -(-length // BLOCK)


def _expand(scales: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """Per-block scales [R, C] repeated to one per element [rows, cols] (blocks of row_block x BLOCK)."""
    return scales.repeat_interleave(row_block, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def _pad_columns(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] float32 with K padded to a multiple of BLOCK with zeros (a partial last group keeps its own amax)."""
    extra = -x.shape[1] % BLOCK
    return F.pad(x, (0, extra)) if extra else x


@dataclass(frozen=True)
class Fp8Blocks:
    """Activations quantized per token in groups of BLOCK columns: x[i, j] = values[i, j] * scales[i, j // BLOCK].
    `scales` is column-major (stride (1, N)): the layout `torch._scaled_mm` wants for 1x128 scales."""

    values: torch.Tensor  # [N, K] e4m3, row-major
    scales: torch.Tensor  # [N, ceil(K / BLOCK)] float32, column-major

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * _expand(self.scales, *self.values.shape, row_block=1)


@dataclass(frozen=True)
class Fp8Weight:
    """A projection weight quantized in BLOCK x BLOCK blocks: w[o, i] = values[o, i] * scales[o // BLOCK, i // BLOCK].
    Stored [out, in] row-major, so `values.t()` is the column-major [in, out] operand `torch._scaled_mm` wants, and
    `scales.t()` its [in blocks, out blocks] scales with stride (1, rows padded to SCALE_ROW_ALIGN)."""

    values: torch.Tensor  # [out, in] e4m3
    scales: torch.Tensor  # [ceil(out / BLOCK), ceil(in / BLOCK)] float32, a view of rows padded to SCALE_ROW_ALIGN

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * _expand(self.scales, *self.values.shape, row_block=BLOCK)

    def rows(self, start: int, end: int) -> tuple[Fp8Weight, int]:
        """Output channels [start, end) (one projection of a fused weight) as views: the weight from the first row of
        the block holding `start` (a block's rows share its scales, so a view starts at a block), and how many of
        its first rows come before `start`."""
        first = start // BLOCK * BLOCK
        return Fp8Weight(self.values[first:end], self.scales[first // BLOCK: _blocks(end)]), start - first


# ---- the plain PyTorch versions (CPU, tests, and the references the CUDA kernels are checked against) -------------

def quantize_blocks_torch(x: torch.Tensor) -> Fp8Blocks:
    """x [..., K] per token in groups of BLOCK columns: scale = the group's amax / 448, values = x / scale clamped to
    ±448, as e4m3."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n, width = rows.shape
    groups = _pad_columns(rows).view(n, -1, BLOCK)
    scales = groups.abs().amax(-1).clamp(min=MIN_AMAX) / E4M3_MAX
    values = (groups / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(n, -1)[:, :width]
    column_major = scales.new_empty(scales.shape[1], n).t()  # stride (1, N) whatever N and the group count
    return Fp8Blocks(values.contiguous(), column_major.copy_(scales))


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A [out, in] weight in BLOCK x BLOCK blocks (partial blocks at the edges keep their own amax)."""
    out_features, in_features = weight.shape
    padded = _pad_columns(weight.float())
    padded = F.pad(padded, (0, 0, 0, -out_features % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX
    values = (blocks / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    values = values.view(padded.shape)[:out_features, :in_features].contiguous()
    columns = scales.shape[1]
    stored = scales.new_ones(scales.shape[0], -(-columns // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN)
    stored[:, :columns] = scales
    return Fp8Weight(values, stored[:, :columns])


def rms_norm_fp8_torch(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[Fp8Blocks, torch.Tensor]:
    """(norm(residual + x) quantized in blocks, residual + x in float32): kernels.rms_norm_torch with its normed
    output quantized from float32 (never rounded to bf16 first)."""
    hidden = x.float() if residual is None else residual.float() + x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one
    return quantize_blocks_torch(normed), hidden


def linear_fp8_torch(x: Fp8Blocks, weight: Fp8Weight) -> torch.Tensor:
    """x @ weight.T in bf16: both operands dequantized to float32 and multiplied, the exact product of what was
    quantized (what `torch._scaled_mm` computes up to its accumulation order)."""
    return torch.mm(x.dequantize(), weight.dequantize().t()).to(torch.bfloat16)


# ---- the CUDA versions -----------------------------------------------------------------------------------------------

def linear_fp8_scaled_mm(x: Fp8Blocks, weight: Fp8Weight) -> torch.Tensor:
    """`torch._scaled_mm` with the DeepSeek recipe: scale_a [M, K/128] (stride (1, M)), scale_b [K/128, N/128]
    (stride (1, K/128 padded to 4))."""
    return torch._scaled_mm(x.values, weight.values.t(), scale_a=x.scales, scale_b=weight.scales.t(),
                            out_dtype=torch.bfloat16)


def rms_norm_fp8_triton(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[Fp8Blocks, torch.Tensor]:
    from .triton_kernels import add_rms_norm_fp8

    values, scales, total = add_rms_norm_fp8(x, weight_plus_one, eps, residual, group=BLOCK)
    return Fp8Blocks(values, scales), total.view(x.shape)


@dataclass
class Fp8Kernels:
    """The FP8 slots of a `kernels.Kernels` set (its `fp8`; None there means bf16)."""

    rms_norm: Callable = rms_norm_fp8_torch  # residual add + RMSNorm -> FP8 blocks (q/k/v, in_proj, gate/up inputs)
    quantize: Callable = quantize_blocks_torch  # any activation -> FP8 blocks (the transformers modules' inputs)
    linear: Callable = linear_fp8_torch  # FP8 blocks x FP8 weight -> bf16
    notes: dict = field(default_factory=dict)  # why a CUDA kernel was not taken

    SLOTS = ("rms_norm", "quantize", "linear")

    def describe(self) -> dict[str, str]:
        names = {f"fp8.{name}": f"{getattr(self, name).__module__.rsplit('.', 1)[-1]}.{getattr(self, name).__name__}"
                 for name in self.SLOTS}
        return names | {f"fp8.{name}_fallback": note for name, note in self.notes.items()}


def blocks_differ(got: Fp8Blocks, want: Fp8Blocks) -> str | None:
    """None if two quantizations of the same activations agree: same layout, scales to float32 rounding, and values
    within one e4m3 step (division may round differently at a boundary) on at most 1% of the elements; else how
    they differ."""
    if got.values.dtype != E4M3 or got.scales.dtype != torch.float32:
        return f"returns {got.values.dtype} values and {got.scales.dtype} scales"
    if got.values.shape != want.values.shape or got.scales.shape != want.scales.shape:
        return f"returns shapes {tuple(got.values.shape)}/{tuple(got.scales.shape)}, not " \
               f"{tuple(want.values.shape)}/{tuple(want.scales.shape)}"
    if got.scales.stride() != want.scales.stride():
        return f"returns scales of strides {got.scales.stride()}, not {want.scales.stride()} (column-major)"
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
    """None if `torch._scaled_mm` with blockwise scales (e4m3, 1x128 x 128x128, bf16 out) computes the plain block
    GEMM here; else what it did."""
    try:
        rand = _random(device, 8)
        # M = 77 tokens (packs are any length), K = 384 (3 groups: the scale rows' padding to 4 is exercised),
        # N = 224 (a partial last block of outputs); groups and blocks of very different magnitudes, so that a scale
        # applied to the wrong block or side shows
        x = quantize_blocks_torch(rand(77, 384) * (0.01 + 10 * rand(77, 3).abs()).repeat_interleave(BLOCK, 1))
        weight = quantize_weight(rand(224, 384) * (0.001 + rand(2, 3).abs()).repeat_interleave(BLOCK, 0)[:224]
                                 .repeat_interleave(BLOCK, 1))
        want = linear_fp8_torch(x, weight).float()
        got = linear_fp8_scaled_mm(x, weight)
        if got.dtype != torch.bfloat16 or got.shape != want.shape:
            return f"torch._scaled_mm returned {got.dtype} {tuple(got.shape)}, not bfloat16 {tuple(want.shape)}"
        error = ((got.float() - want).abs().max() / want.abs().max()).item()
        if not error <= 1e-2:
            return f"torch._scaled_mm (blockwise scales) differs from the plain block GEMM by {error:.3g} (relative)"
    except Exception as error:  # noqa: BLE001 — any failure means: the plain GEMM here
        return f"torch._scaled_mm (e4m3, 1x128 x 128x128 scales) failed: {type(error).__name__}: {error}"[:500]
    return None


def triton_fp8_matches_torch(device: torch.device) -> str | None:
    """None if the fused quantizing RMSNorm matches its PyTorch function (`blocks_differ`, its residual sum to float32
    rounding) on random rows; else what failed."""
    try:
        from . import triton_kernels  # noqa: F401 — Triton itself may be missing or broken
    except Exception as error:  # noqa: BLE001
        return f"Triton unavailable: {type(error).__name__}: {error}"[:500]
    try:
        rand = _random(device, 9)
        n = 45
        # 320 columns: two full groups and a partial one; groups of very different magnitudes
        x = rand(n, 320) * (0.01 + 10 * rand(1, 3).abs()).repeat_interleave(BLOCK, 1)[:, :320]
        residual, gain = rand(n, 320, dtype=torch.float32), 1 + 0.1 * rand(320).float()
        for name, previous in (("rms_norm", None), ("rms_norm (after a residual)", residual)):
            (got, got_sum), (want, want_sum) = (fn(x, gain, 1e-6, previous)
                                                for fn in (rms_norm_fp8_triton, rms_norm_fp8_torch))
            problem = blocks_differ(got, want)
            if problem is None and not torch.allclose(got_sum, want_sum, rtol=1e-6, atol=1e-6):
                problem = "its float32 residual sum differs"
            if problem is not None:
                return f"Triton FP8 {name}: {problem}"
    except Exception as error:  # noqa: BLE001
        return f"Triton FP8 rms_norm failed: {type(error).__name__}: {error}"[:500]
    return None


def select_fp8_kernels(device: torch.device) -> Fp8Kernels:
    """The FP8 slots for `device`: on CUDA the fused Triton norm and `torch._scaled_mm`, each checked against its
    plain version first and replaced by it (the reason in `notes`) if it disagrees or fails; elsewhere the plain
    versions."""
    kernels = Fp8Kernels()
    if device.type != "cuda":
        return kernels
    problem = triton_fp8_matches_torch(device)
    if problem is None:
        kernels.rms_norm = rms_norm_fp8_triton
    else:
        kernels.notes["rms_norm"] = problem
    problem = scaled_mm_matches(device)
    if problem is None:
        kernels.linear = linear_fp8_scaled_mm
    else:
        kernels.notes["linear"] = problem
    return kernels


# ---- the weights ----------------------------------------------------------------------------------------------------

class Fp8Linear(nn.Module):
    """A bias-free Linear over an FP8 weight (a view of a fused one, from the block holding its first row on):
    quantizes its input in blocks, then the FP8 GEMM, less the `skip` rows before its own. What the transformers
    modules call in place of their projections (the padded path)."""

    def __init__(self, weight: Fp8Weight, skip: int, kernels: Fp8Kernels):
        super().__init__()
        self.out_features, self.in_features = weight.shape[0] - skip, weight.shape[1]
        self.skip = skip
        self.register_buffer("weight_fp8", weight.values, persistent=False)
        self.register_buffer("weight_scale", weight.scales, persistent=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.kernels.quantize(x.reshape(-1, x.shape[-1]))
        out = self.kernels.linear(blocks, Fp8Weight(self.weight_fp8, self.weight_scale))[:, self.skip:]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128 block scales"


# FastLayer attribute -> (the transformers submodule, its Linear children fused into it, in order; see packed._fuse):
# the projections whose output stays in the layer. o_proj, out_proj and down (their outputs join the residual
# stream) are not here: they stay bf16.
PROJECTIONS = {
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "in_proj": ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
}


def layer_projections(fast, layer) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(FastLayer attribute, parent module, child names) of every FP8 projection of one decoder layer."""
    return [(name, getattr(layer, parent), children) for name, (parent, children) in PROJECTIONS.items()
            if hasattr(fast, name)]


def unsupported_shapes(layers) -> list[str]:
    """The FP8 projections of these decoder layers that the blockwise `torch._scaled_mm` cannot take (in features
    not a multiple of BLOCK, out features not a multiple of 16), named."""
    bad = []
    for index, layer in enumerate(layers):
        for parent_name, children in PROJECTIONS.values():
            parent = getattr(layer, parent_name, None)
            for child in children if parent is not None else ():
                out_features, in_features = getattr(parent, child).weight.shape
                if out_features % SCALED_MM_OUT_MULTIPLE or in_features % BLOCK:
                    bad.append(f"layer {index} {child} [{out_features}, {in_features}]")
    return bad


@torch.no_grad()
def quantize_layer(fast, layer, kernels: Fp8Kernels) -> None:
    """Quantize one decoder layer's in-layer projections in place: each fused weight of the FastLayer becomes an
    Fp8Weight, and each transformers Linear an Fp8Linear over its rows of it, so that nothing holds their bf16
    weights. The residual-feeding projections are left as they are."""
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
            setattr(parent, child, Fp8Linear(*quantized.rows(row, row + rows), kernels))
            row += rows


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of every distinct storage the modules' parameters and buffers use (fused views counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
