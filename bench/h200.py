# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""Clef-27B architecture on one H200: the release code's path (baseline) and our engine, same run, same records.

    python bench/h200.py RESULTS_DIR            (CUDA; flash-linear-attention installed)
    BENCH_CPU_SMOKE=1 python bench/h200.py DIR  (a scaled-down model on the CPU: checks the script, times nothing)

Baseline = `clef_engine.model.reference.reference_decide`: the transformers text model on a right-padded batch with
use_cache=False, then the per-record / per-question / per-option Python-loop head, bf16. Ours = the engine's
packed path (`Engine.forward_batch`, `decide`, `decide_many`). Records are real requests encoded by the engine's
Encoder with the tiny release's tokenizer: a state of ordinary words sized to the target length, then a schema of
typed questions (so question and option spans are realistic). Times: CUDA-synchronized wall clock, median after
warm-up. Each section is independent: an error is recorded and the next section runs. Results are written to
RESULTS_DIR/h200.json after every section.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DEADLINE = time.perf_counter() + float(os.environ.get("BENCH_DEADLINE_S", "540"))
FLOOR_TOKENS_PER_S = 15_800
WORDS = build.WORDS

results: dict = {"sections": {}, "errors": {}}
OUT: Path


def save() -> None:
    (OUT / "h200.json").write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


def sync() -> None:
    build.sync(DEVICE)


def timed(fn, repeats: int, warmup: int = 1) -> dict:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return {"p50": round(statistics.median(times), 2), "min": round(min(times), 2),
            "p95": build.percentile(times, 0.95, 2), "n": repeats}


def _reset_peak() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _keep(name: str, value):
    """A section's result, with the peak memory it reached, under results["sections"]."""
    if isinstance(value, dict) and DEVICE.type == "cuda":
        value["peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
        value["peak_reserved_gib"] = build.gib(torch.cuda.max_memory_reserved())
    results["sections"][name] = value
    return value


section = build.sections(left, lambda: save(), results["errors"], keep=_keep, before=_reset_peak)


# ---- records ------------------------------------------------------------------------------------------------------

def schema(questions: int, options: int, seed: int) -> dict:
    """Choice questions; with 2 options every other one a noul."""
    return build.schema(questions, options, seed, noul_every=2 if options == 2 else None)


def sized_request(engine, tokens: int, questions: int = 4, options: int = 3, seed: int = 0) -> dict:
    """A request of about `tokens` tokens: words of state, then the schema."""
    return build.sized_request(engine, tokens, schema(questions, options, seed), seed)


def in_batches(engine, records: list) -> list:
    """forward_batch over scheduler-sized batches (the scheduler is what keeps a batch within the token budget)."""
    out, batch, tokens = [], [], 0
    for record in records + [None]:
        if record is not None and (not batch or tokens + len(record) <= engine.token_budget):
            batch.append(record)
            tokens += len(record)
            continue
        if batch:
            out += engine.forward_batch(batch)
        batch, tokens = ([record], len(record)) if record is not None else ([], 0)
    return out


def compare(ours: list, base: list) -> dict:
    worst, argmax_diff, options = 0.0, 0, 0
    for record_ours, record_base in zip(ours, base):
        for q_ours, q_base in zip(record_ours, record_base):
            worst = max(worst, max(abs(a - b) for a, b in zip(q_ours, q_base)))
            argmax_diff += int(max(range(len(q_ours)), key=q_ours.__getitem__)
                               != max(range(len(q_base)), key=q_base.__getitem__))
            options += len(q_ours)
    return {"max_abs_dp": round(worst, 6), "argmax_differences": argmax_diff, "options": options,
            "ok": worst <= 2e-2 and argmax_diff == 0}


# ---- sections -----------------------------------------------------------------------------------------------------

@section("environment")
def environment(engine) -> dict:
    import transformers

    try:
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except ImportError as error:
        fla_version = f"absent ({error})"
    import triton
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
            "fla": fla_version, "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
            "kernels": engine.kernel_info()}


