# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""Diagnostics behind issue 12's open targets, on the Clef-27B architecture on one H200 (not a benchmark: the
headline numbers come from bench/user_paths.py).

    python bench/diagnose_h200.py OUT_DIR

Steps (DIAG_STEPS=a,b,…; default environment,gqa,gemm,cached_16k,pack_1k,decide_many_timeline):

- gqa: whether torch's varlen attention and cuDNN SDPA take fewer K/V heads than query heads as they are, the
  continuation's attention after 15,600 cached keys, and cuDNN's first call at new lengths after `warm_long_attention`.
  (Call 1 of results/2026-12-01-h200-diagnose.json ran an earlier `attention_shapes` step: cuDNN at lengths met for
  the first time, before the attention padded lengths itself.)
- gemm: each projection's GEMM at 1k and 16k rows, and a square 8192³ product, in TFLOP/s.
- cached_16k: where a new schema on a cached 16k state spends its time (encode, key, continuation, head) and the
  continuation's kernels.
- pack_1k: 16 records of ~1k tokens as one pack (what decide_many runs), 12 times back to back, and its kernels.
- decide_many_timeline: 256 records through decide_many, each GPU batch timed on the host, and the gaps between.
- first_calls: the first pack of each size class against the same pack again.
- bulk_ab: the same packs as interactive and as bulk work (the callback between layers).
- first_long: the user path's 4k records as a user meets them, and as the benchmark alternates them.
- head_kernels: the head's attention on cuDNN and on kernels that need no per-shape plan (memory-efficient, flash
  varlen, split keys). (Call 7 ran an earlier `head_attention` step: cuDNN and memory-efficient only.)
- head_split: the head's attention as it runs (flash, keys split by `key_splits`) against every split count.
- residual_gemm: the residual-stream projections with bf16 and with float32 outputs, and the add + norm after them.
Writes OUT_DIR/diagnose.json after every step.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.profile_h200 as profile_module  # noqa: E402
from bench import build, h200  # noqa: E402
from bench.profile_h200 import kernel_table, step  # noqa: E402
from clef_engine.fast import attention as A  # noqa: E402
from clef_engine.fast import kernels as K  # noqa: E402
from clef_engine.fast.segments import make_segments  # noqa: E402

report = profile_module.report


def once_ms(fn) -> float:
    """One call, the device synchronized before and after (bench/h200.timed with no warm-up)."""
    return h200.timed(fn, 1, 0)["p50"]


def qkv(n: int, heads: int = 24, kv_heads: int = 4, dim: int = 256, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g))


@step("environment")
def environment(_=None):
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name()}
    fn = A._varlen_function()
    out["varlen_attn_signature"] = str(inspect.signature(fn)) if fn is not None else None
    out["mm_out_dtype"] = "out_dtype" in str(getattr(torch.mm, "__doc__", ""))
    return out


