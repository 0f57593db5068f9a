# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""Where a ~136k-token record's GPU time goes, and what could shorten it (issue 25; a diagnostic, not a headline).

    python bench/long_record_limits.py OUT.json        (CUDA, flash-linear-attention installed; ~4 min)
    BENCH_SECTIONS=attention,gemm python bench/long_record_limits.py OUT.json        (no engine: ~1 min)

Attention: one chunk's two cuDNN calls against FlashAttention-2's SDPA; then `attention_chunk_cudnn` as the engine
runs it over every chunk of a ~136k record, against its two cuDNN calls alone on the same data (the rest is padding
copies and the float32 merge of the two halves) and against candidates that pass aligned chunks without copies and
merge in one Triton pass.

GEMMs: a ~136k-token record runs its projections as chunks of `prefill_chunk_tokens` rows (16,384 by default) and one
shorter last chunk. For every Clef-27B projection shape, at those row counts and at 32,768, this times `F.linear` in
bf16 as the engine runs it (cuBLAS's own choice of algorithm), then again with PyTorch's TunableOp, which tries
cuBLASLt's candidate algorithms for each shape and keeps the fastest. `record_136k_ms` sums a shape's time over the
model's layers and the record's chunks: the projection GPU time of one ~136k-token record under each choice.

Host time: `Engine.decide` with the defaults (random Clef-27B weights, warmed up as `clef_engine.load` does) at ~32k
and ~67k tokens under torch.profiler: how long after the call's start the GPU's first kernel begins, how long after
its last kernel the call returns, the GPU's idle gaps in between, and what the host ran while the GPU waited (our
Python frames and the PyTorch / CUDA runtime operations).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_short_records import PROJECTIONS, gpu_ms  # noqa: E402  (Clef-27B's projection shapes; CUDA timing)
from clef_engine.fast import attention as engine_attention  # noqa: E402

TOKENS_136K = 135_658
CHUNK = 16_384


def time_shapes(rows_list: tuple[int, ...]) -> dict:
    device = torch.device("cuda")
    out: dict = {}
    for rows in rows_list:
        for name, ((n, k), _) in PROJECTIONS.items():
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
            ms = gpu_ms(lambda x=x, w=w: F.linear(x, w), repeats=20)
            out[f"{name}@{rows}"] = {"ms": round(ms, 4), "tflops": round(2 * rows * n * k / ms / 1e9)}
            del x, w
    return out


def record_136k_ms(times: dict) -> float:
    full, last = divmod(TOKENS_136K, CHUNK)
    return round(sum(layers * (full * times[f"{name}@{CHUNK}"]["ms"] + times[f"{name}@{last}"]["ms"])
                     for name, (_, layers) in PROJECTIONS.items()), 1)


