# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""FP8 next to bf16 on the Clef-27B architecture on one H200 (issue 25; issue 38's block-scaled scheme, below), in
one run, and the merge of bench/long_records.py's sections into the same results file. FP8 is an experiment here,
not a setting of the product: it missed its fidelity gate (max |Δp| 0.169 against 0.05, 71 flips;
bench/results/2026-12-04-h200-start-and-shapes.json), so the engine runs bf16 only.

    python bench/lengths_and_precision.py OUT.json --smoke        (CUDA, a tiny shape: checks everything, ~1-2 min)
    python bench/lengths_and_precision.py OUT.json                (CUDA; flash-linear-attention installed; < 10 min)
    python bench/lengths_and_precision.py OUT.json --sections fidelity,bf16,fp8 --no-decide     (issue 38's keys)
    python bench/lengths_and_precision.py OUT.json --sections fidelity         (one section again, merged into OUT)
    python bench/lengths_and_precision.py OUT.json --sections long --long-results long-records.json   (no GPU)
    python bench/lengths_and_precision.py OUT.json --smoke --device cpu       (the script only, plain FP8 functions)

Sections (`--sections`, comma-separated, run in the order given, `long` first; default bf16,fp8,fidelity):
- bf16: one model with random bf16 weights of the Clef-27B shape (bench/build.py, never zeros) in an engine with the
  default configuration: 256 cases of 700-1,300 tokens through the workbench's JobRunner + SQLite, after an untimed
  `decide_many` of all of them (Triton compiles and autotunes for every pack length, the allocator grows; the
  engine's full warm-up, ~2 min of CUDA-graph captures for every length, is left out: a batch runs packs, not
  graphs); then `decide` p50 at ~512 and ~1k tokens (16 fresh states each, lengths drawn from 450-600 and 900-1,150
  as bench/user_paths.py does, each request decided once untimed first so that its length's CUDA graph is captured
  before the timed call).
- fp8: the bf16 engine closed, the same model (the same weights) loaded again in bf16 and converted (`to_fp8`): its
  in-layer projections quantized in place in 128x128 blocks, the checks of the blockwise `torch._scaled_mm` and the
  fused FP8 norm run first (a kernel that fails its check is replaced by its plain version:
  `detail.fp8.kernels` says which ran, and why); weights in GiB; the same batch and `decide` timings; and its
  answers next to bf16's on the timed requests. `--no-decide` leaves out the `decide` timings of both sections.
- fidelity: the 27B model freed; bench/fidelity.py's comparison on the Clef-Flash shape: the truth is the release path
  in float32 (TF32 off) on 55 varied records; ours in bf16 and in fp8 (`engine.runner.forward`, one record at a time,
  as `decide` runs it; CUDA graphs off, which replay the same kernels). Clef-27B's float32 truth (~110 GB) does not
  fit next to its bf16 copy on one H200, hence the Flash shape (said in `fp8.fidelity_shape`).
- long: `long` and `p95_over_p50_16k` (and their detail) copied from bench/long_records.py's results (`--long-results`).

Writes OUT.json after every section and step, in issue 25's and 38's layout: `fp8.{bf16_batch_tokens_per_s,
fp8_batch_tokens_per_s, batch_speedup, p50_512_ms, p50_1024_ms, weights_gib, max_dp, max_flip_margin, flips,
questions}` (plus `gate_met`, `scheme`, `fidelity_shape`), `long`, `p95_over_p50_16k`; everything else under
`detail`. An existing OUT.json is read first and the sections run now replace their keys, so several calls build one
file. BENCH_DEADLINE_S (560) is the time after start by which it stops starting steps that would not end in time.
Copy the file to bench/results/<date>-h200-lengths-and-precision.json (or its `fp8` keys into issue 38's
<date>-h200-start-and-shapes.json).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402
from clef_engine.fast.packed import PackedBackbone  # noqa: E402
from clef_engine.fast.triton_kernels import _add_and_norm_row  # noqa: E402

STARTED = time.perf_counter()
SECTIONS = ("bf16", "fp8", "fidelity", "long")
BATCH_CASES, LATENCY_SAMPLES, FIDELITY_RECORDS = 256, 16, 55
SMOKE_RECORDS = 8
LATENCY_BUCKETS = {"512": (450, 600), "1024": (900, 1150)}
# the smoke shape of the fidelity section: Clef-Flash's structure at a width a CPU or a minute of GPU runs, every
# projection's features a multiple of 16 (torch._scaled_mm's rule; fidelity.py's "tiny" has 4-wide b/a projections)
SMOKE_FIDELITY_SHAPE = dict(hidden=256, ffn=512, layers=4, heads=4, kv_heads=2, gdn_k=4, gdn_v=16, vision_out=256,
                            head_width=64, vocab="tiny", state_tokens=(30, 150))

results: dict = {"fp8": {}, "long": {}, "p95_over_p50_16k": None, "detail": {"errors": {}}}
OUT: Path
DEADLINE = 0.0


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


def say(*parts) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s]", *parts, flush=True)