@step("gqa")
def gqa(_=None):
    device = torch.device("cuda")
    out = {"varlen_takes_grouped_heads": A._varlen_takes_grouped_heads(device, torch.bfloat16),
           "cudnn_takes_grouped_heads": A._cudnn_takes_grouped_heads(device, torch.bfloat16)}
    n = 4608
    q, k, v = qkv(n, seed=3)
    segments = make_segments([n], device)
    want = A.attention_sdpa(q, k, v, segments).float()
    out["varlen_ms"] = h200.timed(lambda: A.attention_varlen(q, k, v, segments), 5)["p50"]
    out["varlen_vs_sdpa_max_abs"] = round((A.attention_varlen(q, k, v, segments).float() - want).abs().max().item(), 5)
    out["cudnn_ms"] = h200.timed(lambda: A.attention_varlen_cudnn_long(q, k, v, segments), 5)["p50"]
    out["cudnn_vs_sdpa_max_abs"] = round(
        (A.attention_varlen_cudnn_long(q, k, v, segments).float() - want).abs().max().item(), 5)
    # a continuation: 416 queries after 15,600 cached keys (what a new schema on a cached 16k state runs)
    prefix, new = 15_600, 416
    q2, k2, v2 = qkv(prefix + new, seed=4)
    q2 = q2[-new:].contiguous()
    out["after_prefix_ms"] = h200.timed(lambda: A.attention_after_prefix_varlen(q2, k2, v2, prefix), 5)["p50"]
    out["after_prefix_vs_masked_sdpa_max_abs"] = round(
        (A.attention_after_prefix_varlen(q2, k2, v2, prefix).float()
         - A.attention_after_prefix(q2, k2, v2, prefix).float()).abs().max().item(), 5)
    t0 = time.perf_counter()
    out["warm_long_attention_lengths"] = A.warm_long_attention(device, torch.bfloat16, 24, 4, 256, 32_768)
    out["warm_long_attention_s"] = round(time.perf_counter() - t0, 2)
    for m in (4436, 9001, 16999):  # lengths met for the first time, after the warm-up
        q3, k3, v3 = qkv(m, seed=m)
        s3 = make_segments([m], device)
        out[f"first_call_after_warm_up_{m}_ms"] = once_ms(lambda: A.attention_varlen_cudnn_long(q3, k3, v3, s3))
    return out


@step("gemm")
def gemm(engine):
    out = {}
    gdn = next(layer for layer in engine.backbone.layers if layer.kind == "linear_attention")
    attn = next(layer for layer in engine.backbone.layers if layer.kind != "linear_attention")
    weights = {"gate_up": gdn.gate_up, "down": gdn.down, "gdn_in": gdn.in_proj, "gdn_out": gdn.out_proj,
               "attn_qkv": attn.qkv, "attn_o": attn.o_proj}
    for rows in (1024, 16384):
        for name, w in weights.items():
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            t = h200.timed(lambda: F.linear(x, w), 10, 2)["p50"]
            out[f"{rows}_{name}"] = {"ms": t, "tflops": round(2 * rows * w.shape[0] * w.shape[1] / t / 1e9, 1)}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = h200.timed(lambda: a @ b, 20, 3)["p50"]
    out["square_8192"] = {"ms": t, "tflops": round(2 * 8192**3 / t / 1e9, 1)}
    return out


def request(engine, tokens: int, seed: int, schema: dict | None = None) -> dict:
    return build.sized_request(engine, tokens, schema or build.schema(4, 3, seed, noul_every=4), seed)


@step("cached_16k")
@torch.inference_mode()
def cached_16k(engine):
    engine.state_cache.clear()
    state = build.sized_state(engine, 16_384 - 400, build.schema(4, 3, 77, noul_every=4), 77)
    variants = [{"model": "clef", "state": state, "questions": build.schema(4, 3, 900 + v, noul_every=4)}
                for v in range(6)]
    out = {"cold_ms": once_ms(lambda: engine.decide(variants[0]))}
    out["first_hit_ms"] = once_ms(lambda: engine.decide(variants[1]))
    out["hits_ms"] = [once_ms(lambda: engine.decide(r)) for r in variants[2:]]
    record = None

    def encode():
        nonlocal record
        record = engine.encode(variants[3])
    out["encode_ms"] = once_ms(encode)
    out["tokens"], out["state_end"] = len(record), record.state_end
    key = None

    def make_key():
        nonlocal key
        key = engine.prefix.key(record)
    out["key_ms"] = once_ms(make_key)
    state_entry = engine.state_cache.get(key)
    result = None

    def after():
        nonlocal result
        result = engine.prefix.forward_after(record, state_entry)
    out["forward_after_graph_ms"] = [once_ms(after) for _ in range(3)]
    out["head_ms"] = [once_ms(lambda: engine.head_one(*result, record)) for _ in range(3)]
    graphs, engine.prefix.graphs = engine.prefix.graphs, None
    try:
        out["forward_after_eager_ms"] = once_ms(after)
        out["profile_eager_continuation"] = kernel_table(after, 2)
    finally:
        engine.prefix.graphs = graphs
    out["profile_graph_continuation"] = kernel_table(after, 2)
    return out


