"""The FP8 experiment (bench/lengths_and_precision.py): block-scaled W8A8 FP8 for the in-layer projections of a
loaded bf16 engine. Not a product setting: it missed its fidelity gate; these tests keep the experiment sound.

On the CPU the plain PyTorch versions run (the block GEMM, the quantizing norm, the whole packed backbone, its
transformers modules and an engine converted to FP8). The CUDA kernels (`torch._scaled_mm` with blockwise scales, the
fused Triton norm) are checked by `select_fp8_kernels` before they are taken; the tests marked `cuda` run those checks
and an FP8 backbone on a GPU and are skipped only where no CUDA GPU is visible. The Triton norm also runs here in
Triton's CPU interpreter."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bench import lengths_and_precision as FP8
from clef_engine.fast import kernels as K
from clef_engine.fast.packed import PackedBackbone
from clef_engine.fast.segments import make_segments
from tests.support import REPO

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |x| (3 mantissa bits), subnormals included."""
    return 0.125 * x.abs() + 2.0 ** -9


# ---- the plain FP8 functions -------------------------------------------------------------------------------------

def groups_apart(rows: int, width: int) -> torch.Tensor:
    """Random [rows, width] whose 128-column groups are up to six decades apart, and apart again from row to row."""
    scale = torch.logspace(-3, 3, FP8._blocks(width)).repeat_interleave(FP8.BLOCK)[:width]
    return torch.randn(rows, width) * scale * torch.rand(rows, 1)


def test_activations_quantize_per_token_per_128_columns_with_each_groups_amax_at_448():
    torch.manual_seed(0)
    x = groups_apart(9, 320)  # two full groups and a partial one
    x[4, 128:256] = 0  # a zero group stays zero, with a finite scale
    blocks = FP8.quantize_blocks_torch(x)
    assert blocks.values.dtype == torch.float8_e4m3fn and blocks.values.shape == (9, 320)
    assert blocks.scales.shape == (9, 3) and blocks.scales.stride() == (1, 9)  # column-major, as _scaled_mm wants
    assert torch.isfinite(blocks.scales).all() and (blocks.values[4, 128:256].float() == 0).all()
    amax = blocks.values.float().abs()
    group_amax = torch.stack([amax[:, start:start + 128].amax(-1) for start in (0, 128, 256)], 1)
    live = torch.ones_like(group_amax, dtype=torch.bool)
    live[4, 1] = False
    assert (group_amax[live] == 448).all()  # every group uses e4m3's whole range, the small ones too
    scaled = x / FP8._expand(blocks.scales, 9, 320, row_block=1)
    assert ((blocks.values.float() - scaled).abs() <= e4m3_step(scaled) / 2 + 1e-6).all()  # rounded to nearest
    # the round trip: each element within half a step of its group's range, however small the group
    error = (blocks.dequantize() - x).abs() / FP8._expand(blocks.scales * 448, 9, 320, row_block=1)
    assert error.max() <= 1 / 28  # half of e4m3's largest step (32) over 448


def test_weights_quantize_in_128x128_blocks_and_an_outlier_costs_only_its_block():
    torch.manual_seed(1)
    weight = torch.randn(300, 384) * 0.02  # 3 x 3 blocks, the last row of blocks partial
    weight[5, 7] = 30.0  # an outlier, in block (0, 0)
    quantized = FP8.quantize_weight(weight)
    assert quantized.values.shape == (300, 384) and quantized.scales.shape == (3, 3)
    assert quantized.scales.t().stride() == (1, 4)  # block scale rows padded to 4: cuBLAS's 128x128 layout
    assert quantized.scales[0, 0] == pytest.approx(30.0 / 448)
    error = (quantized.dequantize() - weight).abs()
    per_block = [[error[r:r + 128, c:c + 128].max().item() for c in (0, 128, 256)] for r in (0, 128, 256)]
    assert per_block[0][0] <= 30.0 / 28  # the outlier's block: coarse
    others = [e for r, row in enumerate(per_block) for c, e in enumerate(row) if (r, c) != (0, 0)]
    rest = weight.clone()
    rest[:128, :128] = 0
    assert max(others) <= rest.abs().max().item() / 28  # every other block as fine as without the outlier
    sub, skip = quantized.rows(130, 200)  # a projection inside a fused weight, not on a block boundary
    assert skip == 2 and sub.values.shape == (72, 384) and sub.scales.shape == (1, 3)
    assert torch.equal(sub.dequantize()[skip:], quantized.dequantize()[130:200])


