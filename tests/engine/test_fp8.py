"""precision="fp8": W8A8 FP8 projections (clef_engine/fast/fp8.py).

On the CPU the plain PyTorch versions run (the FP8 GEMM, the quantizing norms, the whole packed backbone and its
transformers modules in FP8). The CUDA kernels (`torch._scaled_mm`, the fused Triton kernels) are checked by the
engine at start-up (`fp8.fp8_matches_torch`); the tests marked `cuda` run those checks and an FP8 backbone on a GPU
and are skipped only where no CUDA GPU is visible. The Triton kernels also run here in Triton's CPU interpreter."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from clef_engine.config import EngineConfig
from clef_engine.errors import ReleaseError
from clef_engine.fast import fp8 as FP8
from clef_engine.fast import kernels as K
from clef_engine.fast.packed import PackedBackbone
from clef_engine.fast.segments import make_segments
from tests.support import REPO

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (the engine checks these at start-up)")


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |x| (3 mantissa bits), subnormals included."""
    return 0.125 * x.abs() + 2.0 ** -9


# ---- the plain FP8 functions -------------------------------------------------------------------------------------

def test_rows_quantize_to_e4m3_with_their_amax_at_448_and_within_one_step():
    torch.manual_seed(0)
    x = torch.randn(9, 200) * torch.logspace(-3, 3, 9)[:, None]  # rows six decades apart
    x[4] = 0  # a zero row stays zero, with a finite scale
    rows = FP8.quantize_rows_torch(x)
    assert rows.values.dtype == torch.float8_e4m3fn and rows.scales.shape == (9, 1)
    assert torch.isfinite(rows.scales).all() and (rows.values[4].float() == 0).all()
    live = [i for i in range(9) if i != 4]
    assert torch.equal(rows.values[live].float().abs().amax(-1), torch.full((8,), 448.0))
    scaled = x / rows.scales
    assert ((rows.values.float() - scaled).abs() <= e4m3_step(scaled) / 2 + 1e-6).all()  # rounded to nearest


def test_the_plain_fp8_linear_equals_the_dequantized_product():
    torch.manual_seed(1)
    x = FP8.quantize_rows_torch(torch.randn(37, 96) * torch.rand(37, 1) * 5)
    weight = FP8.quantize_weight(torch.randn(48, 96) * 0.02)
    assert weight.values.shape == (48, 96) and weight.scales.shape == (1, 48)
    got = FP8.linear_fp8_torch(x, weight)
    want = F.linear(x.values.float() * x.scales, weight.values.float() * weight.scales.t())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=8e-3, atol=1e-6 * want.abs().max().item())  # one bf16 rounding
    if hasattr(torch, "_scaled_mm"):  # where torch has a CPU _scaled_mm, the start-up check passes here too
        try:
            torch._scaled_mm(x.values[:16, :32], weight.values[:16, :32].t(), scale_a=x.scales[:16],
                             scale_b=weight.scales[:, :16], out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError):
            return
        assert FP8.scaled_mm_matches(torch.device("cpu")) is None


def test_the_quantizing_norm_and_activation_equal_quantizing_the_plain_ones():
    """rms_norm_fp8 / silu_mul_fp8 are kernels.rms_norm_torch / silu_mul in float32, quantized per row; the residual
    stream they return is the plain float32 sum."""
    torch.manual_seed(2)
    x, residual, gain = torch.randn(11, 64).bfloat16(), torch.randn(11, 64) * 3, 1 + 0.1 * torch.randn(64)
    rows, stream = FP8.rms_norm_fp8_torch(x, gain, 1e-6, residual)
    normed, want_stream = K.rms_norm_torch(x, gain, 1e-6, residual, torch.float32)
    assert torch.equal(stream, want_stream)
    assert FP8.rows_differ(rows, FP8.quantize_rows_torch(normed)) is None
    gate_up = torch.randn(11, 2 * 40).bfloat16()
    activated = K.silu_mul_torch(gate_up.float(), 40)
    assert FP8.rows_differ(FP8.silu_mul_fp8_torch(gate_up, 40), FP8.quantize_rows_torch(activated)) is None


def test_rows_differ_tells_one_rounding_step_from_a_wrong_kernel():
    torch.manual_seed(3)
    want = FP8.quantize_rows_torch(torch.randn(8, 128))
    nudged = want.values.clone()
    column = int((want.values[0].float().abs() < 400).nonzero()[0])  # not the row's amax (448: no step above it)
    nudged.view(torch.uint8)[0, column] += 1  # the next e4m3 magnitude (sign and magnitude bits)
    assert (nudged[0, column].float() - want.values[0, column].float()).abs() > 0
    assert FP8.rows_differ(FP8.Fp8Rows(nudged, want.scales), want) is None  # one element one step off: rounding
    wrong = FP8.Fp8Rows((want.values.float() * 0.5).to(FP8.E4M3), want.scales)
    assert "more than one e4m3 step" in FP8.rows_differ(wrong, want)
    assert "scales differ" in FP8.rows_differ(FP8.Fp8Rows(want.values, want.scales * 1.01), want)


