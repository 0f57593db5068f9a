# ruff: noqa: B023 — the timed closures run at once, inside the loop iteration that defines them
"""The paths users take, on the Clef-27B architecture on one H200, next to the release code's path, in one run
(issue 12).

    python bench/user_paths.py OUT.json                 (CUDA; flash-linear-attention installed)
    BENCH_CPU_SMOKE=1 python bench/user_paths.py OUT.json   (a scaled-down model on the CPU: checks the script only)

One engine with random bf16 weights of the Clef-27B shape (bench/build.py), built with the default configuration and
warmed up as `clef_engine.load` does. Baseline = the release code's path re-implemented in
`clef_engine.model.reference.reference_decide` (padded transformers text model with use_cache=False, then the
per-option Python-loop head): the release's own `joint_schema_model.py` is not in this repository. Sections:

- user_path: `Engine.decide` with the defaults (state cache on), a fresh state every call (its tokenizing timed),
  lengths drawn uniformly from 450-600, 900-1,150, 3,500-4,500 and 15,000-17,000 tokens; the baseline on the same
  requests, alternating.
- head_64x10_ms: the head alone, 64 questions x 10 options, as `decide` runs it.
- cached_16k_new_schema_ms: new schemas on a state of ~16k tokens decided once before (p50 of the hits).
- batch_run: 256 cases of 700-1,300 tokens through `decide_many` and through the workbench's JobRunner + SQLite.
- interactive_during_batch: p95 of a ~1k-token `decide` alone, and while a JobRunner run is going.
- concurrent_8: 8 closed-loop clients of ~1k-token requests: aggregate tokens/s, p50 and p95.
- fidelity: bench/fidelity.py's distances from the float32 truth (Clef-Flash shape), after the 27B engine is freed.

Writes OUT.json after every section: the keys issue 12 names at the top level, everything else under "detail".
BENCH_SHAPE=clef-flash runs the same sections on the Clef-Flash shape (issue 38: both models guarded; its
user_path p50s are copied to `flash."<bucket>".{release_ms, ours_ms}`); BENCH_PROFILE=4096 adds that length to the
profile section (decides with the cache on and off next to the forward alone). BENCH_SKIP=fidelity leaves the fidelity
section out; BENCH_ONLY=fidelity runs it alone (on the H200 it takes minutes
of its own: a Flash-shaped model, its float32 copy, and 55 records three ways). BENCH_BUCKETS=4096,16384 times only
those length buckets (the random lengths then differ from a full run's); BENCH_DEADLINE_S (560) skips the sections
that would not finish in time, so that a run inside a device call's limit still writes what it measured.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DEADLINE = time.perf_counter() + float(os.environ.get("BENCH_DEADLINE_S", "560"))
SCALE = 16 if SMOKE else 1  # lengths divided by this on the CPU
SHAPE = os.environ.get("BENCH_SHAPE", "clef")
BUCKETS = {"512": (450, 600, 16), "1024": (900, 1150, 16), "4096": (3500, 4500, 10), "16384": (15000, 17000, 5)}
WORDS = build.WORDS

results: dict = {"user_path": {}, "batch_run": {}, "interactive_during_batch": {}, "head_64x10_ms": None,
                 "cached_16k_new_schema_ms": None, "fidelity": {}, "concurrent_8": {}, "detail": {"errors": {}}}
OUT: Path


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


def sync() -> None:
    build.sync(DEVICE)


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


p = build.percentile
section = build.sections(left, lambda: save(), results["detail"]["errors"])


# ---- requests -----------------------------------------------------------------------------------------------------

def questions(count: int, options: int, seed: int) -> dict:
    return build.schema(count, options, seed, noul_every=4)


def sized_state(engine, tokens: int, schema: dict, seed: int) -> str:
    return build.sized_state(engine, tokens, schema, seed)


def request(engine, tokens: int, seed: int, schema: dict | None = None) -> dict:
    return build.sized_request(engine, tokens, schema or questions(4, 3, seed), seed)


def bucket_requests(engine, rng: random.Random, name: str) -> list[dict]:
    """The user path's requests of one length bucket (the first is the untimed one), drawn from `rng` in the order
    the buckets are run."""
    low, high, count = BUCKETS[name]
    count = 3 if SMOKE else count
    return [request(engine, rng.randint(low, high) // SCALE, seed=100_000 * (i + 1) + int(name))
            for i in range(count + 1)]


def distance(response: dict, reference: list[list[float]], record) -> tuple[float, int]:
    """(max |Δp|, argmax flips) of a System One response against the baseline's probabilities of the same record
    (model option order: noul true, false; choice sorted by id; score levels in order)."""
    worst, flips = 0.0, 0
    for question, want in zip(record.questions, reference):
        answer = response["answers"][question.id]
        if answer["type"] == "noul":
            got = [answer["noul"], 1 - answer["noul"]]
        else:
            probabilities = answer["probabilities"]
            keys = sorted(probabilities) if answer["type"] == "choice" else list(probabilities)
            got = [probabilities[k] for k in keys]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
        flips += int(max(range(len(got)), key=got.__getitem__) != max(range(len(want)), key=want.__getitem__))
    return round(worst, 4), flips


from clef_engine.model.reference import reference_decide  # noqa: E402

# ---- sections -----------------------------------------------------------------------------------------------------

def setup_counts(engine) -> dict[str, int]:
    """What a first call at a new shape may pay for besides its GPU work: the caching allocator's cudaMalloc calls
    and retries (`build.allocator_counts`) and the head's CUDA graph captures."""
    return {"head_graph_captures": engine.runner.head_graphs.captures, **build.allocator_counts(DEVICE)}