@step("pack_1k")
def pack_1k(engine):
    import random

    rng = random.Random(5)
    requests = [request(engine, rng.randint(900, 1150), 7000 + i) for i in range(16)]
    records = [engine.encode(r) for r in requests]
    tokens = sum(len(r) for r in records)
    engine.forward_batch(records)
    sustained = [h200.timed(lambda: engine.forward_batch(records), 1, 0)["p50"] for _ in range(12)]
    return {"tokens": tokens, "sustained_ms": sustained,
            "tokens_per_s_first_last": [round(tokens / sustained[0] * 1000), round(tokens / sustained[-1] * 1000)],
            "profile": kernel_table(lambda: engine.forward_batch(records), 1)}


@step("decide_many_timeline")
def decide_many_timeline(engine):
    """256 records of 700-1,300 tokens through decide_many (what the batch run times), with the worker's batches
    timed on the host: the time inside forward_batch against the time between batches."""
    import random

    rng = random.Random(6)
    requests = [request(engine, rng.randint(700, 1300), 8000 + i) for i in range(256)]
    spans = []
    scheduler = engine.scheduler
    run_batch = scheduler.run_batch

    def timed(records):
        t0 = time.perf_counter()
        out = run_batch(records)
        spans.append((t0, time.perf_counter(), sum(len(r) for r in records), len(records)))
        return out
    scheduler.run_batch = timed
    try:
        engine.decide_many(requests[:32])
        spans.clear()
        t0 = time.perf_counter()
        responses = engine.decide_many(requests)
        wall = time.perf_counter() - t0
    finally:
        scheduler.run_batch = run_batch
    tokens = sum(r["usage"]["input_tokens"] for r in responses)
    inside = sum(end - start for start, end, _, _ in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall),
            "batches": len(spans), "inside_forward_batch_s": round(inside, 2),
            "tokens_per_s_inside": round(sum(s[2] for s in spans) / inside),
            "first_batch_starts_after_s": round(spans[0][0] - t0, 3), "last_batch_ends_before_s": round(
                t0 + wall - spans[-1][1], 3),
            "gap_ms_p50_max": [round(statistics.median(gaps) * 1000, 1), round(max(gaps) * 1000, 1)] if gaps else None,
            "batch_ms": [round((e - s) * 1000) for s, e, _, _ in spans], "batch_tokens": [t for _, _, t, _ in spans]}


@step("first_calls")
@torch.inference_mode()
def first_calls(engine):
    """After a small warm-up: the first pack of each size class (flash-linear-attention's l2norm autotuned once per
    65,536 rows of q / k) and the same pack again."""
    import random

    rng = random.Random(9)
    warm = [engine.encode(request(engine, n, 9100 + n)) for n in (300, 700)]
    engine.forward_batch(warm)
    out = {}
    for total in (4_400, 9_000, 13_500, 17_500):
        records, tokens = [], 0
        while tokens < total:
            records.append(engine.encode(request(engine, rng.randint(700, 1300), rng.randint(0, 10**6))))
            tokens += len(records[-1])
        out[str(tokens)] = {"records": len(records), "first_ms": once_ms(lambda: engine.forward_batch(records)),
                            "second_ms": once_ms(lambda: engine.forward_batch(records))}
        profile_module.save()
    return out