# ---- the config ------------------------------------------------------------------------------------------------------

def test_precision_defaults_to_bf16_and_fp8_is_refused_on_the_cpu_with_the_reason():
    assert EngineConfig.resolve(device="cpu", env={}).precision == "bf16"
    assert EngineConfig.resolve(device="cpu", env={"CLEF_PRECISION": "BF16"}).precision == "bf16"
    with pytest.raises(ReleaseError, match=r"precision fp8 cannot run here: it needs a CUDA GPU and the device is cpu"):
        EngineConfig.resolve(device="cpu", precision="fp8", env={})
    with pytest.raises(ReleaseError, match="needs a CUDA GPU"):
        EngineConfig.resolve(device="cpu", env={"CLEF_PRECISION": "fp8"})
    with pytest.raises(ReleaseError, match=r"precision 'int4' is not known: use bf16 or fp8"):
        EngineConfig.resolve(device="cpu", env={"CLEF_PRECISION": "int4"})


def test_serve_takes_precision(tiny_release):
    from clef_engine.serve.cli import main

    with pytest.raises(SystemExit):  # argparse refuses a precision it does not know, before any load
        main(["--model", str(tiny_release), "--precision", "int4"])


# ---- the FP8 backbone on the CPU (plain kernels) ---------------------------------------------------------------------

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


def test_the_fp8_backbone_stays_close_to_bf16_and_holds_no_bf16_projection_weights(bf16_engine):
    engine = bf16_engine
    model = copy.deepcopy(engine.runner.model)
    backbone = PackedBackbone(model, K.Kernels(fp8=FP8.Fp8Kernels()), precision="fp8")
    text = model.model.language_model
    for layer in text.layers:  # every projection is FP8 now, the transformers modules included
        assert isinstance(layer.mlp.down_proj, FP8.Fp8Linear) and isinstance(layer.mlp.gate_proj, FP8.Fp8Linear)
        assert not any(isinstance(m, torch.nn.Linear) for m in layer.modules())
        assert sum(isinstance(m, FP8.Fp8Linear) for m in layer.modules()) in (3 + 4 + 1, 3 + 3 + 1)
    assert isinstance(backbone.layers[0].gate_up, FP8.Fp8Weight)
    # the fused weight and the modules share one storage: the gate_proj module is the first rows of gate_up
    assert text.layers[0].mlp.gate_proj.weight_fp8.data_ptr() == backbone.layers[0].gate_up.values.data_ptr()

    encoded = records(engine)
    ids = torch.tensor([t for r in encoded for t in r.input_ids])
    segments = make_segments([len(r) for r in encoded], torch.device("cpu"))
    want, _ = engine.runner.backbone.forward(ids, segments)
    got, _ = backbone.forward(ids, segments)
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert 0 < error < 0.1, error  # quantized (not the bf16 path), and close to it

    # the padded path (records with media, packed=False) runs the Fp8Linear modules: the same FP8 model
    padded = model.model.language_model(input_ids=torch.tensor([encoded[1].input_ids]), use_cache=False)
    alone, _ = backbone.forward(torch.tensor(encoded[1].input_ids), make_segments([len(encoded[1])], "cpu"))
    drift = ((padded.last_hidden_state[0].float() - alone.float()).norm() / alone.float().norm()).item()
    assert drift < 0.05, drift  # the same weights and quantization; the residual stream rounds differently


def test_an_fp8_backbone_refuses_kernels_without_fp8_slots(bf16_engine):
    model = copy.deepcopy(bf16_engine.runner.model)
    with pytest.raises(ReleaseError, match="FP8 slots"):
        PackedBackbone(model, K.Kernels(), precision="fp8")
    backbone = PackedBackbone(model, K.Kernels(fp8=FP8.Fp8Kernels()), precision="fp8")
    backbone.kernels = K.Kernels()  # a benchmark swapping in a set without FP8 slots
    with pytest.raises(ReleaseError, match="no FP8 slots"):
        backbone.forward(torch.tensor([1, 2, 3]), make_segments([3], "cpu"))