@section("user_path", needs_s=120)
def user_path(engine, ref) -> None:
    rng = random.Random(12)
    chosen = os.environ.get("BENCH_BUCKETS", ",".join(BUCKETS)).split(",")
    for name in BUCKETS:
        if name not in chosen:
            continue
        if left() < 60:
            results["detail"]["errors"][f"user_path_{name}"] = "skipped (time)"
            continue
        requests = bucket_requests(engine, rng, name)
        limit = {"max_length": 20_000} if int(name) > 4096 else {}  # 15k-17k tokens: over the default 16,384
        # one untimed call each at this length first: the baseline compiles, ours meets the schema shape
        ref([engine.encode(requests[0], **limit)])
        engine.decide(requests[0], **limit)
        ours, base, tokens, parity, setup = [], [], [], [], []
        for r in requests[1:]:
            # ours first: decide meets the state as a user's request does, its tokenization in the timed call
            # (encoding it first would leave its ids in the encoder's memo)
            before = setup_counts(engine)
            t0 = time.perf_counter()
            response = engine.decide(r, **limit)
            ours.append(ms(t0))
            setup.append({key: value - before[key] for key, value in setup_counts(engine).items()})
            record = engine.encode(r, **limit)
            tokens.append(len(record))
            sync()
            t0 = time.perf_counter()
            reference = ref([record])[0]
            sync()
            base.append(ms(t0))
            parity.append(distance(response, reference, record))
        row = {"baseline_p50_ms": p(base, 0.5), "ours_p50_ms": p(ours, 0.5), "ours_p95_ms": p(ours, 0.95)}
        detail = {"tokens": tokens, "baseline_ms": [round(t, 1) for t in base], "ours_ms": [round(t, 1) for t in ours],
                  "ratio_p50": round(row["baseline_p50_ms"] / row["ours_p50_ms"], 2),
                  "ours_p95_over_p50": round(row["ours_p95_ms"] / row["ours_p50_ms"], 2),
                  "max_dp_vs_baseline": max(d for d, _ in parity), "argmax_flips": sum(f for _, f in parity),
                  "questions": sum(len(r["questions"]) for r in requests[1:]), "setup_per_call": setup}
        if int(name) >= 4096:  # records of the same lengths (to a token or two) with the cache off
            engine.runner.state_cache.enabled = False
            off = []
            for r in requests[1:]:
                fresh = dict(r, state=f"again {r['state']}")  # a state new to the encoder's memo too
                t0 = time.perf_counter()
                engine.decide(fresh, **limit)
                off.append(ms(t0))
            engine.runner.state_cache.enabled = True
            detail["ours_cache_off_ms"] = [round(t, 1) for t in off]
            detail["ours_cache_off_p50_ms"] = p(off, 0.5)
            detail["cache_on_over_off_p50"] = round(row["ours_p50_ms"] / detail["ours_cache_off_p50_ms"], 3)
        results["user_path"][name] = row
        if SHAPE == "clef-flash":
            results.setdefault("flash", {})[name] = {"release_ms": row["baseline_p50_ms"],
                                                     "ours_ms": row["ours_p50_ms"]}
        results["detail"][f"user_path_{name}"] = detail
        print(f"  {name}: baseline {row['baseline_p50_ms']} ms, ours p50 {row['ours_p50_ms']} p95 "
              f"{row['ours_p95_ms']} ms, x{detail['ratio_p50']}", flush=True)
        save()
    results["detail"]["state_cache_after_user_path"] = engine.runner.state_cache.stats()