def test_the_plain_block_gemm_is_the_dequantized_product_and_within_fp8s_error_of_float32():
    torch.manual_seed(2)
    x, weight = groups_apart(37, 384), torch.randn(200, 384) * 0.02
    blocks, quantized = FP8.quantize_blocks_torch(x), FP8.quantize_weight(weight)
    got = FP8.linear_fp8_torch(blocks, quantized)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 200)
    exact = blocks.dequantize() @ quantized.dequantize().t()
    assert torch.allclose(got.float(), exact, rtol=8e-3, atol=1e-6 * exact.abs().max().item())  # one bf16 rounding
    truth = x @ weight.t()
    error = ((got.float() - truth).norm() / truth.norm()).item()
    # e4m3 rounds each operand to 3 mantissa bits (relative error up to 1/16, ~1/40 rms); the product's error is
    # about that of the two operands together
    assert 0.005 < error < 0.06, error


def test_the_quantizing_norm_equals_quantizing_the_plain_norm():
    """rms_norm_fp8 is kernels.rms_norm_torch in float32, quantized in blocks; the residual stream it returns is the
    plain float32 sum."""
    torch.manual_seed(3)
    x, residual, gain = torch.randn(11, 320).bfloat16(), torch.randn(11, 320) * 3, 1 + 0.1 * torch.randn(320)
    blocks, stream = FP8.rms_norm_fp8_torch(x, gain, 1e-6, residual)
    normed, want_stream = K.rms_norm_torch(x, gain, 1e-6, residual, torch.float32)
    assert torch.equal(stream, want_stream)
    assert FP8.blocks_differ(blocks, FP8.quantize_blocks_torch(normed)) is None


def test_blocks_differ_tells_one_rounding_step_from_a_wrong_kernel():
    torch.manual_seed(4)
    want = FP8.quantize_blocks_torch(torch.randn(8, 256))
    nudged = want.values.clone()
    column = int((want.values[0].float().abs() < 400).nonzero()[0])  # not a group's amax (448: no step above it)
    nudged.view(torch.uint8)[0, column] += 1  # the next e4m3 magnitude (sign and magnitude bits)
    assert (nudged[0, column].float() - want.values[0, column].float()).abs() > 0
    assert FP8.blocks_differ(FP8.Fp8Blocks(nudged, want.scales), want) is None  # one element one step off: rounding
    wrong = FP8.Fp8Blocks((want.values.float() * 0.5).to(FP8.E4M3), want.scales)
    assert "more than one e4m3 step" in FP8.blocks_differ(wrong, want)
    assert "scales differ" in FP8.blocks_differ(FP8.Fp8Blocks(want.values, want.scales * 1.01), want)
    row_major = FP8.Fp8Blocks(want.values, want.scales.contiguous())
    assert "column-major" in FP8.blocks_differ(row_major, want)


def test_a_scaled_mm_that_fails_its_check_leaves_the_plain_gemm_with_the_reason(monkeypatch):
    """On the CPU torch has no blockwise _scaled_mm: the check says so for every layout instead of raising, and on
    CUDA the same answer keeps the plain GEMM (select_fp8_kernels), named in the FP8 kernels' description."""
    layout, problems = FP8.scaled_mm_matches(torch.device("cpu"))
    assert layout is None and problems.count("torch._scaled_mm as linear_fp8_scaled_mm") == 4
    monkeypatch.setattr(FP8, "triton_fp8_matches_torch", lambda device: None)
    monkeypatch.setattr(FP8, "scaled_mm_matches", lambda device: (None, "torch._scaled_mm failed: no blockwise recipe"))
    kernels = FP8.select_fp8_kernels(torch.device("cuda"))
    assert kernels.rms_norm is FP8.rms_norm_fp8_triton and kernels.linear is FP8.linear_fp8_torch
    described = kernels.describe()
    assert described["fp8.linear"] == "linear_fp8_torch"
    assert described["fp8.linear_fallback"] == "torch._scaled_mm failed: no blockwise recipe"


