"""Long records on the Clef-27B architecture on one H200 (issue 25, "Long"): `Engine.decide` with the default
configuration at ~32k, ~67k and ~136k tokens, and the spread of records of 16k-17k tokens.

    python bench/long_records.py OUT.json                      (CUDA; flash-linear-attention installed; < 9 min)
    BENCH_CPU_SMOKE=1 python bench/long_records.py OUT.json    (a scaled-down model on the CPU: checks the script only)

One engine with random bf16 weights of the Clef-27B shape (bench/build.py), warmed up as `clef_engine.load` does.
Every call decides a new state (its first word differs, so the state cache never hits). Per length: one untimed call,
then `BENCH_SAMPLES` (2) timed calls (CUDA-synchronized wall time of `decide`), then one call under torch.profiler for
the GPU kernel time (the sum of its kernels' durations; copies apart) and that call's wall time; peak memory of the
length's calls, next to the weights + the record's attention K/V + 8 GiB that issue 25 allows. The release code's
figures are not re-timed: they are its second calls on the same lengths in the same kind of run, from
../shared/measurements/2026-12-02/release-vs-engine-27b.json (`long.<length>.release_ms[1]`, copied below).
Then `p95_over_p50_16k` over `BENCH_16K_SAMPLES` (10) records of 16,000-17,000 tokens after one untimed call, and,
if time is left, one ~67k call with the state cache off (what storing the state costs) and a ~262k record (with a
Clef-Flash-shaped engine resident too, if there is time to build it; then once more with the state cache off, for
its peak memory; then once more with the caching allocator tracing, for what its peak holds: `at_peak`).

Writes OUT.json after every step, in issue 25's layout: `long.<"32768"|"65536"|"131072">.{release_ms, ours_ms,
ours_gpu_ms}` (medians), `long."262144".{ours_ms, peak_gib, flash_resident}`, `p95_over_p50_16k`; everything else
under `detail`. BENCH_DEADLINE_S (500) is the time after start by which it stops starting calls that would not end
in time, so that a run inside a device call's limit still writes what it measured. BENCH_LENGTHS=32768,65536 runs
only those lengths; BENCH_SKIP=cache_off,longest leaves those steps out.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
if SMOKE:  # the scaled-down records are a few hundred tokens: chunk them as the H200 chunks ~100k-token records
    os.environ.setdefault("CLEF_PREFILL_CHUNK_TOKENS", "64")
DEVICE = torch.device("cpu" if SMOKE else "cuda")
STARTED = time.perf_counter()
DEADLINE = STARTED + float(os.environ.get("BENCH_DEADLINE_S", "500"))
SCALE = 32 if SMOKE else 1  # lengths divided by this on the CPU (~67k: ~2k tokens, past the state cache's least)
SKIP = set(filter(None, os.environ.get("BENCH_SKIP", "").split(",")))
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "2"))
SAMPLES_16K = int(os.environ.get("BENCH_16K_SAMPLES", "10"))
# target token counts: the lengths the release code was timed at (its record sizes, 2026-12-02)
LENGTHS = {"32768": 33_791, "65536": 67_447, "131072": 135_657}
LONGEST = ("262144", 262_000)
# the release's own code, second call at each length (the first builds plans and grows its allocator), same H200 and
# Clef-27B shape: ../shared/measurements/2026-12-02/release-vs-engine-27b.json, long.<length>.release_ms[1]
RELEASE_MS = {"32768": 4345.9, "65536": 9249.3, "131072": 22042.9}
RELEASE_SOURCE = "../shared/measurements/2026-12-02/release-vs-engine-27b.json (long.<length>.release_ms[1])"
GiB = 2**30

results: dict = {"long": {}, "p95_over_p50_16k": None, "detail": {"errors": {}, "release_source": RELEASE_SOURCE}}
OUT: Path


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


section = build.sections(left, save, results["detail"]["errors"])


def request(engine, tokens: int) -> dict:
    return build.sized_request(engine, tokens, build.schema(4, 3, tokens, noul_every=4), seed=tokens)


def fresh(base: dict, sample: int) -> dict:
    """`base` with a state of its own (a different first word: a cache miss, the same length to a token or two)."""
    return dict(base, state=f"{build.WORDS[sample % len(build.WORDS)]}{sample} {base['state']}")


def timed_decide(engine, body: dict) -> tuple[float, dict]:
    build.sync(DEVICE)
    t0 = time.perf_counter()
    response = engine.decide(body, max_length=2**31 - 1)
    build.sync(DEVICE)
    return (time.perf_counter() - t0) * 1000, response


def kernel_ms(engine, body: dict) -> dict:
    """One decide under torch.profiler: its wall time, the sum of its GPU kernels' durations (copies and memsets
    apart: the state cache's copies to host memory run on a side stream), the largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    build.sync(DEVICE)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed_decide(engine, body)
    kernels: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            into = copies if event.name.startswith(("Memcpy", "Memset")) else kernels
            entry = into.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us() / 1000
            entry[1] += 1
    # where the host waits, if it does: CUDA runtime calls (synchronizations, cudaMalloc/cudaFree, host allocations)
    runtime = [(e.key, round(e.cpu_time_total / 1000, 1), e.count) for e in prof.key_averages()
               if e.key.startswith("cuda") and e.cpu_time_total > 1000]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
    return {"wall_ms": round(wall, 1), "gpu_kernel_ms": round(sum(v[0] for v in kernels.values()), 1),
            "copies": {name: {"ms": round(ms, 1), "calls": n} for name, (ms, n) in copies.items()},
            "top": [(name[:100], round(ms, 1), n) for name, (ms, n) in top],
            "cuda_runtime_over_1ms": sorted(runtime, key=lambda row: -row[1])[:12]}