@section("smoke_parity_1k", needs_s=20)
def smoke(engine, ref) -> dict:
    record = engine.encode(sized_request(engine, 1024, seed=11))
    base = ref([record])
    ours = engine.forward_batch([record])
    two = engine.forward_batch([engine.encode(sized_request(engine, 700, seed=12)), record])
    out = compare(ours, base)
    out["packed_two_vs_base"] = compare(two[1:], base)
    # the release path's own bf16 noise: the same record alone vs right-padded in a batch with a longer one
    longer = engine.encode(sized_request(engine, 1500, seed=13))
    out["baseline_noise_batch_vs_alone"] = compare(ref([record, longer])[:1], base)
    out["tokens"] = len(record)
    out["example_probabilities_ours"] = [[round(p, 4) for p in q] for q in ours[0]]
    out["example_probabilities_baseline"] = [[round(p, 4) for p in q] for q in base[0]]
    return out


def diagnose(engine, ref) -> dict:
    """If our path errs or disagrees, swap our kernels for the PyTorch ones one slot at a time and keep what works."""
    from clef_engine.fast import kernels as K

    record = engine.encode(sized_request(engine, 1024, seed=11))
    base = ref([record])
    plain = K.Kernels()
    found = {}
    for name in K.Kernels.SLOTS:
        try:
            ok = compare(engine.forward_batch([record]), base)["ok"]
        except Exception as error:  # noqa: BLE001
            ok, found[f"error_before_{name}"] = False, repr(error)[:300]
        if ok:
            break
        engine.use_kernels(replace(engine.backbone.kernels, **{name: getattr(plain, name)}))
        found[name] = "replaced by the PyTorch function"
    return found


@section("single_record", needs_s=60)
def single_record(engine, ref, lengths, base_repeats) -> dict:
    engine.state_cache.enabled = False  # cold prefill every time: no cached prefixes here
    out = {}
    for n in lengths:
        if left() < 30:
            out[str(n)] = "skipped (time)"
            continue
        record = engine.encode(sized_request(engine, n, seed=n))
        repeats = base_repeats(n)
        base_probs = ref([record])
        row = {"tokens": len(record), "floor_ms": build.floor_ms(len(record))}
        row["baseline"] = timed(lambda: ref([record]), repeats, warmup=1)
        row["ours"] = timed(lambda: engine.forward_batch([record]), max(5, repeats), warmup=2)
        row["parity"] = compare(engine.forward_batch([record]), base_probs)
        row["speedup"] = round(row["baseline"]["p50"] / row["ours"]["p50"], 2)
        row["ours_tokens_per_s"] = round(len(record) / row["ours"]["p50"] * 1000)
        out[str(n)] = row
        print(f"  {n}: base {row['baseline']['p50']} ms, ours {row['ours']['p50']} ms, x{row['speedup']}, "
              f"{row['parity']}", flush=True)
        save()
    request = sized_request(engine, 1024, seed=1024)
    out["decide_1k_end_to_end"] = timed(lambda: engine.decide(request), 8, warmup=2)
    engine.state_cache.enabled = True
    return out


@section("profile_one_record", needs_s=30)
def profile_one_record(engine, tokens: int = 512) -> dict:
    """GPU time per kernel category of one eager forward (torch.profiler), for the 'what limits the rest' notes."""
    from bench.profile_h200 import kernel_table
    from clef_engine.fast.segments import make_segments

    record = engine.encode(sized_request(engine, tokens, seed=tokens))
    ids = torch.tensor(record.input_ids, device=DEVICE)
    segments = make_segments([len(record)], DEVICE)
    engine.backbone.forward(ids, segments)
    return {"tokens": len(record), "eager": kernel_table(lambda: engine.backbone.forward(ids, segments), 3)}