section = build.sections(left, save, results["detail"]["errors"])


# ---- the FP8 scheme (issue 38): W8A8 e4m3 with block scales for the backbone's in-layer projections ---------------
# The scheme of DeepSeek-V3 and vLLM's block FP8: each projection weight is quantized once in 128x128 blocks (one
# float32 scale per block of 128 output by 128 input channels), and its input activations per token in groups of 128
# columns (one float32 scale per token and group), so that one outlier costs the precision of its block only, not of
# its whole row or channel. Only the projections whose output stays in the layer run in FP8: attention q/k/v (and
# gate), the Gated DeltaNet in_proj and the MLP gate/up. The projections that feed the residual stream (attention
# o_proj, Gated DeltaNet out_proj, MLP down_proj) stay bf16, as do attention, the gated-delta recurrence, the norms,
# the embeddings, the joint head and the float32 residual stream: an error there is added to every later layer's input.
# Every FP8 projection's input comes out of the residual add + RMSNorm, which writes it quantized (a fused Triton
# kernel on CUDA).
#
# Each kernel is a small named function with a plain PyTorch version (`*_torch`): the CPU and the tests run those.
# The plain GEMM dequantizes both operands to float32 and multiplies: the exact product of what was quantized. On
# CUDA the GEMM is `torch._scaled_mm` with blockwise scales (1x128 activations x 128x128 weights, SM90 and cuBLAS
# >= 12.9); `select_fp8_kernels` checks it and the fused norm against the plain versions first and takes the plain
# version of one that disagrees, saying why in its notes.
#
# `to_fp8(engine)` converts a loaded bf16 engine: the packed backbone's fused weights become FP8 and the backbone an
# `Fp8Backbone`, whose `_norm` and `_project` (the product's seam between a projection and its input) run FP8; the
# transformers modules of those projections become `Fp8Linear` over views of the same FP8 weights, so that their bf16
# weights are freed and the padded path (records with media) runs in FP8 too.

# The gate issue 25 set for FP8 against the float32 truth: max |Δp| and the truth's top-two gap of any flipped answer
GATE_MAX_DP = 0.05
GATE_FLIP_MARGIN = 0.05
SCHEME = "block: e4m3 128x128 weight blocks, 1x128 activation groups; o_proj, out_proj, down_proj in bf16"

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


# ---- the fused Triton norm: the projections' inputs written as e4m3, one float32 scale per token per group ---------
# Each group of `group` (128) columns of a row is scaled so that its largest magnitude maps to e4m3's largest finite
# value (448), as quantize_blocks_torch does: x[i, j] = values[i, j] * scales[i, j // group]. Quantizing where
# the activations are produced saves the separate pass that, measured on the H200, ate the FP8 GEMM's gain
# (../shared/measurements/2026-12-02).

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (constexpr: read inside the kernels)
FP8_MIN_AMAX = tl.constexpr(1e-12)  # an all-zero group gets this amax (its values stay zero), never a division by 0