def memory_allowed_gib(engine, tokens: int) -> float:
    """Issue 25's bound: weights + the record's attention K/V + 8 GiB."""
    text = engine.runner.backbone.config
    attention_layers = sum(1 for kind in text.layer_types[: text.num_hidden_layers] if kind == "full_attention")
    kv_bytes = tokens * attention_layers * 2 * text.num_key_value_heads * text.head_dim * engine.config.dtype.itemsize
    return build.gib(engine.loaded_bytes + kv_bytes + 8 * GiB)


def one_length(engine, name: str, tokens: int, samples: int, *, profiled: bool = True) -> dict | None:
    """The untimed call, `samples` timed calls and one profiled call at ~`tokens`, each started only while it can
    end before the deadline (judged by the calls before it)."""
    base = request(engine, tokens // SCALE)
    out: dict = {"tokens": None, "ours_ms_all": []}
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEVICE)
        out["allocated_before_gib"] = build.gib(torch.cuda.memory_allocated(DEVICE))  # weights, graph pools, ...
    first, response = timed_decide(engine, fresh(base, 0))
    counts_before = build.allocator_counts(DEVICE)  # after the untimed call: what the timed ones cost
    out["tokens"] = response["usage"]["input_tokens"]
    out["first_call_ms"] = round(first, 1)
    longest_s = first / 1000
    for sample in range(1, samples + 1):
        if left() < 1.3 * longest_s:
            out["stopped"] = f"deadline: {left():.0f} s left"
            break
        wall, _ = timed_decide(engine, fresh(base, sample))
        out["ours_ms_all"].append(round(wall, 1))
        longest_s = max(longest_s, wall / 1000)
    out["allocator_during_timed_calls"] = {key: value - counts_before[key]
                                           for key, value in build.allocator_counts(DEVICE).items()}
    if profiled and DEVICE.type == "cuda" and left() > 2 * longest_s:
        out["profile"] = kernel_ms(engine, fresh(base, samples + 1))
    if DEVICE.type == "cuda":
        out["peak_gib"] = build.gib(torch.cuda.max_memory_allocated(DEVICE))
        out["peak_reserved_gib"] = build.gib(torch.cuda.max_memory_reserved(DEVICE))
        out["allowed_gib"] = memory_allowed_gib(engine, out["tokens"])
    out["state_cache"] = engine.info()["state_cache"]
    if out["ours_ms_all"]:
        out["ours_ms"] = round(statistics.median(out["ours_ms_all"]), 1)
    return out