@step("bulk_ab")
@torch.inference_mode()
def bulk_ab(engine):
    """The same 16-record packs run as interactive work (no callback between layers) and as bulk work (the host kept
    at most LAYERS_AHEAD layers ahead of the GPU, interactive requests let in between layers), alternating."""
    import random

    from clef_engine import engine as engine_module
    from clef_engine.scheduler import PRIORITIES

    rng = random.Random(10)
    packs = []
    for p in range(3):
        records = [engine.encode(request(engine, rng.randint(700, 1300), 20_000 + 100 * p + i)) for i in range(16)]
        packs.append(records)
        engine.forward_batch(records)
    out: dict = {"tokens": [sum(len(r) for r in pack) for pack in packs]}
    scheduler = engine.scheduler

    def run(pack, priority, ahead):
        engine_module.LAYERS_AHEAD = ahead
        scheduler.running_priority = priority
        try:
            return once_ms(lambda: engine.forward_batch(pack))
        finally:
            scheduler.running_priority = None
    variants = {"interactive": (PRIORITIES["interactive"], 1), "bulk_ahead_1": (PRIORITIES["bulk"], 1),
                "bulk_ahead_3": (PRIORITIES["bulk"], 3)}
    times: dict = {name: [] for name in variants}
    for _ in range(3):
        for pack in packs:
            for name, (priority, ahead) in variants.items():
                times[name].append(run(pack, priority, ahead))
    engine_module.LAYERS_AHEAD = 1
    tokens = sum(out["tokens"]) * 3
    for name, values in times.items():
        out[name] = {"ms": values, "tokens_per_s": round(tokens / sum(values) * 1000)}
    return out


@step("first_long")
def first_long(engine):
    """The user path's 4k bucket (bench/user_paths.py's own requests) with the cache on: alone, as a user meets it;
    then cold again with the release path run before each call, as the benchmark alternates them; then with the
    cache off. Per call: milliseconds, and what it met for the first time (CUDA graph and head graph captures,
    cudaMalloc segments, entries moved to host memory)."""
    import random

    from bench import user_paths
    from clef_engine.model.reference import reference_decide

    rng = random.Random(12)  # as user_path draws them: every bucket before this one first
    requests = [user_paths.bucket_requests(engine, rng, name) for name in ("512", "1024", "4096")][-1]

    def counters():
        stats = torch.cuda.memory_stats()
        return {"graphs": engine.graphs.captures, "head_graphs": engine.head_graphs.captures,
                "segments": stats["segment.all.allocated"], "alloc_retries": stats["num_alloc_retries"],
                "to_host": engine.state_cache.stats()["moved_to_host"]}

    def run(label, before=None):
        rows = []
        for r in requests[1:]:
            if before is not None:
                before(r)
            seen = counters()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            response = engine.decide(r)
            ms = round((time.perf_counter() - t0) * 1000, 1)
            after = counters()
            rows.append({"tokens": response["usage"]["input_tokens"], "ms": ms,
                         **{k: after[k] - seen[k] for k in after if after[k] != seen[k]}})
        print(label, [(row["tokens"], row["ms"]) for row in rows], flush=True)
        return rows

    out = {"warm_up_s": round(engine.warm_up(), 1)}  # as clef_engine.load does
    engine.decide(requests[0])
    out["alone"] = run("alone")
    engine.state_cache.clear()
    out["alone_again"] = run("alone again")
    engine.state_cache.clear()
    out["after_release_path"] = run("after the release path",
                                    lambda r: reference_decide(engine, [engine.encode(r)]))
    engine.state_cache.enabled = False
    out["cache_off"] = run("cache off")
    engine.state_cache.enabled = True
    return out