@triton.jit
def _add_rms_norm_fp8_kernel(x_ptr, residual_ptr, sum_ptr, values_ptr, scales_ptr, weight_ptr, D, ROWS, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    normed = _add_and_norm_row(x_ptr, residual_ptr, sum_ptr, weight_ptr, row, cols, mask, D, eps, HAS_RESIDUAL)
    groups = tl.reshape(normed, (BLOCK // GROUP, GROUP))  # columns past D are 0: no group's amax changes
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1), FP8_MIN_AMAX) / FP8_MAX
    quantized = tl.minimum(tl.maximum(groups / scale[:, None], -FP8_MAX), FP8_MAX)
    tl.store(values_ptr + row * D + cols, tl.reshape(quantized, (BLOCK,)).to(values_ptr.dtype.element_ty), mask=mask)
    group = tl.arange(0, BLOCK // GROUP)
    tl.store(scales_ptr + group * ROWS + row, scale, mask=group * GROUP < D)  # column-major [ROWS, groups]


def add_rms_norm_fp8(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values [N, D], float32 scales [N, ceil(D / group)] column-major, residual + x [N, D] in float32):
    `add_rms_norm`'s normed output (in float32, never rounded to bf16) quantized per token per `group` columns, in
    the same one pass."""
    width = x.shape[-1]
    x2 = x.reshape(-1, width).contiguous()
    rows = x2.shape[0]
    values = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty(-(-width // group), rows, dtype=torch.float32, device=x2.device).t()
    total = torch.empty(x2.shape, dtype=torch.float32, device=x2.device)
    residual2 = residual.reshape(-1, width).contiguous() if residual is not None else x2
    block = max(triton.next_power_of_2(width), group)
    _add_rms_norm_fp8_kernel[(rows,)](x2, residual2, total, values, scales, weight_plus_one, width, rows, eps,
                                      HAS_RESIDUAL=residual is not None, BLOCK=block, GROUP=group,
                                      num_warps=8 if block >= 4096 else 4)
    return values, scales, total


# ---- the CUDA versions -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaledMm:
    """`torch._scaled_mm` with the DeepSeek recipe (1x128 activation scales x 128x128 weight scales, bf16 out), its
    operands laid out one way of SCALED_MM_LAYOUTS. The layout torch documents (scale_a [M, K/128] with stride
    (1, M), scale_b [K/128, N/128] with stride (1, K/128 padded to 4)) was refused on the H200's torch 2.11
    ("Invalid scaling configuration", 2026-12-04), and the check's wording there does not say which stride it wants:
    `scaled_mm_matches` tries each layout and keeps the first whose product is the plain block GEMM's."""

    row_multiple: int = 1  # activations padded with zero rows to a multiple of this (scale_a's stride (1, M) with them)
    weight_scales_row_major: bool = False  # scale_b [K/128, N/128] row-major, rows padded to 4 (not the transpose)

    @property
    def __name__(self) -> str:  # what Fp8Kernels.describe reports
        return f"linear_fp8_scaled_mm(rows to a multiple of {self.row_multiple}, weight scales " \
               f"{'row' if self.weight_scales_row_major else 'column'}-major)"

    def __call__(self, x: Fp8Blocks, weight: Fp8Weight) -> torch.Tensor:
        values, scale_a = x.values, x.scales
        rows, extra = values.shape[0], -values.shape[0] % self.row_multiple
        if extra:
            values = F.pad(values.view(torch.uint8), (0, 0, 0, extra)).view(E4M3)  # zero bits are e4m3's 0.0
            scale_a = scale_a.new_ones(scale_a.shape[1], rows + extra).t()
            scale_a[:rows] = x.scales
        scale_b = weight.scales.t()
        if self.weight_scales_row_major:
            groups, blocks = scale_b.shape
            scale_b = scale_b.new_ones(groups, -(-blocks // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN)[:, :blocks]
            scale_b.copy_(weight.scales.t())
        out = torch._scaled_mm(values, weight.values.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        return out[:rows]


SCALED_MM_LAYOUTS = (ScaledMm(), ScaledMm(16), ScaledMm(weight_scales_row_major=True),
                     ScaledMm(16, weight_scales_row_major=True))
linear_fp8_scaled_mm = SCALED_MM_LAYOUTS[0]  # the layout torch documents


def rms_norm_fp8_triton(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[Fp8Blocks, torch.Tensor]:
    values, scales, total = add_rms_norm_fp8(x, weight_plus_one, eps, residual, group=BLOCK)
    return Fp8Blocks(values, scales), total.view(x.shape)


@dataclass
class Fp8Kernels:
    """The FP8 functions an `Fp8Backbone` calls, next to its bf16 `kernels.Kernels`."""

    rms_norm: Callable = rms_norm_fp8_torch  # residual add + RMSNorm -> FP8 blocks (q/k/v, in_proj, gate/up inputs)
    quantize: Callable = quantize_blocks_torch  # any activation -> FP8 blocks (the transformers modules' inputs)
    linear: Callable = linear_fp8_torch  # FP8 blocks x FP8 weight -> bf16
    notes: dict = field(default_factory=dict)  # why a CUDA kernel (or _scaled_mm layout) was not taken

    SLOTS = ("rms_norm", "quantize", "linear")

    def describe(self) -> dict[str, str]:
        names = {f"fp8.{name}": getattr(self, name).__name__ for name in self.SLOTS}
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


def scaled_mm_matches(device: torch.device) -> tuple[ScaledMm | None, str | None]:
    """(the first of SCALED_MM_LAYOUTS whose `torch._scaled_mm` computes the plain block GEMM here, or None; what
    each layout before it did, or None if the first matched)."""
    rand = _random(device, 8)
    # M = 77 tokens (packs are any length, and not a multiple of 4 or 16), K = 384 (3 groups: the scale rows' padding
    # to 4 is exercised), N = 224 (a partial last block of outputs); groups and blocks of very different magnitudes,
    # so that a scale applied to the wrong block or side shows
    x = quantize_blocks_torch(rand(77, 384) * (0.01 + 10 * rand(77, 3).abs()).repeat_interleave(BLOCK, 1))
    weight = quantize_weight(rand(224, 384) * (0.001 + rand(2, 3).abs()).repeat_interleave(BLOCK, 0)[:224]
                             .repeat_interleave(BLOCK, 1))
    want = linear_fp8_torch(x, weight).float()
    problems: list[str] = []
    for layout in SCALED_MM_LAYOUTS:
        problem: str | None
        try:
            got = layout(x, weight)
            if got.dtype != torch.bfloat16 or got.shape != want.shape:
                problem = f"returned {got.dtype} {tuple(got.shape)}, not bfloat16 {tuple(want.shape)}"
            else:
                distance = ((got.float() - want).abs().max() / want.abs().max()).item()
                problem = None if distance <= 1e-2 else f"is {distance:.3g} (relative) off the plain block GEMM"
        except Exception as error:  # noqa: BLE001 — any failure means: try the next layout
            problem = f"failed: {type(error).__name__}: {error}"
        if problem is None:
            return layout, "; ".join(problems) or None
        # the first failure in full (torch's message lists what it wants), the others short
        problems.append(f"torch._scaled_mm as {layout.__name__} {problem}"[:2000 if not problems else 300])
    return None, "; ".join(problems)


def triton_fp8_matches_torch(device: torch.device) -> str | None:
    """None if the fused quantizing RMSNorm matches its PyTorch function (`blocks_differ`, its residual sum to float32
    rounding) on random rows; else what failed."""
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
    layout, problems = scaled_mm_matches(device)
    if layout is not None:
        kernels.linear = layout
    if problems is not None:  # the plain GEMM, or a layout after the documented one: what the others did
        kernels.notes["linear"] = problems
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
            raise ValueError(f"FP8: {type(parent).__name__}.{children[0]} has a bias; FP8 projections are bias-free")
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


class Fp8Backbone(PackedBackbone):
    """A packed backbone whose in-layer projections run in FP8 (`to_fp8`); the rest as in bf16."""

    fp8: Fp8Kernels

    def _norm(self, branch: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
        return self.fp8.rms_norm(branch, weight, self.eps, residual)

    def _project(self, x, weight) -> torch.Tensor:
        return self.fp8.linear(x, weight)


def fp8_backbone(backbone: PackedBackbone, model, kernels: Fp8Kernels | None = None) -> Fp8Backbone:
    """`backbone` (of `model`) with its in-layer projections quantized in place, one layer at a time (one layer's
    float32 copy at once), and run in FP8 from now on. `kernels`: the FP8 functions (default: the checked CUDA ones
    on a GPU, the plain ones elsewhere). Shapes the blockwise `torch._scaled_mm` cannot take are refused before
    anything changes."""
    fp8 = kernels or select_fp8_kernels(backbone.device)
    layers = model.model.language_model.layers[: len(backbone.layers)]
    if isinstance(fp8.linear, ScaledMm):
        bad = unsupported_shapes(layers)
        if bad:
            raise ValueError(f"FP8: the blockwise torch._scaled_mm needs in features that are multiples of {BLOCK} "
                             f"and out features multiples of {SCALED_MM_OUT_MULTIPLE}; these projections are not: "
                             f"{', '.join(bad[:4])}")
    for fast, layer in zip(backbone.layers, layers):
        quantize_layer(fast, layer, fp8)
    backbone.__class__ = Fp8Backbone
    backbone.fp8 = fp8
    return backbone


def to_fp8(engine, kernels: Fp8Kernels | None = None) -> None:
    """A loaded bf16 engine (packed path) answering in FP8 from now on (`fp8_backbone`); its graphs and kept states,
    of the bf16 weights, are dropped."""
    runner = engine.runner
    fp8_backbone(runner.backbone, runner.model, kernels)
    runner.use_kernels(runner.backbone.kernels)
    if engine.config.cuda:
        engine.loaded_bytes = torch.cuda.memory_allocated(runner.backbone.device)


# ---- engines over one model ---------------------------------------------------------------------------------------

class Setup:
    """What every section shares: device, shapes, the tiny release (tokenizer, processor)."""

    def __init__(self, args):
        from clef_engine.tiny import build_tiny_release

        self.smoke = args.smoke
        self.decide = not args.no_decide
        self.device = torch.device(args.device)
        self.scale = 16 if self.smoke else 1  # request lengths divided by this in the smoke run
        self.tiny = build_tiny_release(Path(tempfile.mkdtemp(prefix="clef-bench-tiny-")))


def make_engine(setup: Setup, model, head, head_config, config_json: dict, precision: str, **options):
    """A bf16 engine with the default configuration over `model`, converted to FP8 (`to_fp8`) for precision "fp8".
    No background warm-up: the kernels are chosen as the engine is built (see PackedRunner)."""
    import clef_engine
    from clef_engine.config import EngineConfig
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor

    checked = Release(path=setup.tiny, source=f"clef-27b-shaped-random-{precision}", revision=None,
                      config=config_json, head_config=head_config, weight_files=())
    config = EngineConfig.resolve(device=str(setup.device), dtype="bfloat16", warm_up=False, **options)
    engine = clef_engine.Engine(checked, model, head, Encoder(load_processor(checked)), config=config)
    if precision == "fp8":
        to_fp8(engine)
    return engine


def fp8_kernels(engine) -> dict[str, str]:
    """Which FP8 GEMM and norm answer (a plain one where the CUDA one failed its check, and why); {} for bf16."""
    backbone = engine.runner.backbone
    return backbone.fp8.describe() if isinstance(backbone, Fp8Backbone) else {}


def free() -> None:
    """Memory of what nothing references any more (engines hold reference cycles: collected, not just dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def close_big_engine() -> None:
    if Big.engine is not None:
        Big.engine.close()
        Big.engine = None
    free()


# ---- the measurements -----------------------------------------------------------------------------------------------

def batch_requests(setup: Setup, engine, count: int) -> tuple[list[dict], dict]:
    rng = random.Random(7)
    schema = build.schema(4, 3, 4, noul_every=4)
    return [build.sized_request(engine, rng.randint(700, 1300) // setup.scale, schema, seed=7000 + i)
            for i in range(count)], schema


def batch_run(setup: Setup, engine) -> dict:
    """The whole case set once through `decide_many`, untimed (as bench/user_paths.py's batch_run does before its
    workbench run: every pack length's Triton compiles and autotunes happen there, in either precision), then the
    case set through the JobRunner (tokens/s of the whole run)."""
    cases = 24 if setup.smoke else BATCH_CASES
    requests, schema = batch_requests(setup, engine, cases)
    t0 = time.perf_counter()
    engine.decide_many([dict(r, state=f"warm {r['state']}") for r in requests])
    warm_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as folder:
        seconds, tokens, progress = build.store_run(engine, requests, schema, Path(folder) / "w.sqlite3")
    return {"tokens_per_s": round(tokens / seconds), "cases": cases, "tokens": tokens, "seconds": round(seconds, 2),
            "warm_up_batch_s": round(warm_s, 2), "run": progress}


def latency_requests(setup: Setup, engine) -> dict[str, list[dict]]:
    rng = random.Random(12)
    samples = 3 if setup.smoke else LATENCY_SAMPLES
    return {name: [build.sized_request(engine, rng.randint(low, high) // setup.scale,
                                       build.schema(4, 3, 100_000 * (i + 1) + int(name), noul_every=4),
                                       seed=100_000 * (i + 1) + int(name)) for i in range(samples)]
            for name, (low, high) in LATENCY_BUCKETS.items()}


def latencies(engine, requests: dict[str, list[dict]]) -> dict:
    """`decide` wall times per length bucket: each request decided once untimed (its length's CUDA graph and its
    schema's head graph are captured then; below the state cache's least prefix nothing is cached), then timed."""
    out = {}
    for name, bucket in requests.items():
        if left() < 20:
            results["detail"]["errors"][f"latency_{name}"] = f"skipped: {left():.0f} s left"
            continue
        for request in bucket:
            engine.decide(request)
        times, answers, tokens = [], [], []
        for request in bucket:
            t0 = time.perf_counter()
            response = engine.decide(request)
            times.append(round((time.perf_counter() - t0) * 1000, 2))
            answers.append(response["answers"])
            tokens.append(response["usage"]["input_tokens"])
        out[name] = {"p50_ms": round(statistics.median(times), 2), "ms": times, "tokens": tokens, "answers": answers}
    return out


def answer_distance(a: list[dict], b: list[dict]) -> dict:
    """max |Δp| and argmax flips between two runs' System One answers of the same requests."""
    worst, flips, questions = 0.0, 0, 0
    for answers_a, answers_b in zip(a, b, strict=True):
        for qid, x in answers_a.items():
            y = answers_b[qid]
            px = x["probabilities"] if "probabilities" in x else {"true": x["noul"], "false": 1 - x["noul"]}
            py = y["probabilities"] if "probabilities" in y else {"true": y["noul"], "false": 1 - y["noul"]}
            worst = max(worst, max(abs(px[k] - py[k]) for k in px))
            flips += max(px, key=px.get) != max(py, key=py.get)
            questions += 1
    return {"max_dp": round(worst, 4), "flips": flips, "questions": questions}


def weights_gib(engine) -> float:
    return build.gib(weight_bytes(engine.runner.model, engine.runner.head))


class Big:
    """The Clef-27B-shaped model and its engines, across the bf16 and fp8 sections."""

    model = head = head_config = config_json = None
    engine = None
    latency_requests: dict | None = None
    bf16_answers: dict | None = None


def build_big(setup: Setup) -> None:
    free()  # what an earlier section (fidelity, when run first) left
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config_json = build.clef_config("clef", setup.tiny)
    if setup.smoke:
        build.scale_down(config_json)
    t0 = time.perf_counter()
    Big.model = build.build_model(config_json, device=str(setup.device))
    Big.head, Big.head_config = build.build_head(config_json["text_config"]["hidden_size"], device=str(setup.device),
                                                 width=64 if setup.smoke else 1024)
    Big.config_json = config_json
    results["detail"]["build_s"] = round(time.perf_counter() - t0, 1)
    say("built the", "scaled-down" if setup.smoke else "Clef-27B-shaped", "model")


def measure_engine(setup: Setup, precision: str) -> dict:
    """Batch and latency of one engine over Big.model; its figures go under detail[precision]."""
    detail = results["detail"].setdefault(precision, {})
    t0 = time.perf_counter()
    Big.engine = engine = make_engine(setup, Big.model, Big.head, Big.head_config, Big.config_json, precision)
    detail["engine_s"] = round(time.perf_counter() - t0, 1)
    detail["precision"] = precision
    detail["kernels"] = engine.runner.info()["kernels"].get("packed") | fp8_kernels(engine)
    detail["weights_gib"] = weights_gib(engine)
    detail["memory_loaded_gib"] = build.gib(engine.loaded_bytes)
    say(precision, "engine ready in", detail["engine_s"], "s; weights", detail["weights_gib"], "GiB")
    save()
    detail["batch_run"] = batch_run(setup, engine)
    say(precision, "batch:", detail["batch_run"]["tokens_per_s"], "tokens/s")
    save()
    timed = {}
    if setup.decide:
        if Big.latency_requests is None:
            Big.latency_requests = latency_requests(setup, engine)
        timed = latencies(engine, Big.latency_requests)
        detail["decide"] = {name: {k: v for k, v in row.items() if k != "answers"} for name, row in timed.items()}
        say(precision, "decide p50:", {name: row["p50_ms"] for name, row in timed.items()})
    if setup.device.type == "cuda":
        detail["memory_peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
    detail["scheduler"] = vars(engine.scheduler.stats).copy()
    return {name: row["answers"] for name, row in timed.items()}


@section("bf16", needs_s=90)
def bf16_section(setup: Setup) -> None:
    if Big.model is None:
        build_big(setup)
    Big.bf16_answers = measure_engine(setup, "bf16")
    results["fp8"]["bf16_batch_tokens_per_s"] = results["detail"]["bf16"]["batch_run"]["tokens_per_s"]


@section("fp8", needs_s=90)
def fp8_section(setup: Setup) -> None:
    if Big.model is None:
        build_big(setup)
    close_big_engine()  # its fused bf16 weights go as the next engine re-fuses the modules' views and quantizes them
    answers = measure_engine(setup, "fp8")
    detail = results["detail"]["fp8"]
    say("fp8 kernels:", {k: v for k, v in detail["kernels"].items() if k.startswith("fp8.")})
    fp8 = results["fp8"]
    fp8["fp8_batch_tokens_per_s"] = detail["batch_run"]["tokens_per_s"]
    for name in LATENCY_BUCKETS:
        fp8[f"p50_{name}_ms"] = detail.get("decide", {}).get(name, {}).get("p50_ms")
    fp8["weights_gib"] = detail["weights_gib"]
    if fp8.get("bf16_batch_tokens_per_s"):
        fp8["batch_speedup"] = round(fp8["fp8_batch_tokens_per_s"] / fp8["bf16_batch_tokens_per_s"], 3)
    if Big.bf16_answers:  # the same requests, the same weights: how far FP8 moves the answers from bf16's
        detail["vs_bf16"] = {name: answer_distance(answers[name], Big.bf16_answers[name])
                             for name in answers if name in Big.bf16_answers}


@section("fidelity", needs_s=120)
def fidelity_section(setup: Setup) -> None:
    """Distances from the float32 truth (bench/fidelity.py's records and comparison) of ours in bf16 and in fp8."""
    from bench import fidelity

    close_big_engine()
    Big.model = Big.head = None
    free()
    shape = "fp8-smoke" if setup.smoke else "flash"
    fidelity.SHAPES.setdefault("fp8-smoke", SMOKE_FIDELITY_SHAPE)
    sizes = fidelity.SHAPES[shape]
    records = SMOKE_RECORDS if setup.smoke else FIDELITY_RECORDS
    t0 = time.perf_counter()
    config_json = fidelity.shape_config(shape, setup.tiny)
    model = build.build_model(config_json, device=str(setup.device), seed=0)
    head, head_config = build.build_head(sizes["hidden"], device=str(setup.device), seed=1, width=sizes["head_width"])
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor
    from clef_engine.protocol import prepare

    checked = Release(path=setup.tiny, source=f"{shape}-shaped-random", revision=None, config=config_json,
                      head_config=head_config, weight_files=())
    encoder = Encoder(load_processor(checked))
    rng = random.Random(0)
    low, high = sizes["state_tokens"]
    encoded = [encoder.encode(prepare(fidelity.varied_request(rng, rng.randint(low, high)), max_length=2**31 - 1))
               for _ in range(records)]
    truth_model, truth_head = copy.deepcopy(model).float(), copy.deepcopy(head).float()
    order = sorted(range(records), key=lambda i: len(encoded[i]))  # padded batches of similar lengths: less padding
    with fidelity._NoTF32():
        by_length = fidelity.release_path(truth_model, truth_head, encoder, torch.float32, [encoded[i] for i in order])
    truth = [None] * records
    for i, answer in zip(order, by_length):
        truth[i] = answer
    del truth_model, truth_head, by_length
    free()
    truth_s = round(time.perf_counter() - t0, 1)
    say("float32 truth of", records, "records in", truth_s, "s")
    detail = {"shape": shape, "records": records, "truth_s": truth_s,
              "questions": sum(len(r.questions) for r in encoded),
              "options": sum(len(s) for r in encoded for s in r.option_spans),
              "tokens": {"min": min(map(len, encoded)), "max": max(map(len, encoded)),
                         "mean": round(sum(map(len, encoded)) / records)}}
    results["detail"]["fidelity"] = detail
    save()
    for precision in ("bf16", "fp8"):  # bf16 first: fp8 quantizes the model in place
        if left() < 30:
            results["detail"]["errors"][f"fidelity_{precision}"] = f"skipped: {left():.0f} s left"
            continue
        t0 = time.perf_counter()
        engine = make_engine(setup, model, head, head_config, config_json, precision, cuda_graphs=False)
        try:
            with torch.inference_mode():
                ours = [engine.runner.forward([r])[0] for r in encoded]
            kernels = fp8_kernels(engine)
        finally:
            engine.close()
            del engine
            free()
        distance = fidelity.compare(ours, truth)
        distance["seconds"] = round(time.perf_counter() - t0, 1)
        if kernels:
            distance["kernels"] = kernels
        detail[precision] = distance
        say(precision, "vs float32:", {k: v for k, v in distance.items() if k != "flip_margins"})
        save()
    detail["truth_top2_gap_smallest"] = fidelity.top_two_gaps(truth)[:10]
    if "fp8" in detail:
        fp8 = detail["fp8"]
        margin = max(fp8["flip_margins"], default=0.0)
        results["fp8"].update(max_dp=fp8["max_dp"], max_flip_margin=margin, flips=fp8["flips"],
                              questions=detail["questions"], scheme=SCHEME,
                              gate_met=fp8["max_dp"] <= GATE_MAX_DP and margin <= GATE_FLIP_MARGIN,
                              fidelity_shape=(f"{shape} (random weights; the truth is the release path in float32; "
                                              "Clef-27B's float32 truth does not fit next to its bf16 copy on one "
                                              "H200)" if not setup.smoke else f"{shape} (smoke)"))


@section("long")
def long_section(path: Path | None) -> None:
    if path is None:
        raise ValueError("--sections long needs --long-results FILE (bench/long_records.py's output)")
    long_records = json.loads(path.read_text())
    results["long"] = long_records.get("long") or {}
    results["p95_over_p50_16k"] = long_records.get("p95_over_p50_16k")
    results["detail"]["long_records"] = {"source": str(path), "detail": long_records.get("detail")}


def main(argv: list[str] | None = None) -> int:
    global OUT, DEADLINE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sections", default="bf16,fp8,fidelity",
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default bf16,fp8,fidelity)")
    parser.add_argument("--long-results", type=Path, help="bench/long_records.py's results, for --sections long")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts: the whole run in a minute or two")
    parser.add_argument("--no-decide", action="store_true",
                        help="leave out the decide timings of the bf16 and fp8 sections (batch speed only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline-s", type=float, default=None, help="default: BENCH_DEADLINE_S or 560")
    args = parser.parse_args(argv)
    import os

    DEADLINE = STARTED + (args.deadline_s or float(os.environ.get("BENCH_DEADLINE_S", "560")))
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; use {', '.join(SECTIONS)}")
    if args.device == "cpu" and not args.smoke and set(chosen) - {"long"}:
        parser.error("on a CPU only --smoke runs (the full shapes need the H200)")
    OUT = args.out
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if OUT.exists():  # another call's sections: kept, the ones run now replace theirs
        previous = json.loads(OUT.read_text())
        results.update({key: value for key, value in previous.items() if key != "detail"})
        results["detail"].update({key: value for key, value in previous.get("detail", {}).items() if key != "errors"})
        results["detail"]["errors"].update(previous.get("detail", {}).get("errors", {}))
        for name in chosen:
            results["detail"]["errors"] = {key: value for key, value in results["detail"]["errors"].items()
                                           if not key.startswith(name)}
    runs = results["detail"].setdefault("runs", [])
    runs.append({"command": " ".join(sys.argv), "sections": chosen, "smoke": args.smoke})
    if "long" in chosen:
        long_section(args.long_results)
    if set(chosen) - {"long"}:
        setup = Setup(args)
        if setup.device.type == "cuda":
            import transformers

            runs[-1]["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                       "gpu": torch.cuda.get_device_name()}
        steps = {"bf16": bf16_section, "fp8": fp8_section, "fidelity": fidelity_section}
        for name in chosen:
            if name in steps:
                steps[name](setup)
        close_big_engine()
    runs[-1]["elapsed_s"] = round(time.perf_counter() - STARTED, 1)
    save()
    build.print_summary(results)
    return 1 if results["detail"]["errors"] and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