def headline(name: str, measured: dict) -> dict:
    entry: dict = {"release_ms": RELEASE_MS.get(name), "ours_ms": measured.get("ours_ms"),
                   "ours_gpu_ms": measured.get("profile", {}).get("gpu_kernel_ms")}
    if entry["release_ms"] and entry["ours_ms"] and not SMOKE:
        entry["ratio"] = round(entry["release_ms"] / entry["ours_ms"], 2)
    if entry["ours_gpu_ms"] and entry["ours_ms"]:
        entry["wall_over_gpu"] = round(entry["ours_ms"] / entry["ours_gpu_ms"], 3)
    entry.update({key: measured[key] for key in ("tokens", "peak_gib", "allowed_gib") if key in measured})
    return entry


@section("long", needs_s=30)
def long(engine) -> None:
    chosen = os.environ.get("BENCH_LENGTHS", ",".join(LENGTHS)).split(",")
    for name, tokens in LENGTHS.items():
        if name not in chosen:
            continue
        # the untimed call and one sample must fit (~6k tokens/s at these lengths today, and requests to build)
        estimate_s = 2 * tokens / 6_000 + 5 if not SMOKE else 1
        if left() < estimate_s:
            results["detail"]["errors"][f"long_{name}"] = f"skipped: {left():.0f} s left"
            continue
        measured = one_length(engine, name, tokens, SAMPLES)
        results["detail"][f"long_{name}"] = measured
        results["long"][name] = headline(name, measured)
        print(name, json.dumps(results["long"][name]), flush=True)
        save()