def test_scaled_mm_shapes_are_checked_before_quantizing(bf16_engine):
    """The tiny release's Gated DeltaNet b/a projections have 4 outputs: torch._scaled_mm cannot take them, and the
    refusal names them rather than failing inside the first request."""
    model = copy.deepcopy(bf16_engine.runner.model)
    kernels = K.Kernels(fp8=FP8.Fp8Kernels(linear=FP8.linear_fp8_scaled_mm))
    with pytest.raises(ReleaseError, match=r"multiples of 16.*in_proj_b \[4, 64\]"):
        PackedBackbone(model, kernels, precision="fp8")


# ---- what the engine says --------------------------------------------------------------------------------------------

def test_info_says_which_precision_answers(bf16_engine):
    info = bf16_engine.info()
    assert info["precision"] == "bf16" and "distance_from_float32" not in info


def test_measured_fidelity_comes_from_the_newest_results_file(tmp_path):
    from clef_engine.fp8_fidelity import describe_fidelity, measured_fidelity

    assert measured_fidelity(tmp_path) == "not measured"
    assert describe_fidelity("not measured") == "distance from float32 not measured"
    (tmp_path / "2026-12-01-h200-lengths-and-precision.json").write_text(json.dumps(
        {"fp8": {"max_dp": 0.2, "flips": 9, "max_flip_margin": 0.3, "questions": 240}}))
    (tmp_path / "2026-12-03-h200-lengths-and-precision.json").write_text(json.dumps(
        {"fp8": {"max_dp": 0.031, "flips": 4, "max_flip_margin": 0.012, "questions": 240}}))
    (tmp_path / "2026-12-04-h200-lengths-and-precision.json").write_text(json.dumps({"fp8": {}}))  # not measured
    fidelity = measured_fidelity(tmp_path)
    assert fidelity["max_dp"] == 0.031 and fidelity["gate_met"] is True
    assert fidelity["source"] == "bench/results/2026-12-03-h200-lengths-and-precision.json"
    assert describe_fidelity(fidelity).startswith("max |Δp| 0.031 from float32, 4 of 240 answers flipped (gate met")
    (tmp_path / "2026-12-03-h200-lengths-and-precision.json").unlink()
    assert measured_fidelity(tmp_path)["gate_met"] is False  # 0.2 > 0.05


def test_the_model_manager_loads_in_the_precision_chosen(tmp_path):
    from clef_workbench.model_loader import ModelManager

    calls = []

    class Engine:
        def __init__(self, precision):
            self.precision = precision

        def info(self):
            return {"precision": self.precision}

        def close(self):
            pass

    def loader(source, **options):
        calls.append((source, options))
        return Engine(options.get("precision", "bf16"))

    manager = ModelManager(loader=loader, demo_path=lambda: tmp_path, free_memory=lambda device: 2**50)
    folder = tmp_path / "release"
    folder.mkdir()
    manager._check_memory = lambda source, path: None  # no release files here: the memory check is not the point
    manager.request(str(folder), "fp8")
    manager.wait(30)
    manager.add(str(tmp_path), None)
    manager.wait(30)
    assert calls == [(str(folder), {"precision": "fp8"}), (str(tmp_path), {})]
    assert [m.precision for m in manager.loaded()] == ["fp8", "bf16"]


# ---- CUDA: what the engine checks at start-up, and an FP8 backbone on the GPU ----------------------------------------

@cuda
def test_scaled_mm_and_the_fused_fp8_kernels_match_their_torch_versions_on_the_gpu():
    assert FP8.scaled_mm_matches(torch.device("cuda")) is None
    assert FP8.triton_fp8_matches_torch(torch.device("cuda")) is None


@cuda
def test_the_fp8_backbone_on_the_gpu_matches_the_plain_fp8_backbone(tiny_release):
    from bench import build

    config = build.clef_config("clef-flash", tiny_release)
    build.scale_down(config)  # every projection a multiple of 16, as _scaled_mm wants
    model = build.build_model(config, device="cuda")
    bf16_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    fused = PackedBackbone(model, precision="fp8")  # select_kernels: _scaled_mm and the Triton kernels, checked
    assert fused.kernels.fp8.linear is FP8.linear_fp8_scaled_mm
    plain = PackedBackbone(plain_model, K.Kernels(fp8=FP8.Fp8Kernels()), precision="fp8")
    ids = torch.randint(0, 2000, (300,), device="cuda")
    segments = make_segments([100, 200], torch.device("cuda"))
    got, _ = fused.forward(ids, segments)
    want, _ = plain.forward(ids, segments)
    reference, _ = PackedBackbone(bf16_model).forward(ids, segments)

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # The fused kernels quantize the norm's float32 output where the plain path quantizes it rounded to bf16, so the
    # two FP8 paths round differently: the tolerance is FP8's own distance from the bf16 backbone, not a fixed one.
    fp8_distance = distance(want, reference)
    assert distance(got, reference) <= 1.1 * fp8_distance, (distance(got, reference), fp8_distance)
    assert distance(got, want) <= fp8_distance, (distance(got, want), fp8_distance)


