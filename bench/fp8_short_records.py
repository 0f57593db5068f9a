# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""Why FP8 `decide` at ~512 tokens misses issue 25's 35 ms (a diagnostic; the headline is
bench/lengths_and_precision.py's p50): records of up to 512 tokens answer in ~35 ms, records just over in ~42 ms.

    python bench/fp8_short_records.py OUT.json        (CUDA, flash-linear-attention installed; ~3 min)

Three steps, on the Clef-27B shape (random bf16 weights, bench/build.py):
- gemm: every projection shape of one layer, FP8 (`torch._scaled_mm`, row-wise scales, as fp8.linear_fp8_scaled_mm)
  and bf16 (`torch.mm`), at M = 448 to 1,024 rows; `model_*_ms` sums them over the model's 64 layers (16 full
  attention, 48 Gated DeltaNet), i.e. the projection time of one record of M tokens.
- decide: `decide` in bf16, then in FP8 (the same weights quantized in place), per token count (each request decided
  once untimed, its length's CUDA graph captured then; the median of 5 timed calls; the engine's full warm-up off).
- profile: one eager packed forward in FP8 of a record just under and one just over 512 tokens, GPU time per kernel.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402
from bench import lengths_and_precision as lp  # noqa: E402

ROWS = (448, 480, 512, 544, 576, 608, 640, 704, 768, 1024)
TOKENS = (450, 480, 500, 510, 520, 540, 560, 580, 600, 640, 700, 768)
PROFILE_TOKENS = (505, 545)
# Clef-27B per layer: [out, in] of each fused projection, and how many layers have it
PROJECTIONS = {"gate_up": ((34816, 5120), 64), "down": ((5120, 17408), 64), "qkv": ((14336, 5120), 16),
               "o_proj": ((5120, 6144), 16), "in_proj": ((16480, 5120), 48), "out_proj": ((5120, 6144), 48)}


def gpu_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def gemm_times() -> dict:
    device = torch.device("cuda")
    out = {}
    for rows in ROWS:
        row: dict = {}
        for name, ((n, k), _) in PROJECTIONS.items():
            a8, w8 = (torch.randn(shape, device=device).to(torch.float8_e4m3fn) for shape in ((rows, k), (n, k)))
            scale_a, scale_w = torch.rand(rows, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
            a16, w16 = (torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in ((rows, k), (n, k)))
            fp8 = gpu_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=scale_a, scale_b=scale_w,
                                                  out_dtype=torch.bfloat16))
            bf16 = gpu_ms(lambda: torch.mm(a16, w16.t()))
            row[name] = {"fp8_ms": round(fp8, 4), "bf16_ms": round(bf16, 4),
                         "fp8_tflops": round(2 * rows * n * k / fp8 / 1e9)}
        for precision in ("fp8", "bf16"):
            row[f"model_{precision}_ms"] = round(sum(row[name][f"{precision}_ms"] * layers
                                                     for name, (_, layers) in PROJECTIONS.items()), 2)
        out[rows] = row
        print(rows, row["model_fp8_ms"], row["model_bf16_ms"], flush=True)
    return out


def decide_times(engine) -> dict:
    schema = build.schema(4, 3, 4, noul_every=4)
    out = {}
    for i, tokens in enumerate(TOKENS):
        request = build.sized_request(engine, tokens, schema, seed=900 + i)
        engine.decide(request)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            response = engine.decide(request)
            times.append((time.perf_counter() - t0) * 1000)
        out[response["usage"]["input_tokens"]] = round(statistics.median(times), 2)
    return out


def kernel_profile(engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    schema = build.schema(4, 3, 4, noul_every=4)
    out = {}
    for tokens in PROFILE_TOKENS:
        record = engine.encode(build.sized_request(engine, tokens, schema, seed=77 + tokens))
        engine.forward_packed([record])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.forward_packed([record])
            torch.cuda.synchronize()
        kernels = sorted(((event.key[:100], round(event.device_time_total / 1000, 3))
                          for event in prof.key_averages() if event.device_time_total > 0), key=lambda kv: -kv[1])
        out[len(record)] = {"total_ms": round(sum(ms for _, ms in kernels), 2), "kernels": kernels[:30]}
    return out


def main(argv: list[str]) -> int:
    out_path = Path(argv[0])
    results: dict = {"command": "python bench/fp8_short_records.py OUT.json",
                     "environment": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}}

    def save() -> None:
        out_path.write_text(json.dumps(results, indent=1))

    results["gemm"] = gemm_times()
    save()

    class Args:
        smoke, device = False, "cuda"

    setup = lp.Setup(Args)
    lp.build_big(setup)
    results["decide"] = {}
    for precision in ("bf16", "fp8"):  # bf16 first: fp8 quantizes the model in place
        engine = lp.make_engine(setup, lp.Big.model, lp.Big.head, lp.Big.head_config, lp.Big.config_json,
                                precision, warm_up=False)
        results["decide"][precision] = decide_times(engine)
        print(precision, results["decide"][precision], flush=True)
        save()
        if precision == "fp8":
            results["profile_fp8_eager"] = kernel_profile(engine)
            save()
        engine.close()
        lp.free()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
