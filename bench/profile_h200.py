# ruff: noqa: B023
"""Where the engine's time goes on the Clef-27B architecture (one H200): torch.profiler kernel tables for one
record (eager), the head alone, the cached-state continuation, plus the bf16 parity of packed records.

    python bench/profile_h200.py OUT_DIR

Writes OUT_DIR/profile.json (kernel time per category and the top kernels of each case). Not a benchmark: the
numbers under the profiler include its overhead; bench/h200.py is what we quote.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build, h200  # noqa: E402
from clef_engine.fast import attention as A  # noqa: E402
from clef_engine.fast import kernels as K  # noqa: E402
from clef_engine.fast.segments import make_segments  # noqa: E402

OUT = Path("profile-out")
report: dict = {}


def save() -> None:
    (OUT / "profile.json").write_text(json.dumps(report, indent=1, default=str))


def category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "gemm"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(s in n for s in ("chunk", "solve_tril", "recompute_w_u", "kkt", "l2norm", "cumsum", "delta")):
        return "gdn"
    if "conv" in n:
        return "conv"
    if "layer_norm" in n or "rms" in n or "norm" in n:
        return "norm"
    if "memcpy" in n or "memset" in n or "copy" in n or "cat" in n:
        return "copy"
    return "elementwise/other"


def kernel_table(fn, iterations: int = 3) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = {}
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
            count += 1
    by_category: dict[str, float] = {}
    for name, (us, _) in per_kernel.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + us / 1000 / iterations
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    return {"gpu_ms_per_iteration": round(sum(v[0] for v in per_kernel.values()) / 1000 / iterations, 2),
            "kernels_per_iteration": count // iterations,
            "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top": [(name[:110], round(us / 1000 / iterations, 3), n // iterations) for name, (us, n) in top]}


def step(name: str):
    def wrap(fn):
        def run(*args):
            started = time.perf_counter()
            try:
                report[name] = fn(*args)
            except Exception as error:  # noqa: BLE001
                report[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2500:]}
            print(f"[{name}] {time.perf_counter() - started:.1f} s", flush=True)
            save()
        return run
    return wrap


@step("gemm_ceiling")
def gemm_ceiling(engine):
    out = {}
    layer = engine.backbone.layers[0]
    for n in (512, 1024, 16384):
        x = torch.randn(n, 5120, device="cuda", dtype=torch.bfloat16)
        for label, w in (("gate_up", layer.gate_up), ("down", layer.down), ("gdn_in", layer.in_proj)):
            inp = x if w.shape[1] == 5120 else torch.randn(n, w.shape[1], device="cuda", dtype=torch.bfloat16)
            t = h200.timed(lambda: torch.nn.functional.linear(inp, w), 20, 3)["p50"]
            out[f"{n}_{label}"] = {"ms": t, "tflops": round(2 * n * w.shape[0] * w.shape[1] / t / 1e9, 1)}
    return out


@step("single_eager")
def single_eager(engine):
    out = {}
    engine.state_cache.enabled = False
    for n in (512, 1024, 16384):
        record = engine.encode(h200.sized_request(engine, n, seed=n))
        segments = make_segments([len(record)], torch.device("cuda"))
        ids = torch.tensor(record.input_ids, device="cuda")
        engine.backbone.forward(ids, segments)
        row = {"eager_forward_ms": h200.timed(lambda: engine.backbone.forward(ids, segments), 3, 1)["p50"]}
        if n <= 4096:
            row["graph_forward_batch_ms"] = h200.timed(lambda: engine.forward_batch([record]), 5, 2)["p50"]
        row["profile"] = kernel_table(lambda: engine.backbone.forward(ids, segments), 2 if n > 4096 else 3)
        out[str(n)] = row
        save()
    engine.state_cache.enabled = True
    return out


@step("head_64x10")
def head_profile(engine):
    from clef_engine.model.head import layout
    request = h200.sized_request(engine, 0, 64, 10, seed=64)
    request["state"] = " ".join(h200.WORDS * 8)
    record = engine.encode(request, max_length=2**31 - 1)
    hidden = torch.randn(len(record), 5120, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(10):
        layout([record], [0], [len(record)])
    layout_ms = (time.perf_counter() - t0) * 100
    run = lambda: engine.head_probabilities(hidden, [record], [0], [len(record)])  # noqa: E731
    with torch.inference_mode():
        wall = h200.timed(run, 10, 3)
        table = kernel_table(run, 3)
    return {"tokens": len(record), "wall": wall, "layout_host_ms": round(layout_ms, 2), "profile": table}


@step("cached_16k")
def cached_profile(engine):
    engine.state_cache.clear()
    base = h200.sized_request(engine, 16_384 - 400, seed=77)
    variants = [{"model": "clef", "state": base["state"], "questions": h200.schema(4, 3, seed=900 + v)}
                for v in range(3)]
    engine.decide(variants[0])
    record = engine.encode(variants[1])
    key_state = engine.prefix.lookup(record)
    run = lambda: engine.head_one(*engine.prefix.forward_after(record, key_state), record)  # noqa: E731
    with torch.inference_mode():
        run()
        wall = h200.timed(run, 5, 1)
        table = kernel_table(run, 3)
    # flash varlen with fewer queries than keys: is its causal mask bottom-right aligned (= our explicit mask)?
    check = {}
    try:
        n, p = 429, 15_557
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(n, 24, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(p + n, 4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(p + n, 4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        want = A.attention_after_prefix(q, k, v, p)
        import inspect

        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        check["signature"] = str(inspect.signature(varlen_attn))[:400]
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
            kk, vv = k, v
        else:
            kk, vv = k.repeat_interleave(6, dim=1), v.repeat_interleave(6, dim=1)
        cu_q = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, p + n], device="cuda", dtype=torch.int32)
        got = varlen_attn(q, kk, vv, cu_q, cu_k, n, p + n, **kw)
        check["max_abs_diff_vs_masked_sdpa"] = (got.float() - want.float()).abs().max().item()
        check["sdpa_masked_ms"] = h200.timed(lambda: A.attention_after_prefix(q, k, v, p), 10, 2)["p50"]
        check["varlen_ms"] = h200.timed(lambda: varlen_attn(q, kk, vv, cu_q, cu_k, n, p + n, **kw), 10, 2)["p50"]
    except Exception as error:  # noqa: BLE001
        check["error"] = f"{type(error).__name__}: {error}"
    return {"prefix": key_state.length, "new_tokens": len(record) - key_state.length, "wall": wall,
            "profile": table, "varlen_prefix_attention": check}


@step("pack_parity")
def pack_parity(engine, ref):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    engine.state_cache.enabled = False
    rng = random.Random(7)
    records = [engine.encode(h200.sized_request(engine, rng.randint(700, 1300), seed=1000 + i)) for i in range(16)]
    base = []
    for s in range(0, 16, 8):
        base.extend(ref(records[s: s + 8]))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        base_eff = []
        for s in range(0, 16, 8):
            base_eff.extend(ref(records[s: s + 8]))
    base_alone = [ref([r])[0] for r in records[:8]]
    packed = engine.forward_batch(records)
    single = [engine.forward_batch([r])[0] for r in records]
    saved = engine.backbone.kernels.gated_delta
    engine.backbone.kernels.gated_delta = K.gated_delta_torch
    packed_torch_gdn = engine.forward_batch(records[:8])
    engine.backbone.kernels.gated_delta = saved
    saved = engine.backbone.kernels.causal_conv
    engine.backbone.kernels.causal_conv = K.causal_conv_torch
    packed_torch_conv = engine.forward_batch(records[:8])
    engine.backbone.kernels.causal_conv = saved
    engine.state_cache.enabled = True
    c = h200.compare
    # the spread of the baseline's own options: how close to ties the random model sits
    gaps = sorted(round(sorted(q, reverse=True)[0] - sorted(q, reverse=True)[1], 4) for r in base for q in r)
    return {
        "packed_vs_base": c(packed, base), "single_vs_base": c(single, base), "packed_vs_single": c(packed, single),
        "base_efficient_sdpa_vs_base": c(base_eff, base), "base_alone_vs_base_batched": c(base_alone, base[:8]),
        "packed_torch_gdn_vs_base": c(packed_torch_gdn, base[:8]),
        "packed_torch_conv_vs_base": c(packed_torch_conv, base[:8]),
        "flip_margins_packed": h200.flip_margins(packed, base), "flip_margins_single": h200.flip_margins(single, base),
        "flip_margins_base_efficient": h200.flip_margins(base_eff, base),
        "baseline_top2_gap_smallest": gaps[:12], "baseline_top2_gap_median": gaps[len(gaps) // 2],
    }


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.mkdir(parents=True, exist_ok=True)
    from clef_engine.model.reference import reference_decide
    from clef_engine.tiny import build_tiny_release

    h200.OUT = OUT
    tiny = build_tiny_release(Path("/tmp/clef-bench-tiny"))
    engine = build.random_engine(build.clef_config("clef", tiny), tiny)
    t0 = time.perf_counter()
    engine.warm_up()
    report["warm_up_s"] = round(time.perf_counter() - t0, 1)
    report["kernels"] = engine.kernel_info()
    only = os.environ.get("PROFILE_ONLY", "gemm,single,head,cached,parity")
    if "gemm" in only:
        gemm_ceiling(engine)
    if "single" in only:
        single_eager(engine)
    if "head" in only:
        head_profile(engine)
    if "cached" in only:
        cached_profile(engine)
    if "parity" in only:
        pack_parity(engine, lambda rs: reference_decide(engine, rs))
    save()


if __name__ == "__main__":
    main()