@section("head_alone", needs_s=20)
def head_alone(engine) -> dict:
    from clef_engine.model.reference import reference_logits

    out = {}
    for questions, options in ((1, 2), (4, 3), (16, 5), (64, 10)):
        request = sized_request(engine, 0, questions, options, seed=questions)  # state empty: schema-sized record
        request["state"] = " ".join(WORDS * 8)
        record = engine.encode(request, max_length=2**31 - 1)
        hidden = torch.randn(len(record), engine.backbone.config.hidden_size, device=DEVICE, dtype=engine.dtype)

        def baseline():
            logits = reference_logits(engine.head, hidden, engine.output_embeddings, record)
            return [torch.softmax(q.float(), 0).tolist() for q in logits]

        def ours():
            return engine.head_probabilities(hidden, [record], [0], [len(record)])

        with torch.inference_mode():
            row = {"tokens": len(record), "baseline": timed(baseline, 8, warmup=2), "ours": timed(ours, 20, warmup=3)}
            row["parity"] = compare(ours()[0:1], [baseline()])
            if questions == 64 and DEVICE.type == "cuda":
                from bench.profile_h200 import kernel_table

                row["profile"] = kernel_table(ours, 3)
        row["speedup"] = round(row["baseline"]["p50"] / row["ours"]["p50"], 2)
        out[f"{questions}x{options}"] = row
        print(f"  head {questions}x{options}: base {row['baseline']['p50']} ms ours {row['ours']['p50']} ms",
              flush=True)
    return out


@section("case_set", needs_s=90)
def case_set(engine, ref, count: int, baseline_count: int, batch: int) -> dict:
    rng = random.Random(7)
    requests = [sized_request(engine, rng.randint(700, 1300), seed=1000 + i) for i in range(count)]
    records = [engine.encode(r) for r in requests]
    tokens = sum(len(r) for r in records)
    engine.forward_batch(records[:64])  # warm-up: a full-size pack (first-use compiles of large-pack shapes)
    sync()
    t0 = time.perf_counter()
    ours = in_batches(engine, records)
    sync()
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.decide_many(requests)
    sync()
    decide_many_s = time.perf_counter() - t0
    out = {"records": count, "tokens": tokens,
           "ours": {"seconds": round(ours_s, 2), "tokens_per_s": round(tokens / ours_s),
                    "records_per_s": round(count / ours_s, 2)},
           "ours_decide_many_incl_encoding": {"seconds": round(decide_many_s, 2),
                                              "tokens_per_s": round(tokens / decide_many_s)}}
    save()
    base_records = records[:baseline_count]
    base_tokens = sum(len(r) for r in base_records)
    ref(base_records[:batch])  # warm-up
    sync()
    t0 = time.perf_counter()
    base = []
    for start in range(0, len(base_records), batch):
        if left() < 15:
            break
        base.extend(ref(base_records[start: start + batch]))
    sync()
    base_s = time.perf_counter() - t0
    if not base:
        raise RuntimeError(f"no time left for the baseline; ours: {out}")
    done_tokens = sum(len(r) for r in base_records[: len(base)])
    out["baseline"] = {"records": len(base), "batch": batch, "seconds": round(base_s, 2),
                       "tokens_per_s": round(done_tokens / base_s), "records_per_s": round(len(base) / base_s, 2)}
    out["speedup_tokens_per_s"] = round(out["ours"]["tokens_per_s"] / out["baseline"]["tokens_per_s"], 2)
    out["parity"] = compare(ours[: len(base)], base)
    same = records[: len(base)]
    sync()
    t0 = time.perf_counter()
    in_batches(engine, same)
    sync()
    out["ours_same_records"] = {"records": len(same), "tokens_per_s": round(done_tokens / (time.perf_counter() - t0))}
    out["speedup_same_records"] = round(out["ours_same_records"]["tokens_per_s"] / out["baseline"]["tokens_per_s"], 2)
    out["floor_fraction"] = round(out["ours"]["tokens_per_s"] / FLOOR_TOKENS_PER_S, 2)
    del base_tokens
    return out