def test_the_check_takes_the_first_scaled_mm_layout_torch_accepts_and_it_computes_the_block_gemm(monkeypatch):
    """A torch whose blockwise check wants what the documented layout is not (here: rows in multiples of 16 and the
    weight scales row-major) gets the layout that passes, with the refusals noted (the first in full); that layout
    pads a pack of any length and answers for its own rows only: the plain block GEMM's product."""

    def strict_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        if a.shape[0] % 16 or scale_b.stride(1) != 1:
            raise RuntimeError("Invalid scaling configuration. " + "For BlockWise 128x128 scaling ... " * 20)
        groups = scale_a.repeat_interleave(FP8.BLOCK, 1)[:, :a.shape[1]]
        blocks = scale_b.repeat_interleave(FP8.BLOCK, 0)[:b.shape[0]].repeat_interleave(FP8.BLOCK, 1)[:, :b.shape[1]]
        return torch.mm(a.float() * groups, b.float() * blocks).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", strict_scaled_mm)
    layout, problems = FP8.scaled_mm_matches(torch.device("cpu"))
    assert layout == FP8.ScaledMm(16, weight_scales_row_major=True)
    refusals = problems.split("; ")
    assert len(refusals) == 3 and all("Invalid scaling configuration" in refusal for refusal in refusals)
    assert len(refusals[0]) > 500 and max(len(refusal) for refusal in refusals[1:]) <= 300
    monkeypatch.setattr(FP8, "triton_fp8_matches_torch", lambda device: None)
    monkeypatch.setattr(FP8, "scaled_mm_matches", lambda device: (layout, problems))  # as on a GPU with that torch
    kernels = FP8.select_fp8_kernels(torch.device("cuda"))
    assert kernels.linear == layout and "rows to a multiple of 16" in kernels.describe()["fp8.linear"]
    assert kernels.describe()["fp8.linear_fallback"] == problems

    torch.manual_seed(1)
    for rows in (1, 16, 45):
        x = FP8.quantize_blocks_torch(groups_apart(rows, 256))
        weight = FP8.quantize_weight(groups_apart(160, 256))  # a partial last block of outputs
        got, want = layout(x, weight), FP8.linear_fp8_torch(x, weight)
        assert got.shape == (rows, 160) and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)


# ---- a loaded bf16 engine converted to FP8 on the CPU (plain kernels) ------------------------------------------------

@pytest.fixture(scope="module")
def bf16_engine(tiny_release):
    import clef_engine

    engine = clef_engine.load(tiny_release, device="cpu", dtype="bfloat16")
    yield engine
    engine.close()


def records(engine):
    words = "the invoice ticket customer payment refund amount total due date vendor alert".split()
    requests = [{"state": " ".join(words[(i * 7 + s) % 12] for i in range(n)),
                 "questions": {"paid": {"type": "noul", "instructions": "Is it paid?"},
                               "tone": {"type": "choice", "instructions": "Tone?",
                                        "criteria": {"calm": None, "angry": None, "neutral": None}}}}
                for s, n in enumerate((3, 150, 40))]
    return [engine.encode(r) for r in requests]


RESIDUAL_PROJECTIONS = (("mlp", "down_proj"), ("linear_attn", "out_proj"), ("self_attn", "o_proj"))


def residual_weights(layers) -> dict[tuple[int, str], torch.Tensor]:
    return {(index, child): getattr(getattr(layer, parent), child).weight
            for index, layer in enumerate(layers) for parent, child in RESIDUAL_PROJECTIONS if hasattr(layer, parent)}


@pytest.fixture(scope="module")
def fp8_engine(tiny_release):
    import clef_engine

    engine = clef_engine.load(tiny_release, device="cpu", dtype="bfloat16")
    FP8.to_fp8(engine)
    yield engine
    engine.close()