def attention_times() -> dict:
    """One chunk's attention at ~136k (24 query heads, 4 KV heads, dim 256): its diagonal block (causal) and its
    queries against the keys before it (no mask), under cuDNN's and FlashAttention-2's SDPA kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    q = torch.randn(1, 24, CHUNK, 256, device=device, dtype=torch.bfloat16)
    out: dict = {}
    for keys, causal in ((CHUNK, True), (7 * CHUNK, False)):
        k, v = (torch.randn(1, 4, keys, 256, device=device, dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * CHUNK * keys * 24 * 256 / (2 if causal else 1)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            label = f"{backend.name.lower()}@{keys}{'_causal' if causal else ''}"
            try:
                with sdpa_kernel(backend):
                    ms = gpu_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                                repeats=5)
                out[label] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9)}
            except RuntimeError as error:
                out[label] = {"error": str(error).splitlines()[0][:200]}
    return out


@triton.jit
def _merge_kernel(a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, out_ptr, N, H, stride_ah, stride_an, stride_bh, stride_bn,
                  D: tl.constexpr, ROWS: tl.constexpr):
    """out[n, h] = a + (b - a) * sigmoid(lse_b - lse_a), in float32, written token-major [N, H, D]."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < N
    cols = tl.arange(0, D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + head * stride_ah + r64 * stride_an + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + head * stride_bh + r64 * stride_bn + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    la = tl.load(lse_a_ptr + head * N + rows, mask=ok, other=0.0)
    lb = tl.load(lse_b_ptr + head * N + rows, mask=ok, other=0.0)
    weight = 1.0 / (1.0 + tl.exp(la - lb))
    tl.store(out_ptr + (r64 * H + head) * D + cols, (a + (b - a) * weight[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def merge_halves(out: torch.Tensor, lse: torch.Tensor, out_e: torch.Tensor, lse_e: torch.Tensor) -> torch.Tensor:
    """The two calls' outputs [1, H, n, D] merged by their log-sum-exp in one pass, token-major [n, H, D]."""
    _, heads, n, dim = out.shape
    merged = out.new_empty(n, heads, dim)
    lse, lse_e = lse.contiguous(), lse_e.contiguous()
    _merge_kernel[(triton.cdiv(n, 32), heads)](out, out_e, lse, lse_e, merged, n, heads, out.stride(1), out.stride(2),
                                               out_e.stride(1), out_e.stride(2), D=dim, ROWS=32, num_warps=8)
    return merged


def chunk_candidate(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix: int, *,
                    queries_copied: bool, own_keys_copied: bool) -> torch.Tensor:
    """An aligned chunk (prefix and length multiples of the cuDNN step): the queries (and the chunk's own keys)
    heads-first as views or as one copy each; the earlier keys always views; one merge pass."""
    def heads_first(x: torch.Tensor, copied: bool) -> torch.Tensor:
        x = x.transpose(0, 1)[None]
        return x.contiguous() if copied else x

    attend = engine_attention.attention_with_lse_cudnn
    queries = heads_first(q, queries_copied)
    out, lse = attend(queries, heads_first(k_all[prefix:], own_keys_copied),
                      heads_first(v_all[prefix:], own_keys_copied), True)
    out_e, lse_e = attend(queries, heads_first(k_all[:prefix], False), heads_first(v_all[:prefix], False), False)
    return merge_halves(out, lse, out_e, lse_e)


CANDIDATES = {"views": {"queries_copied": False, "own_keys_copied": False},
              "queries_copied": {"queries_copied": True, "own_keys_copied": False},
              "queries_and_own_keys_copied": {"queries_copied": True, "own_keys_copied": True}}


def chunk_attention_times() -> dict:
    """Every chunk after the first of a ~136k record (16 attention layers): the engine's function, its two cuDNN
    calls alone (on its padded heads-first copies), and the candidates."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    k_all, v_all = (torch.randn(TOKENS_136K, 4, 256, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
    totals = {"engine_ms": 0.0, "cudnn_calls_ms": 0.0, **{f"{name}_ms": 0.0 for name in CANDIDATES}}
    errors = {name: 0.0 for name in CANDIDATES}
    attend = engine_attention.attention_with_lse_cudnn
    for start in range(CHUNK, TOKENS_136K, CHUNK):
        n = min(CHUNK, TOKENS_136K - start)
        q = torch.randn(n, 24, 256, device=device, dtype=torch.bfloat16, generator=gen)
        keys, values = k_all[: start + n], v_all[: start + n]
        engine_ms = 16 * gpu_ms(lambda: engine_attention.attention_chunk_cudnn(q, keys, values, start), 5)
        totals["engine_ms"] += engine_ms
        rows = engine_attention.cudnn_length(n)
        own = (q, keys[start:], values[start:])
        placed = [x.new_zeros(1, x.shape[1], rows, 256) for x in own]
        for copy, x in zip(placed, own, strict=True):  # filled with the real data: zeros run faster on this GPU
            copy[0, :, : x.shape[0]] = x.transpose(0, 1)
        earlier = [x[:start].transpose(0, 1)[None] for x in (keys, values)]
        totals["cudnn_calls_ms"] += 16 * gpu_ms(lambda: (attend(*placed, True),
                                                         attend(placed[0], *earlier, False)), 5)
        expected = engine_attention.attention_chunk_cudnn(q, keys, values, start).float()
        for name, options in CANDIDATES.items():
            if n % 256:  # the last, unaligned chunk runs as the engine runs it
                totals[f"{name}_ms"] += engine_ms
                continue
            totals[f"{name}_ms"] += 16 * gpu_ms(lambda: chunk_candidate(q, keys, values, start, **options), 5)
            error = (chunk_candidate(q, keys, values, start, **options).float() - expected).abs().max().item()
            errors[name] = max(errors[name], error)
    return {**{k: round(v, 1) for k, v in totals.items()}, "max_abs_difference_from_engine": errors}


def host_time(lengths: tuple[int, ...] = (33_791, 67_447)) -> dict:
    """Where a long decide's wall time is not GPU work (module docstring)."""
    import tempfile

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench import build
    from bench import long_records as lr
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(tempfile.mkdtemp(prefix="clef-bench-tiny-")))
    engine = build.random_engine(build.clef_config("clef", tiny), tiny)
    out: dict = {"warm_up_s": round(engine.warm_up(), 1)}
    device = torch.device("cuda")
    for tokens in lengths:
        base = lr.request(engine, tokens)
        for sample in range(2):  # the length's plans and allocations made, as in a user's second call
            lr.timed_decide(engine, lr.fresh(base, sample))
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            with record_function("bench::decide"):
                engine.decide(lr.fresh(base, 7), max_length=2**31 - 1)
                torch.cuda.synchronize(device)
        events = prof.events()
        (call,) = [e for e in events if e.name == "bench::decide" and e.device_type == DeviceType.CPU]
        gpu = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        gaps = [(later[0] - earlier_end, earlier_end, later[0])
                for earlier_end, later in zip(_running_max_ends(gpu), gpu[1:]) if later[0] - earlier_end > 500]
        windows = [("before the first kernel", call.time_range.start, gpu[0][0]),
                   ("after the last kernel", max(end for _, end in gpu), call.time_range.end)]
        windows += [(f"gap {i}", start, end) for i, (_, start, end) in enumerate(sorted(gaps, reverse=True)[:6])]
        out[str(tokens)] = {
            "wall_ms": round(call.time_range.elapsed_us() / 1000, 1),
            "gpu_busy_ms": round(_union_us(gpu) / 1000, 1),
            "gaps_over_0.5ms": {"count": len(gaps), "ms": round(sum(g for g, _, _ in gaps) / 1000, 1)},
            "windows": [{"what": what, "ms": round((end - start) / 1000, 1), "cpu_ops": _cpu_ops_in(events, start, end)}
                        for what, start, end in windows],
        }
        print(tokens, json.dumps(out[str(tokens)])[:3000], flush=True)
    engine.close()
    return out


def _running_max_ends(intervals: list[tuple[int, int]]) -> list[int]:
    ends, latest = [], 0
    for _, end in intervals:
        latest = max(latest, end)
        ends.append(latest)
    return ends[:-1]


def _union_us(intervals: list[tuple[int, int]]) -> int:
    total, covered_to = 0, 0
    for start, end in intervals:
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def _cpu_ops_in(events, start: int, end: int) -> dict:
    """What the host ran inside [start, end): our Python frames that cover at least a fifth of it, outermost first
    (the call path holding the time), and the longest PyTorch / CUDA runtime operations in it."""
    from torch.autograd import DeviceType

    def overlap_ms(e) -> float:
        return (min(e.time_range.end, end) - max(e.time_range.start, start)) / 1000

    inside = [e for e in events if e.device_type == DeviceType.CPU and e.name != "bench::decide"
              and e.time_range.start < end and e.time_range.end > start]
    ours = ("clef_engine/", "tokenizers", "transformers/")
    frames = [e for e in inside if ".py(" in e.name and any(part in e.name for part in ours)
              and overlap_ms(e) >= 0.2 * (end - start) / 1000]
    ops = [e for e in inside if ".py(" not in e.name and not e.name.startswith("<")]
    return {"frames": [{"frame": e.name[-90:], "ms": round(overlap_ms(e), 2)}
                       for e in sorted(frames, key=lambda e: e.time_range.start)][:14],
            "ops": [{"op": e.name[:60], "ms": round(overlap_ms(e), 2)}
                    for e in sorted(ops, key=lambda e: -overlap_ms(e))[:6]]}


def main(out_path: str) -> None:
    """BENCH_SECTIONS (attention,gemm,host) picks the sections; the file is written after each."""
    sections = os.environ.get("BENCH_SECTIONS", "attention,gemm,host").split(",")
    result: dict = {"command": f"BENCH_SECTIONS={','.join(sections)} python bench/long_record_limits.py OUT.json",
                    "environment": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}}

    def save() -> None:
        Path(out_path).write_text(json.dumps(result, indent=1) + "\n")

    if "attention" in sections:
        result["attention"] = attention_times()
        result["chunk_attention_136k"] = chunk_attention_times()
        print("attention", json.dumps(result["attention"]), json.dumps(result["chunk_attention_136k"]), flush=True)
        save()
    if "gemm" in sections:
        rows_list = (CHUNK, TOKENS_136K % CHUNK, 2 * CHUNK)
        result["default"] = time_shapes(rows_list)
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_max_tuning_iterations(30)
        torch.cuda.tunable.set_filename(str(Path(out_path).with_suffix(".tunableop.csv")))
        result["tunableop"] = time_shapes(rows_list)
        torch.cuda.tunable.enable(False)
        result["record_136k_ms"] = {"default": record_136k_ms(result["default"]),
                                    "tunableop": record_136k_ms(result["tunableop"])}
        print("gemm", json.dumps(result["record_136k_ms"]), flush=True)
        save()
    if "host" in sections:
        torch.cuda.empty_cache()
        result["host_time"] = host_time()
        save()


if __name__ == "__main__":
    main(sys.argv[1])