@section("concurrent_8", needs_s=40)
def concurrent(engine, clients: int = 8, each: int = 6) -> dict:
    engine.state_cache.enabled = False
    requests = [[sized_request(engine, 1024, seed=5000 + c * 100 + i) for i in range(each)] for c in range(clients)]
    engine.decide_many([r for mine in requests for r in mine[:1]], priority="interactive")  # warm-up: pack shapes
    single = timed(lambda: engine.decide(requests[0][0]), 8, warmup=2)
    latencies, _, wall = build.closed_loop(engine, requests)
    p95 = build.percentile(latencies, 0.95)
    engine.state_cache.enabled = True
    return {"clients": clients, "requests_each": each, "single_decide_ms": single,
            "p50_ms": round(statistics.median(latencies), 1), "p95_ms": p95,
            "p95_over_single": round(p95 / single["p50"], 2), "wall_s": round(wall, 2),
            "records_per_s": round(clients * each / wall, 2), "scheduler": vars(engine.scheduler.stats).copy()}


@section("cached_state_16k", needs_s=30)
def cached_state(engine, ref, tokens: int = 16_384) -> dict:
    engine.state_cache.clear()
    engine.state_cache.enabled = True
    base_request = sized_request(engine, tokens - 400, seed=77)
    state = base_request["state"]
    variants = []
    for v in range(4):
        request = {"model": "clef", "state": state, "questions": schema(4, 3, seed=900 + v)}
        variants.append(request)
    t0 = time.perf_counter()
    first = engine.decide(variants[0])  # miss: computes the prefix, stores it, then continues
    sync()
    first_ms = (time.perf_counter() - t0) * 1000
    hit_times = []
    for request in variants[1:]:
        sync()
        t0 = time.perf_counter()
        engine.decide(request)
        sync()
        hit_times.append((time.perf_counter() - t0) * 1000)
    # where a hit's time goes: encoding (the state's tokens are memoized) vs the continuation + head on the GPU
    from bench.profile_h200 import kernel_table

    t0 = time.perf_counter()
    record = engine.encode(variants[-1])
    encode_ms = (time.perf_counter() - t0) * 1000
    state_entry = engine.prefix.lookup(record)
    hit_path = hit_profile = None
    if state_entry is not None and DEVICE.type == "cuda":  # the CPU smoke model's cache may not keep the entry
        def hit_once():
            return engine.head_one(*engine.prefix.forward_after(record, state_entry), record)

        with torch.inference_mode():
            hit_path = timed(hit_once, 5, 1)
            hit_profile = kernel_table(hit_once, 2)
    # parity of a hit against the baseline and against our uncached path on the same record
    hit = engine.forward_batch([record])
    engine.state_cache.enabled = False
    uncached = engine.forward_batch([record])
    engine.state_cache.enabled = True
    base = ref([record])
    return {"tokens": len(record), "state_prefix_tokens": record.state_end,
            "schema_suffix_tokens": len(record) - record.state_end,
            "first_decide_ms_miss_and_store": round(first_ms, 1),
            "new_schema_decide_ms": sorted(hit_times), "new_schema_p50_ms": round(statistics.median(hit_times), 1),
            "encode_ms": round(encode_ms, 1), "forward_after_prefix": hit_path,
            "forward_after_prefix_profile": hit_profile,
            "parity_hit_vs_baseline": compare(hit, base), "parity_hit_vs_uncached": compare(hit, uncached),
            "cache": engine.state_cache.stats(), "first_answer_model": first["model"]}


def flip_margins(ours: list, base: list) -> list[float]:
    """For each question whose argmax differs: the baseline's gap between its top two options."""
    gaps = []
    for record_ours, record_base in zip(ours, base):
        for q_ours, q_base in zip(record_ours, record_base):
            if max(range(len(q_ours)), key=q_ours.__getitem__) != max(range(len(q_base)), key=q_base.__getitem__):
                top = sorted(q_base, reverse=True)
                gaps.append(round(top[0] - top[1], 4))
    return gaps