@section("p95_16k", needs_s=40)
def p95_16k(engine) -> None:
    rng = random.Random(16)
    lengths = [rng.randint(16_000, 17_000) // SCALE for _ in range(SAMPLES_16K + 1)]
    walls, tokens = [], []
    for index, length in enumerate(lengths):
        if left() < 10:
            results["detail"]["errors"]["p95_16k"] = f"stopped after {len(walls)} samples (time)"
            break
        body = build.sized_request(engine, length, build.schema(4, 3, 16_000 + index, noul_every=4),
                                   seed=16_000 + index)
        wall, response = timed_decide(engine, body)
        if index:  # the first is the untimed one
            walls.append(round(wall, 1))
            tokens.append(response["usage"]["input_tokens"])
    if len(walls) >= 2:
        p50, p95 = build.percentile(walls, 0.5), build.percentile(walls, 0.95)
        results["p95_over_p50_16k"] = round(p95 / p50, 3)
        results["detail"]["p95_16k"] = {"ms": walls, "tokens": tokens, "p50_ms": p50, "p95_ms": p95,
                                        "samples": len(walls)}


@section("cache_off_65536", needs_s=60)
def cache_off(engine) -> None:
    """One ~67k call with the state cache off: the difference from the default is what storing a state costs."""
    cache = engine.runner.state_cache
    cache.enabled = False
    try:
        base = request(engine, LENGTHS["65536"] // SCALE)
        timed_decide(engine, fresh(base, 50))  # the first call at a length without the store is untimed
        wall, response = timed_decide(engine, fresh(base, 51))
        results["detail"]["cache_off_65536"] = {"ms": round(wall, 1), "tokens": response["usage"]["input_tokens"]}
    finally:
        cache.enabled = True


@section("longest", needs_s=150)
def longest(engine, tiny: Path) -> None:
    """One ~262k record, timed once after an untimed call, with a Clef-Flash-shaped engine (random bf16 weights, not
    warmed up) resident in the same process if there is time to build it (BENCH_FLASH_RESIDENT=0: never)."""
    name, tokens = LONGEST
    flash = None
    if os.environ.get("BENCH_FLASH_RESIDENT", "1") == "1" and left() > 240:
        t0 = time.perf_counter()
        config = build.clef_config("clef-flash", tiny)
        if SMOKE:
            build.scale_down(config)
        flash = build.random_engine(config, tiny, device=str(DEVICE), dtype=engine.config.dtype,
                                    head_width=64 if SMOKE else 1024)
        flash_bytes = sum(p.numel() * p.element_size() for module in (flash.runner.model, flash.runner.head)
                          for p in module.parameters())
        results["detail"]["flash_resident"] = {"build_s": round(time.perf_counter() - t0, 1),
                                               "weights_gib": build.gib(flash_bytes)}
    try:
        measured = one_length(engine, name, tokens, 1, profiled=False)
        if DEVICE.type == "cuda" and left() > 1.5 * measured["first_call_ms"] / 1000:
            # the same length once more without keeping the state: what computing the state adds to the peak
            engine.runner.state_cache.enabled = False
            torch.cuda.reset_peak_memory_stats(DEVICE)
            try:
                wall, _ = timed_decide(engine, fresh(request(engine, tokens // SCALE), 9))
            finally:
                engine.runner.state_cache.enabled = True
            measured["state_cache_off"] = {"ms": round(wall, 1),
                                           "peak_gib": build.gib(torch.cuda.max_memory_allocated(DEVICE))}
        if DEVICE.type == "cuda" and left() > 2 * measured["first_call_ms"] / 1000:
            # once more as decide runs it, the allocator tracing: what the peak is made of
            body = fresh(request(engine, tokens // SCALE), 10)
            try:
                measured["at_peak"] = build.memory_at_peak(DEVICE, lambda: timed_decide(engine, body))
            except Exception as error:  # noqa: BLE001 — a diagnostic: the measured call above stays recorded
                measured["at_peak"] = f"{type(error).__name__}: {error}"
    finally:
        if flash is not None:
            flash.close()
    results["detail"][f"long_{name}"] = measured
    allowed = measured.get("allowed_gib")
    if flash is not None and allowed is not None:  # the bound counts the weights of both resident models
        allowed = round(allowed + results["detail"]["flash_resident"]["weights_gib"], 2)
    results["long"][name] = {"ours_ms": measured.get("ours_ms"), "peak_gib": measured.get("peak_gib"),
                             "allowed_gib": allowed, "tokens": measured.get("tokens"),
                             "flash_resident": flash is not None}


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", tempfile.mkdtemp(prefix="clef-bench-tiny-"))))
    config = build.clef_config("clef", tiny)
    if SMOKE:
        build.scale_down(config)
    detail = results["detail"]
    t0 = time.perf_counter()
    engine = build.random_engine(config, tiny, device=str(DEVICE), dtype=torch.float32 if SMOKE else torch.bfloat16,
                                 head_width=64 if SMOKE else 1024)
    detail["build_s"] = round(time.perf_counter() - t0, 1)
    detail["command"] = " ".join(sys.argv)
    detail["config"] = {k: str(v) for k, v in vars(engine.config).items()}
    if DEVICE.type == "cuda":
        import transformers

        detail["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "gpu": torch.cuda.get_device_name()}
        detail["memory_loaded_gib"] = build.gib(engine.loaded_bytes)
        detail["warm_up_s"] = round(engine.warm_up(), 1)  # as clef_engine.load does
        print("warm-up", detail["warm_up_s"], "s", flush=True)
    detail["kernels"] = engine.runner.info()["kernels"]
    save()
    for step in (long, p95_16k, cache_off, longest):
        if step.__name__ in SKIP:
            detail["errors"][step.__name__] = "skipped (BENCH_SKIP)"
        else:
            step(engine, tiny) if step is longest else step(engine)
    detail["elapsed_s"] = round(time.perf_counter() - STARTED, 1)
    engine.close()
    save()
    build.print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