@section("head_64x10", needs_s=20)
def head_64x10(engine) -> None:
    schema = questions(64, 10, 64)
    record = engine.encode({"state": " ".join(WORDS * 8), "questions": schema}, max_length=2**31 - 1)
    runner = engine.runner
    hidden = torch.randn(len(record), runner.model.config.text_config.hidden_size, device=DEVICE, dtype=runner.dtype)

    def timed_head() -> list[float]:
        with torch.inference_mode():
            for _ in range(3):
                engine.runner.head_probabilities(hidden, [record], [0], [len(record)])
            times = []
            for _ in range(20):
                sync()
                t0 = time.perf_counter()
                engine.runner.head_probabilities(hidden, [record], [0], [len(record)])
                times.append(ms(t0))
        return times

    times = timed_head()
    results["head_64x10_ms"] = p(times, 0.5)
    results["detail"]["head_64x10"] = {"tokens": len(record), "ms": sorted(round(t, 2) for t in times)}
    with torch.inference_mode():
        graphed = engine.runner.head_probabilities(hidden, [record], [0], [len(record)])
        head_graphs = engine.runner.head_graphs
        head_graphs.disabled = "off for parity"  # the eager head on the same input
        eager = engine.runner.head_probabilities(hidden, [record], [0], [len(record)])
        head_graphs.disabled = None
    if engine.config.cuda_graphs:
        results["detail"]["head_64x10"]["head_graphs"] = engine.runner.head_graphs.describe()
    results["detail"]["head_64x10"]["graph_vs_eager_max_dp"] = round(max(
        abs(a - b) for qa, qb in zip(graphed[0], eager[0]) for a, b in zip(qa, qb)), 5)
    if DEVICE.type == "cuda":
        with torch.inference_mode():
            results["detail"]["head_64x10"]["profile"] = build.kernel_table(
                lambda: engine.runner.head_probabilities(hidden, [record], [0], [len(record)]), 3)