# ---- the fused Triton kernels in Triton's CPU interpreter ------------------------------------------------------------

@pytest.mark.slow
def test_the_fused_fp8_triton_kernels_in_the_interpreter():
    """Triton's interpreter runs float8 but rounds a value that carries into the next power of two one binade low
    (124.5 -> 64 where e4m3 has 128; the GPU's conversion is right): those aside, values match within one e4m3 step
    on at most 1% of the elements (as `fp8.rows_differ` allows on the GPU), the scales and the residual stream to
    float32 rounding, so the kernels' loops, masks, amax and scales are checked here."""
    code = textwrap.dedent("""
        import torch
        from clef_engine.fast import fp8 as FP8

        def check(got, want):
            assert torch.allclose(got.scales, want.scales, rtol=1e-5, atol=0), (got.scales / want.scales).max()
            a, b = got.values.float(), want.values.float()
            differ = a != b
            carried = (b.abs() == 2 ** torch.floor(torch.log2(b.abs().clamp(min=2 ** -9)))) & (a == b / 2)
            rounded = (a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2 ** -9  # one step
            assert not (differ & ~carried & ~rounded).any(), (a[differ & ~carried & ~rounded], b[differ & ~carried])
            assert int((differ & ~carried).sum()) <= a.numel() // 100, int((differ & ~carried).sum())
            return int(differ.sum())

        torch.manual_seed(0)
        x, residual, gain = torch.randn(45, 320).bfloat16(), torch.randn(45, 320) * 4, 1 + 0.1 * torch.randn(320)
        for previous in (None, residual):
            (got, got_sum), (want, want_sum) = (fn(x, gain, 1e-6, previous)
                                                for fn in (FP8.rms_norm_fp8_triton, FP8.rms_norm_fp8_torch))
            assert torch.allclose(got_sum, want_sum, rtol=1e-6, atol=1e-6)
            check(got, want)
        gate_up = (torch.randn(45, 5000) * 3).bfloat16()
        check(FP8.silu_mul_fp8_triton(gate_up, 2500), FP8.silu_mul_fp8_torch(gate_up, 2500))
        rows = torch.randn(45, 3000) * torch.rand(45, 1) * 10
        rows[3] = 0
        check(FP8.quantize_rows_triton(rows), FP8.quantize_rows_torch(rows))
        print("interpreted ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreted ok" in result.stdout


def add_model_part() -> None:
    from workbench_ui import shell

    shell.render_add_model(shell.model_manager())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine of 8.9 or newer FP8 is offered")
def test_the_sidebar_says_why_fp8_is_not_offered_when_loading_a_model_on_the_cpu(workbench):
    from streamlit.testing.v1 import AppTest

    from clef_workbench.model_loader import fp8_unavailable

    assert fp8_unavailable().startswith("it needs a CUDA GPU")
    at = AppTest.from_function(add_model_part, default_timeout=120)
    at.run()
    at.selectbox(key="sidebar.add_choice").set_value("Local release folder").run()
    at.text_input(key="sidebar.add_local").input("/models/clef-flash").run()
    captions = [caption.value for caption in at.caption]
    assert "Precision: bf16. FP8 is not offered here: it needs a CUDA GPU and the device is cpu." in captions
    assert "sidebar.add_precision" not in [radio.key for radio in at.radio]
    at.selectbox(key="sidebar.add_choice").set_value("System One endpoint (URL)").run()
    assert not [c for c in at.caption if c.value.startswith("Precision")]  # an endpoint runs its own precision


def test_the_model_listing_describes_an_fp8_model_with_its_distance_from_float32():
    from clef_engine.serve.server import _precision_text

    assert _precision_text({"precision": "bf16"}) == "" and _precision_text({}) == ""
    assert _precision_text({"precision": "fp8", "distance_from_float32": "not measured"}) == \
        ", W8A8 FP8 projections (distance from float32 not measured)"
    measured = {"max_dp": 0.031, "flips": 4, "questions": 240, "gate_met": True, "source": "bench/results/x.json"}
    assert _precision_text({"precision": "fp8", "distance_from_float32": measured}) == (
        ", W8A8 FP8 projections (max |Δp| 0.031 from float32, 4 of 240 answers flipped (gate met; "
        "bench/results/x.json))")