@step("head_kernels")
def head_kernels(_=None):
    """Candidates for the head's attention without per-shape plans, at the head graph's shapes (16 heads of 64, a
    few queries over the record's memory padded to its bucket, the padding masked): cuDNN with the mask; the
    memory-efficient kernel with the mask; flash varlen told the real key count (no mask); the memory-efficient
    kernel split over the keys (flash-decoding: partial outputs combined by their log-sum-exp). First call, steady
    time, one CUDA graph replay, and the difference from cuDNN."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.varlen import varlen_attn

    from clef_engine.fast.graphs import capture

    def split_efficient(q, k, v, mask, splits):
        b, h, s, d = q.shape
        t = k.shape[2]
        ks = k.view(h, splits, t // splits, d).transpose(0, 1)
        vs = v.view(h, splits, t // splits, d).transpose(0, 1)
        qs = q.expand(splits, h, s, d)
        bias = mask.view(splits, 1, 1, t // splits).expand(splits, h, s, t // splits)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qs, ks, vs, bias, True)[:2]
        lse = lse[..., :s]  # [splits, h, s]
        top = lse.max(dim=0, keepdim=True).values
        weight = torch.exp(lse - top).nan_to_num_(0.0)
        out = out.float().nan_to_num_(0.0) * weight[..., None]
        return (out.sum(0, keepdim=True) / weight.sum(0, keepdim=True)[..., None]).to(q.dtype)

    out = {}
    for queries, keys, real in ((8, 1024, 900), (24, 3584, 3519), (80, 4608, 4440), (65, 14336, 13661),
                                (650, 14336, 13661), (700, 16384, 16000), (33, 1152, 1131), (33, 1280, 1131)):
        g = torch.Generator(device="cuda").manual_seed(queries + keys)
        q = torch.randn(1, 16, queries, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 16, keys, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, 16, keys, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = torch.zeros(1, 1, 1, keys, device="cuda", dtype=torch.bfloat16)
        mask[..., real:] = float("-inf")
        cu_q = torch.tensor([0, queries], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, real], device="cuda", dtype=torch.int32)
        qp, kp, vp = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        candidates = {
            "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, mask),
            "efficient": lambda: _sdpa(SDPBackend.EFFICIENT_ATTENTION, q, k, v, mask),
            "flash_varlen": lambda: varlen_attn(qp, kp, vp, cu_q, cu_k, queries, keys,
                                                window_size=(-1, -1)).transpose(0, 1)[None],
        }
        for splits in (4, 8, 16):
            if keys % (splits * 8) == 0:
                candidates[f"efficient_split{splits}"] = (
                    lambda s=splits: split_efficient(q, k, v, mask, s))
        row, answers = {}, {}
        for name, call in candidates.items():
            try:
                row[f"{name}_first_ms"] = once_ms(call)
                row[f"{name}_ms"] = h200.timed(call, 30, 3)["p50"]
                answers[name] = call().float()
                graph = torch.cuda.CUDAGraph()
                captured = capture(graph, call, torch.device("cuda"))  # as the head graphs capture
                row[f"{name}_graph_ms"] = h200.timed(graph.replay, 30, 3)["p50"]
                row[f"{name}_graph_max_abs"] = round((captured.float() - answers[name]).abs().max().item(), 5)
            except Exception as error:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        if "cudnn" in answers:
            for name, answer in answers.items():
                if name != "cudnn":
                    row[f"{name}_vs_cudnn_max_abs"] = round((answer - answers["cudnn"]).abs().max().item(), 5)
        out[f"{queries}x{keys}({real})"] = row
        print(queries, keys, row, flush=True)
    return out


@step("head_split")
def head_split(_=None):
    """The head's attention as it runs now (`attention_flash_split`: flash told the real key count, the keys split
    by `key_splits`) against every split count, at head-graph shapes (16 heads of 64, the memory padded to its
    bucket): per call in a CUDA graph of 10 calls, and the largest difference from the masked attention."""
    from clef_engine.fast import head_kernels as H
    from clef_engine.fast.graphs import capture

    device = torch.device("cuda")
    out = {"blocks_at_once": H.blocks_at_once(device), "split_checked": H._flash_splits_keys(device, torch.bfloat16)}
    for queries, keys, real in ((65, 14336, 13661), (650, 14336, 13661), (65, 4608, 4440), (650, 4608, 4440),
                                (33, 1280, 1131), (81, 8192, 8000), (129, 16384, 16000)):
        g = torch.Generator(device="cuda").manual_seed(queries + keys)
        q = torch.randn(1, queries, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, keys, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        counts = torch.tensor([real], device="cuda", dtype=torch.int32)
        want = H.attention_masked(q, k, v, counts).float()
        row = {"chosen_splits": H.key_splits(1, queries, 16, keys, H.blocks_at_once(device))}
        candidates = {"chosen": lambda: H.attention_flash_split(q, k, v, counts),
                      "split1": lambda: H.attention_flash_counts(q, k, v, counts)}
        for splits in (2, 4, 8, 16, 32):
            candidates[f"split{splits}"] = lambda s=splits: H.attention_split_keys(q, k, v, counts, s)
        for name, call in candidates.items():
            try:
                row[f"{name}_max_abs"] = round((call().float() - want).abs().max().item(), 5)
                graph = torch.cuda.CUDAGraph()
                capture(graph, lambda: [call() for _ in range(10)], device)
                row[f"{name}_graph_ms"] = round(h200.timed(graph.replay, 30, 3)["p50"] / 10, 4)
            except Exception as error:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        out[f"{queries}x{keys}({real})"] = row
        print(queries, keys, row, flush=True)
    return out


@step("residual_gemm")
def residual_gemm(_=None):
    """The projections whose outputs join the residual stream, bf16 output (F.linear) against the float32 output
    (`residual_projection_float32`), at Clef-27B's shapes (o_proj and GDN out_proj 6144 -> 5120, MLP down 17408 ->
    5120), in ms per call; and the add + norm that reads the branch, bf16 against float32 in."""
    out = {"checked": K.residual_projection_matches(torch.device("cuda"), torch.bfloat16)}
    g = torch.Generator(device="cuda").manual_seed(7)
    for rows in (512, 1024, 4096, 16384):
        for name, width in (("o_proj", 6144), ("down", 17408)):
            x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=g)
            weight = torch.randn(5120, width, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            plain = h200.timed(lambda: F.linear(x, weight), 20, 3)["p50"]
            wide = h200.timed(lambda: K.residual_projection_float32(x, weight), 20, 3)["p50"]
            out[f"{name}_{rows}"] = {"bf16_ms": plain, "float32_ms": wide}
        branch = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16, generator=g)
        residual = torch.randn(rows, 5120, device="cuda", dtype=torch.float32, generator=g)
        norm = torch.ones(5120, device="cuda")
        out[f"add_norm_{rows}"] = {
            "bf16_ms": h200.timed(lambda: K.rms_norm_triton(branch, norm, 1e-6, residual), 20, 3)["p50"],
            "float32_ms": h200.timed(lambda: K.rms_norm_triton(branch.float(), norm, 1e-6, residual,
                                                               torch.bfloat16), 20, 3)["p50"]}
    print(out, flush=True)
    return out


def _sdpa(backend, q, k, v, mask):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_module.OUT = out_dir
    (out_dir / "diagnose.json").unlink(missing_ok=True)
    profile_module.save = lambda: (out_dir / "diagnose.json").write_text(json.dumps(report, indent=1, default=str))
    chosen = os.environ.get("DIAG_STEPS", "environment,gqa,gemm,cached_16k,pack_1k,decide_many_timeline").split(",")
    if "environment" in chosen:
        environment()
    if "gqa" in chosen:
        gqa()
    if "head_kernels" in chosen:
        head_kernels()
    if "head_split" in chosen:
        head_split()
    if "residual_gemm" in chosen:
        residual_gemm()
    if set(chosen) <= {"environment", "gqa", "head_kernels", "head_split", "residual_gemm"}:
        profile_module.save()
        return 0
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", tempfile.mkdtemp(prefix="clef-diag-tiny-"))))
    engine = build.random_engine(build.clef_config("clef", tiny), tiny)
    steps = {"gemm": gemm, "cached_16k": cached_16k, "pack_1k": pack_1k, "first_calls": first_calls,
             "bulk_ab": bulk_ab, "decide_many_timeline": decide_many_timeline, "first_long": first_long}
    for name in chosen:
        if name in steps:
            steps[name](engine)
    profile_module.save()
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if "profile" not in kk} if isinstance(v, dict) else v)
                      for k, v in report.items()})[:9000])
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