@section("cached_16k_new_schema", needs_s=30)
def cached_state(engine) -> None:
    engine.runner.state_cache.clear()
    state = sized_state(engine, 16_384 // SCALE - 400 // SCALE, questions(4, 3, 77), 77)
    variants = [{"model": "clef", "state": state, "questions": questions(4, 3, 900 + v)} for v in range(7)]
    t0 = time.perf_counter()
    engine.decide(variants[0])  # cold: answers and stores the state in one forward
    first = ms(t0)
    hits = []
    for r in variants[1:]:
        t0 = time.perf_counter()
        engine.decide(r)
        hits.append(ms(t0))
    results["cached_16k_new_schema_ms"] = p(hits, 0.5)
    last = engine.encode(variants[-1])
    hit_parity = distance(engine.decide(variants[-1]), reference_decide(engine.runner, [last])[0], last)
    results["detail"]["cached_16k_new_schema"] = {
        "tokens": len(engine.encode(variants[1])), "state_end": engine.encode(variants[1]).state_end,
        "cold_ms": round(first, 1), "hits_ms": [round(t, 1) for t in hits],
        "first_hit_captures_its_graph_ms": round(hits[0], 1), "cache": engine.runner.state_cache.stats(),
        "hit_vs_baseline_max_dp_flips": hit_parity}


@section("batch_run", needs_s=90)
def batch_run(engine) -> None:
    rng = random.Random(7)
    schema = questions(4, 3, 4)
    count = 24 if SMOKE else 256
    requests = [request(engine, rng.randint(700, 1300) // SCALE, seed=7000 + i, schema=schema) for i in range(count)]
    engine.decide_many(requests[:8])  # warm: pack shapes of this size
    sync()
    t0 = time.perf_counter()
    responses = engine.decide_many(requests)
    engine_s = time.perf_counter() - t0
    tokens = sum(r["usage"]["input_tokens"] for r in responses)
    with tempfile.TemporaryDirectory() as folder:
        workbench_s, workbench_tokens, progress = build.store_run(engine, requests, schema, Path(folder) / "w.sqlite3")
    results["batch_run"] = {"workbench_tokens_per_s": round(workbench_tokens / workbench_s),
                            "engine_tokens_per_s": round(tokens / engine_s)}
    results["detail"]["batch_run"] = {
        "cases": count, "tokens": tokens, "engine_decide_many_s": round(engine_s, 2),
        "workbench_s": round(workbench_s, 2), "workbench_tokens": workbench_tokens, "run": progress,
        "workbench_over_engine": round((tokens / engine_s) / (workbench_tokens / workbench_s), 3),
        "scheduler": vars(engine.scheduler.stats).copy()}


@section("interactive_during_batch", needs_s=60)
def interactive(engine) -> None:
    count = 4 if SMOKE else 12
    fresh = [request(engine, 1024 // SCALE, seed=30_000 + i) for i in range(2 * count)]
    idle = []
    for r in fresh[:count]:
        t0 = time.perf_counter()
        engine.decide(r)
        idle.append(ms(t0))
    rng = random.Random(8)
    schema = questions(4, 3, 5)
    bulk = [request(engine, rng.randint(700, 1300) // SCALE, seed=40_000 + i, schema=schema)
            for i in range(24 if SMOKE else 200)]
    loaded: list[float] = []
    done = threading.Event()

    def interactive_client():
        time.sleep(1.0 if not SMOKE else 0.2)  # the run is going by then
        for r in fresh[count:]:
            if done.is_set():
                break
            t0 = time.perf_counter()
            engine.decide(r)
            loaded.append(ms(t0))
            time.sleep(0.25)

    client = threading.Thread(target=interactive_client)
    client.start()
    with tempfile.TemporaryDirectory() as folder:
        seconds, tokens, progress = build.store_run(engine, bulk, schema, Path(folder) / "w.sqlite3")
    done.set()
    client.join()
    results["interactive_during_batch"] = {"idle_p95_ms": p(idle, 0.95),
                                           "loaded_p95_ms": p(loaded, 0.95) if loaded else None}
    results["detail"]["interactive_during_batch"] = {
        "idle_ms": [round(t, 1) for t in idle], "loaded_ms": [round(t, 1) for t in loaded],
        "batch_run_tokens_per_s": round(tokens / seconds), "bulk_batch_tokens": engine.config.bulk_batch_tokens}


@section("concurrent_8", needs_s=40)
def concurrent(engine, clients: int = 8, each: int = 6) -> None:
    each = 2 if SMOKE else each
    rng = random.Random(9)
    requests = [[request(engine, rng.randint(900, 1150) // SCALE, seed=50_000 + c * 100 + i) for i in range(each)]
                for c in range(clients)]
    latencies, tokens, wall = build.closed_loop(engine, requests)
    results["concurrent_8"] = {"tokens_per_s": round(tokens / wall), "p50_ms": p(latencies, 0.5),
                               "p95_ms": p(latencies, 0.95),
                               "p95_over_p50": round(p(latencies, 0.95) / p(latencies, 0.5), 2)}


@section("profile", needs_s=40)
def profile(engine) -> None:
    """Where a cold 16k record's GPU time goes (eager, as decide runs it), and a 1k decide's wall time vs its GPU
    time (graph replay)."""
    if DEVICE.type != "cuda":
        return
    out = {}
    extra = [int(n) for n in os.environ.get("BENCH_PROFILE", "").split(",") if n]
    for tokens in sorted({1024, 16_384, *extra}):
        limit = {"max_length": 20_000} if tokens > 4096 else {}
        engine.runner.state_cache.enabled = False
        record = engine.encode(request(engine, tokens, seed=60_000 + tokens), **limit)
        engine.runner.forward([record])
        out[str(tokens)] = {"tokens": len(record),
                            "forward_batch": build.kernel_table(lambda: engine.runner.forward([record]), 2)}
        engine.runner.state_cache.enabled = True
        if tokens in extra:  # what decide adds around the forward: the state cache's store, the head, the answer
            fresh = iter([request(engine, tokens, seed=61_000 + tokens + i, schema=questions(4, 3, 7))
                          for i in range(5)])  # built first: writing a sized state tokenizes it several times
            engine.decide(next(fresh), **limit)
            out[str(tokens)]["decide"] = build.kernel_table(lambda: engine.decide(next(fresh), **limit), 2)
            engine.runner.state_cache.enabled = False
            out[str(tokens)]["decide_cache_off"] = build.kernel_table(lambda: engine.decide(next(fresh), **limit), 2)
            engine.runner.state_cache.enabled = True
    results["detail"]["profile"] = out


@section("over_a_chunk", needs_s=90)
def over_a_chunk(engine) -> None:
    """What a record a little over one prefill chunk pays for a short last chunk (issue 38: the Clef-Flash ~16.9k
    bucket straddles the 16,384-token chunk, and its records over it took 20-45 ms more than linear in their
    length). New states of lengths under, a little over and well over the chunk, decided as users do, with a last
    chunk shorter than an eighth of one joining the chunk before it (the default, `chunk_bounds`) and run as a
    chunk of its own (as before), the two alternating; then the GPU time of one record ~550 tokens over, both ways."""
    from clef_engine.fast import packed

    chunk = engine.config.prefill_chunk_tokens
    if not chunk:
        return
    limit = {"max_length": 24_000}
    schema = questions(4, 3, 7)
    ways = {"short_chunk_joins": packed.SHORT_LAST_CHUNK, "short_chunk_alone": 2**62}  # 2**62: nothing joins

    def decide(way: str, r: dict) -> float:
        packed.SHORT_LAST_CHUNK = ways[way]
        t0 = time.perf_counter()
        engine.decide(r, **limit)
        return ms(t0)

    out: dict = {way: [] for way in ways}
    try:
        for over in (-300, 150, 550, 1200, 1900, 2600):
            target = chunk + over // SCALE
            for way in ways:
                out[way].append({"target": target, "tokens": [], "ms": []})
            for i in range(4):
                for way in ways:  # alternating, a new state each call
                    r = request(engine, target, seed=64_000 + 10 * over + 2 * i + (way == "short_chunk_alone"),
                                schema=schema)
                    out[way][-1]["tokens"].append(engine.count_tokens(r)["total"])
                    out[way][-1]["ms"].append(round(decide(way, r), 1))
            for way in ways:
                out[way][-1]["p50_ms"] = p(out[way][-1]["ms"], 0.5)
        if DEVICE.type == "cuda":
            fresh = iter([request(engine, chunk + 550, seed=65_000 + i, schema=schema) for i in range(4)])
            out["profiled"] = {way: build.kernel_table(lambda: decide(way, next(fresh)), 1) for way in ways}
    finally:
        packed.SHORT_LAST_CHUNK = ways["short_chunk_joins"]
    results["detail"]["over_a_chunk"] = out


@section("fidelity", needs_s=100)
def fidelity() -> None:
    from bench.fidelity import fidelity as measure

    out = measure("cpu" if SMOKE else "cuda", "tiny" if SMOKE else "flash", 8 if SMOKE else 55)
    results["fidelity"] = {key: out.get(key) for key in ("ours_max_dp", "release_max_dp", "ours_flips",
                                                         "release_flips")}
    # next to the headline counts: the same flips paired by question, and how noisy their difference is
    results["fidelity"]["paired"] = {k: v for k, v in out.get("paired", {}).items() if k != "per_question"}
    results["detail"]["fidelity"] = out


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    only = os.environ.get("BENCH_ONLY", "")  # "fidelity": that section alone (it needs a machine of its own)
    if only == "fidelity":
        fidelity()
        save()
        print(json.dumps(results["fidelity"]), results["detail"]["errors"])
        return 0
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", tempfile.mkdtemp(prefix="clef-bench-tiny-"))))
    config = build.clef_config(SHAPE, tiny)
    if SMOKE:
        build.scale_down(config)
    t0 = time.perf_counter()
    engine = build.random_engine(config, tiny, device=str(DEVICE), dtype=torch.float32 if SMOKE else torch.bfloat16,
                                 head_width=64 if SMOKE else 1024)
    detail = results["detail"]
    detail["build_s"] = round(time.perf_counter() - t0, 1)
    detail["command"] = " ".join(sys.argv)
    detail["config"] = {k: str(v) for k, v in vars(engine.config).items()}
    if DEVICE.type == "cuda":
        import transformers

        detail["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "gpu": torch.cuda.get_device_name()}
        detail["memory_loaded_gib"] = build.gib(engine.loaded_bytes)
        detail["warm_up_s"] = round(engine.warm_up(), 1)  # as clef_engine.load does
        detail["graphs"] = engine.info()["kernels"]["cuda_graphs"]
        detail["memory_after_warm_up_gib"] = build.gib(torch.cuda.memory_reserved())
        print("warm-up", detail["warm_up_s"], "s", detail["graphs"], flush=True)
    detail["kernels"] = engine.runner.info()["kernels"]
    save()

    ref = functools.partial(reference_decide, engine.runner)
    user_path(engine, ref)
    if only in ("user_path", "user_path,profile"):  # a follow-up run of that section (and the profile) alone
        if only.endswith("profile"):
            profile(engine)
            over_a_chunk(engine)
        detail["kernels_after"] = engine.runner.info()["kernels"]
        detail["state_cache"] = engine.runner.state_cache.stats()
        save()
        print(json.dumps(results["user_path"]), detail["errors"], detail.get("graphs"))
        return 0
    head_64x10(engine)
    cached_state(engine)
    batch_run(engine)
    interactive(engine)
    concurrent(engine)
    profile(engine)
    over_a_chunk(engine)
    if DEVICE.type == "cuda":
        detail["memory_peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
        detail["memory_peak_reserved_gib"] = build.gib(torch.cuda.max_memory_reserved())
    detail["scheduler"] = vars(engine.scheduler.stats).copy()
    detail["kernels_after"] = engine.runner.info()["kernels"]
    engine.close()
    del engine, ref
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    if "fidelity" not in os.environ.get("BENCH_SKIP", ""):
        fidelity()
    save()
    build.print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