def test_to_fp8_quantizes_the_in_layer_projections_and_leaves_the_residual_ones_bf16(bf16_engine, fp8_engine):
    text = fp8_engine.runner.model.model.language_model
    backbone = fp8_engine.runner.backbone
    assert isinstance(backbone, FP8.Fp8Backbone)
    for layer in text.layers:  # q/k/v, in_proj, gate/up FP8, the transformers modules included
        assert isinstance(layer.mlp.gate_proj, FP8.Fp8Linear) and isinstance(layer.mlp.up_proj, FP8.Fp8Linear)
        assert sum(isinstance(m, FP8.Fp8Linear) for m in layer.modules()) in (2 + 4, 2 + 3)
    after = residual_weights(text.layers)
    before = residual_weights(bf16_engine.runner.model.model.language_model.layers)
    assert len(after) == 2 * len(text.layers)  # down_proj and one of out_proj / o_proj in every layer
    for key, weight in after.items():  # the residual-feeding projections: untouched bf16, used as they are
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, before[key]), key
    fast = backbone.layers[0]
    assert isinstance(fast.gate_up, FP8.Fp8Weight) and fast.down.data_ptr() == after[(0, "down_proj")].data_ptr()
    # the fused weight and the modules share one storage: the gate_proj module is the first rows of gate_up
    assert text.layers[0].mlp.gate_proj.weight_fp8.data_ptr() == fast.gate_up.values.data_ptr()

    encoded = records(bf16_engine)
    ids = torch.tensor([t for r in encoded for t in r.input_ids])
    segments = make_segments([len(r) for r in encoded], torch.device("cpu"))
    want, _ = bf16_engine.runner.backbone.forward(ids, segments)
    got, _ = backbone.forward(ids, segments)
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert 0 < error < 0.1, error  # quantized (not the bf16 path), and close to it

    # the padded path (records with media, packed=False) runs the Fp8Linear modules: the same FP8 model. The tiny
    # in_proj_b and in_proj_a start inside a 128-row block of the fused in_proj: their modules skip its first rows
    assert text.layers[0].linear_attn.in_proj_b.skip > 0
    padded = text(input_ids=torch.tensor([encoded[1].input_ids]), use_cache=False)
    alone, _ = backbone.forward(torch.tensor(encoded[1].input_ids), make_segments([len(encoded[1])], "cpu"))
    drift = ((padded.last_hidden_state[0].float() - alone.float()).norm() / alone.float().norm()).item()
    assert drift < 0.05, drift  # the same weights and quantization; the residual stream rounds differently


def answer_gaps(a: dict, b: dict) -> list[float]:
    """|Δp| of every option of two responses' answers to the same questions."""
    def probabilities(answer: dict) -> dict:
        return answer["probabilities"] if "probabilities" in answer else {"true": answer["noul"]}
    return [abs(probabilities(a[q])[k] - probabilities(b[q])[k]) for q in a for k in probabilities(a[q])]


def test_an_engine_converted_to_fp8_answers_close_to_bf16_and_float32(fp8_engine, bf16_engine, tiny_engine):
    """The whole engine on the tiny release in FP8 (the plain block GEMM on the CPU): every answer near bf16's and
    float32's, and not bf16's itself."""
    assert FP8.fp8_kernels(fp8_engine)["fp8.linear"] == "linear_fp8_torch" and FP8.fp8_kernels(bf16_engine) == {}
    requests = [{"state": text, "questions": {
        "paid": {"type": "noul", "instructions": "Is it paid?"},
        "tone": {"type": "choice", "instructions": "Tone?",
                 "criteria": {"calm": None, "angry": None, "neutral": None}}}}
        for text in ("the invoice is paid", "refund the customer " * 40, "late delivery, angry vendor " * 12)]
    fp8 = [fp8_engine.decide(r)["answers"] for r in requests]
    bf16 = [bf16_engine.decide(r)["answers"] for r in requests]
    float32 = [tiny_engine.decide(r)["answers"] for r in requests]
    from_bf16 = [gap for a, b in zip(fp8, bf16) for gap in answer_gaps(a, b)]
    from_float32 = [gap for a, b in zip(fp8, float32) for gap in answer_gaps(a, b)]
    assert max(from_bf16) > 0  # FP8 answered, not bf16
    assert max(from_bf16) < 0.1 and max(from_float32) < 0.1, (max(from_bf16), max(from_float32))


def test_scaled_mm_shapes_are_checked_before_quantizing(bf16_engine):
    """The tiny release is 64 wide (the blockwise torch._scaled_mm wants in features in whole groups of 128) and its
    Gated DeltaNet b/a projections have 4 outputs: the refusal names them, and nothing was quantized."""
    kernels = FP8.Fp8Kernels(linear=FP8.linear_fp8_scaled_mm)
    with pytest.raises(ValueError, match=r"multiples of 128 .*layer 0 gate_proj \[\d+, 64\]"):
        FP8.to_fp8(bf16_engine, kernels)
    assert not isinstance(bf16_engine.runner.backbone, FP8.Fp8Backbone)
    assert not isinstance(bf16_engine.runner.model.model.language_model.layers[0].mlp.gate_proj, FP8.Fp8Linear)