@section("bf16_noise", needs_s=40)
def bf16_noise(engine, ref, count: int = 16) -> dict:
    """How far the release path moves from itself in bf16 when only the batching or the attention kernel changes,
    next to how far ours is from it: the scale against which the 2e-2 / argmax parity targets can be read."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    engine.state_cache.enabled = False
    rng = random.Random(7)
    records = [engine.encode(sized_request(engine, rng.randint(700, 1300), seed=1000 + i)) for i in range(count)]
    batched = [p for s in range(0, count, 8) for p in ref(records[s: s + 8])]
    alone = [ref([r])[0] for r in records]
    other = SDPBackend.EFFICIENT_ATTENTION if DEVICE.type == "cuda" else SDPBackend.MATH
    with sdpa_kernel([other]):
        other_attention = [p for s in range(0, count, 8) for p in ref(records[s: s + 8])]
    packed = engine.forward_batch(records)
    single = [engine.forward_batch([r])[0] for r in records]
    engine.state_cache.enabled = True
    gaps = sorted(round(sorted(q, reverse=True)[0] - sorted(q, reverse=True)[1], 4) for r in batched for q in r)
    out = {"records": count, "questions": sum(len(r) for r in batched)}
    for name, ours_or_theirs in (("release_alone_vs_release_batched", alone),
                                 ("release_other_sdpa_kernel_vs_release", other_attention),
                                 ("ours_packed_vs_release", packed), ("ours_single_vs_release", single)):
        row = compare(ours_or_theirs, batched)
        row["flip_margins"] = flip_margins(ours_or_theirs, batched)
        out[name] = row
    out["ours_packed_vs_ours_single"] = compare(packed, single)
    out["release_top2_gap_smallest"] = gaps[:10]
    out["release_top2_gap_median"] = gaps[len(gaps) // 2]
    return out


def table() -> str:
    s = results["sections"]
    lines = ["| case | baseline | ours | ratio | target | met |", "|---|---|---|---|---|---|"]

    def add(name, base, ours, ratio, target, met):
        lines.append(f"| {name} | {base} | {ours} | {ratio} | {target} | {met} |")

    single = s.get("single_record") or {}
    targets = {"512": 3.0, "1024": 2.2, "16384": 1.4}
    for n, row in single.items():
        if isinstance(row, dict) and "baseline" in row and "speedup" in row:
            target = targets.get(n)
            add(f"one record, {row['tokens']} tokens", f"{row['baseline']['p50']} ms", f"{row['ours']['p50']} ms",
                f"{row['speedup']}x", f">= {target}x" if target else "", ("yes" if row["speedup"] >= target else "no")
                if target else "")
    for name, row in (s.get("head_alone") or {}).items():
        if not isinstance(row, dict):
            continue
        target = "<= 5 ms" if name == "64x10" else ""
        add(f"head alone {name}", f"{row['baseline']['p50']} ms", f"{row['ours']['p50']} ms", f"{row['speedup']}x",
            target, ("yes" if row["ours"]["p50"] <= 5 else "no") if target else "")
    case = s.get("case_set")
    if case and "baseline" in case:
        add(f"case set ({case['records']} records)", f"{case['baseline']['tokens_per_s']} tok/s",
            f"{case['ours']['tokens_per_s']} tok/s", f"{case['speedup_tokens_per_s']}x", ">= 1.6x and >= 11k tok/s",
            "yes" if case["speedup_tokens_per_s"] >= 1.6 and case["ours"]["tokens_per_s"] >= 11_000 else "no")
    conc = s.get("concurrent_8")
    if conc:
        add("8 concurrent clients, 1k", "", f"p50 {conc['p50_ms']} / p95 {conc['p95_ms']} ms",
            f"p95 = {conc['p95_over_single']}x single", "p95 <= 2.5x single", "yes" if conc["p95_over_single"] <= 2.5
            else "no")
    cached = s.get("cached_state_16k")
    if cached:
        base16 = (single.get("16384") or {}).get("baseline", {}).get("p50", "")
        add("new schema on cached 16k state", f"{base16} ms", f"{cached['new_schema_p50_ms']} ms", "", "<= 120 ms",
            "yes" if cached["new_schema_p50_ms"] <= 120 else "no")
    noise = s.get("bf16_noise")
    if noise:
        for name in ("ours_packed_vs_release", "ours_single_vs_release", "release_alone_vs_release_batched",
                     "release_other_sdpa_kernel_vs_release"):
            row = noise[name]
            add(f"bf16 parity, {noise['records']} records: {name.replace('_', ' ')}", "", f"max dp {row['max_abs_dp']}",
                f"{row['argmax_differences']} argmax flips (release top-2 gaps {row['flip_margins']})",
                "<= 0.02, 0 flips" if name.startswith("ours") else "(noise scale)",
                ("yes" if row["ok"] else "no") if name.startswith("ours") else "")
    return "\n".join(lines)


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.mkdir(parents=True, exist_ok=True)
    from clef_engine.model.reference import reference_decide
    from clef_engine.model.release import ARCHITECTURE
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", "/tmp/clef-bench-tiny")))
    config = build.clef_config("clef", tiny)
    if SMOKE:  # a scaled-down copy of the architecture so the whole script runs on a CPU
        build.scale_down(config)
    assert ARCHITECTURE in config["architectures"]
    t0 = time.perf_counter()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = build.random_engine(config, tiny, device=str(DEVICE), dtype=torch.float32 if SMOKE else torch.bfloat16,
                                 head_width=64 if SMOKE else 1024)
    sync()
    results["build_s"] = round(time.perf_counter() - t0, 1)  # the model, the head and the engine around them
    results["backbone_parameters"] = build.parameter_count(engine.model)
    results["head_parameters"] = build.parameter_count(engine.head)
    results["memory_loaded_gib"] = build.gib(engine.loaded_bytes) if DEVICE.type == "cuda" else None
    if DEVICE.type == "cuda":  # as clef_engine.load does: compile and autotune before the first request
        results["warm_up_s"] = round(engine.warm_up(), 1)
        print("warm-up", results["warm_up_s"], "s", flush=True)
    results["command"] = " ".join(sys.argv)
    print("built", results["build_s"], "s", results["backbone_parameters"] / 1e9, "B params", flush=True)

    def ref(records):
        return reference_decide(engine, records)

    environment(engine)
    only = os.environ.get("BENCH_ONLY")
    if only:  # a follow-up run of some sections only
        if "concurrent" in only:
            concurrent(engine, 8, 6)
        if "case" in only:
            case_set(engine, ref, 256, int(os.environ.get("BENCH_BASELINE_RECORDS", "96")), 8)
        results["kernels_final"] = engine.kernel_info()
        results["table"] = table()
        save()
        print(results["table"])
        return 0
    parity = smoke(engine, ref)
    if parity is None or not parity.get("ok"):
        results["diagnosis"] = diagnose(engine, ref)
        print("diagnosis", results["diagnosis"], flush=True)
        results["sections"]["environment_after_diagnosis"] = engine.kernel_info()
    lengths = [512, 1024, 2048] if SMOKE else [512, 1024, 2048, 4096, 8192, 16384]
    single_record(engine, ref, lengths, lambda n: 2 if SMOKE else (4 if n <= 4096 else 2))
    if DEVICE.type == "cuda":
        profile_one_record(engine)
    head_alone(engine)
    cached_state(engine, ref, 16_384 if not SMOKE else 2_600)
    baseline_records = 16 if SMOKE else int(os.environ.get("BENCH_BASELINE_RECORDS", "128"))
    case_set(engine, ref, 24 if SMOKE else 256, baseline_records, 8)
    concurrent(engine, 8, 2 if SMOKE else 6)
    bf16_noise(engine, ref, 8 if SMOKE else 16)
    results["kernels_final"] = engine.kernel_info()
    if DEVICE.type == "cuda":
        results["memory_run_peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
    results["table"] = table()
    save()
    print(results["table"])
    print("errors:", list(results["errors"]))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