# ---- CUDA: the kernels' checks, and an FP8 backbone on the GPU -------------------------------------------------------

@cuda
def test_scaled_mm_and_the_fused_fp8_kernels_match_their_torch_versions_on_the_gpu():
    assert FP8.scaled_mm_matches(torch.device("cuda"))[0] is not None
    assert FP8.triton_fp8_matches_torch(torch.device("cuda")) is None


@cuda
def test_the_fp8_backbone_on_the_gpu_matches_the_plain_fp8_backbone(tiny_release):
    from bench import build

    config = build.clef_config("clef-flash", tiny_release)
    build.scale_down(config)  # every projection a multiple of 16, as _scaled_mm wants
    model = build.build_model(config, device="cuda")
    bf16_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    fused = FP8.fp8_backbone(PackedBackbone(model), model)  # _scaled_mm and the Triton norm, checked first
    assert isinstance(fused.fp8.linear, FP8.ScaledMm)
    plain = FP8.fp8_backbone(PackedBackbone(plain_model), plain_model, FP8.Fp8Kernels())
    ids = torch.randint(0, 2000, (300,), device="cuda")
    segments = make_segments([100, 200], torch.device("cuda"))
    got, _ = fused.forward(ids, segments)
    want, _ = plain.forward(ids, segments)
    reference, _ = PackedBackbone(bf16_model).forward(ids, segments)

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # The fused norm and _scaled_mm round and sum in another order than the plain path (a value on a rounding boundary
    # lands one e4m3 step away), so the two FP8 paths differ a little: the tolerance is FP8's own distance from the
    # bf16 backbone, not a fixed one.
    fp8_distance = distance(want, reference)
    assert distance(got, reference) <= 1.1 * fp8_distance, (distance(got, reference), fp8_distance)
    assert distance(got, want) <= fp8_distance, (distance(got, want), fp8_distance)


# ---- the fused Triton kernels in Triton's CPU interpreter ------------------------------------------------------------

@pytest.mark.slow
def test_the_fused_fp8_triton_norm_in_the_interpreter():
    """Triton's interpreter runs float8 but rounds a value that carries into the next power of two one binade low
    (124.5 -> 64 where e4m3 has 128; the GPU's conversion is right): those aside, values match within one e4m3 step
    on at most 1% of the elements (as `fp8.blocks_differ` allows on the GPU), the scales (their column-major layout
    too) and the residual stream to float32 rounding, so the kernel's groups, masks, amax and scales are checked
    here, at widths of whole groups, a partial last group, and less than one group."""
    code = textwrap.dedent("""
        import torch
        from bench import lengths_and_precision as FP8

        def check(got, want):
            assert got.scales.stride() == want.scales.stride(), (got.scales.stride(), want.scales.stride())
            assert torch.allclose(got.scales, want.scales, rtol=1e-5, atol=0), (got.scales / want.scales).max()
            a, b = got.values.float(), want.values.float()
            differ = a != b
            carried = (b.abs() == 2 ** torch.floor(torch.log2(b.abs().clamp(min=2 ** -9)))) & (a == b / 2)
            rounded = (a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2 ** -9  # one step
            assert not (differ & ~carried & ~rounded).any(), (a[differ & ~carried & ~rounded], b[differ & ~carried])
            assert int((differ & ~carried).sum()) <= a.numel() // 100, int((differ & ~carried).sum())

        torch.manual_seed(0)
        for width in (256, 320, 64):
            groups = (0.01 + 10 * torch.rand(1, -(-width // 128))).repeat_interleave(128, 1)[:, :width]
            x = (torch.randn(45, width) * groups).bfloat16()
            residual, gain = torch.randn(45, width) * 4, 1 + 0.1 * torch.randn(width)
            for previous in (None, residual):
                (got, got_sum), (want, want_sum) = (fn(x, gain, 1e-6, previous)
                                                    for fn in (FP8.rms_norm_fp8_triton, FP8.rms_norm_fp8_torch))
                assert torch.allclose(got_sum, want_sum, rtol=1e-6, atol=1e-6)
                check(got, want)
        print("interpreted ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreted ok" in result.stdout
