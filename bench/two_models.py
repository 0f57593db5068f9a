"""Clef-27B-shaped and Clef-Flash-shaped engines resident together on one H200 (issue 14): memory of each, and
throughput of each alone and of both at once sharing the GPU queue.

    python bench/two_models.py OUT.json                  (CUDA; flash-linear-attention installed; < 5 minutes)
    BENCH_CPU_SMOKE=1 python bench/two_models.py OUT.json   (scaled-down shapes on the CPU: checks the script only)

Both engines have random bf16 weights (bench/build.py: never zeros) and the tiny release's tokenizer, so one case set
encodes identically for both: 64 cases of ~1k tokens (900-1,150), 4 questions of 3 options, built like
bench/user_paths.py builds requests. Sections:

- memory: allocated / reserved after each engine is built, the memory check's estimate for the published models
  (clef_engine.memory) beside what was measured, and whether the check lets Flash in beside Clef here;
- alone: `decide_many` of the case set on each engine by itself (tokens/s), after one untimed pass of it that
  compiles and autotunes;
- together: the same, both engines at once from two threads (their schedulers share the device's GpuTurn): each
  one's tokens/s and wall time, the total, and how long each waited for the other;
- interactive: `decide` latency on Flash alone (after an untimed pass), and while Clef runs the case set (the turn
  lets an interactive batch of another engine in between the bulk batch's layers);
- peak allocated / reserved over the run.

CUDA graphs are off (CLEF_CUDA_GRAPHS=0 unless set): bulk batches do not use them, and capturing every length
bucket of two models would take minutes of the five. Writes OUT.json after every section.
"""

from __future__ import annotations

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

os.environ.setdefault("CLEF_CUDA_GRAPHS", "0")

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DEADLINE = time.perf_counter() + float(os.environ.get("BENCH_DEADLINE_S", "280"))
SCALE = 16 if SMOKE else 1  # lengths divided by this on the CPU
CASES = 16 if SMOKE else 64
MODELS = ("clef", "clef-flash")

results: dict = {"memory": {}, "alone": {}, "together": {}, "interactive": {}, "detail": {"errors": {}}}
OUT: Path


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


section = build.sections(left, lambda: save(), results["detail"]["errors"])


def memory_now() -> dict:
    if DEVICE.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": build.gib(torch.cuda.memory_allocated()),
            "reserved_gib": build.gib(torch.cuda.memory_reserved()), "free_gib": build.gib(free),
            "total_gib": build.gib(total)}


def case_set(engine) -> list[dict]:
    rng = random.Random(14)
    schema = build.schema(4, 3, seed=14, noul_every=4)
    return [build.sized_request(engine, rng.randint(900, 1150) // SCALE, schema, seed=14_000 + i)
            for i in range(CASES)]


def tokens_per_s(engine, cases: list[dict]) -> dict:
    t0 = time.perf_counter()
    responses = engine.decide_many(cases)
    build.sync(DEVICE)
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["input_tokens"] for r in responses)
    return {"tokens_per_s": round(tokens / wall), "wall_s": round(wall, 2), "tokens": tokens, "cases": len(cases)}


# ---- sections -----------------------------------------------------------------------------------------------------

def build_engines(tiny: Path) -> dict:
    engines = {}
    for name in MODELS:
        config = build.clef_config(name, tiny)
        if SMOKE:
            build.scale_down(config)
        before = torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0
        t0 = time.perf_counter()
        engine = build.random_engine(config, tiny, device=str(DEVICE),
                                     dtype=torch.float32 if SMOKE else torch.bfloat16,
                                     head_width=64 if SMOKE else 1024)
        engine.model_id = f"{name}-shaped-random"
        engines[name] = engine
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()  # building randomizes in place; loading a release leaves no such scratch
        # this engine's weights: what it added to the allocated memory (engine.loaded_bytes counts the other's too)
        loaded = (torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0) - before
        results["memory"][f"after_{name}"] = {"build_s": round(time.perf_counter() - t0, 1),
                                              "loaded_gib": build.gib(loaded),
                                              "backbone_parameters": engine.backbone_parameters, **memory_now()}
        save()
    return engines


@section("memory_check", needs_s=0)
def memory_check(engines: dict) -> None:
    """The estimate clef_engine.memory makes for the published releases (no files here: their published sizes) next
    to what the engines measured, and the check's verdict for Flash beside Clef on this device now."""
    from clef_engine import memory

    config = engines["clef"].config
    out = {}
    for name, repo in (("clef", "Cloudflare/clef"), ("clef-flash", "Cloudflare/clef-flash")):
        estimate = memory.estimate(repo, config=config)
        out[name] = {"estimate_weights_gib": build.gib(estimate.weights),
                     "estimate_margin_gib": build.gib(estimate.margin),
                     "estimate_total_gib": build.gib(estimate.total),
                     "measured_loaded_gib": results["memory"][f"after_{name}"]["loaded_gib"]}
    if DEVICE.type == "cuda":
        # Flash is already resident here, so what is free now stands for "after Clef and Flash": the question is
        # whether a third model of Flash's size would be let in, and the answer must match the arithmetic.
        free = memory.free_bytes(DEVICE)
        need = memory.estimate("Cloudflare/clef-flash", config=config)
        out["another_flash_now"] = {"free_gib": build.gib(free), "needs_gib": build.gib(need.total),
                                    "fits": need.total <= free}
    results["memory"]["check"] = out


@section("alone", needs_s=30)
def alone(engines: dict, cases: list[dict]) -> None:
    for name, engine in engines.items():
        engine.decide_many(cases)  # untimed: compiles and autotunes this model's shapes (Triton keys on lengths)
        results["alone"][name] = tokens_per_s(engine, cases)
        save()


@section("together", needs_s=30)
def together(engines: dict, cases: list[dict]) -> None:
    waits_before = {n: e.scheduler.stats.turn_wait_seconds for n, e in engines.items()}
    batches_before = {n: e.scheduler.stats.batches for n, e in engines.items()}
    measured: dict = {}

    def run(name: str) -> None:
        measured[name] = tokens_per_s(engines[name], cases)

    wall = build.in_threads(run, list(engines))
    for name, engine in engines.items():
        measured[name]["waited_for_turn_s"] = round(engine.scheduler.stats.turn_wait_seconds - waits_before[name], 2)
        measured[name]["batches"] = engine.scheduler.stats.batches - batches_before[name]
    total_tokens = sum(m["tokens"] for m in measured.values())
    results["together"] = {**measured, "total_tokens_per_s": round(total_tokens / wall), "wall_s": round(wall, 2),
                           "same_turn": engines["clef"].scheduler.turn is engines["clef-flash"].scheduler.turn}


@section("interactive", needs_s=30)
def interactive(engines: dict, cases: list[dict]) -> None:
    flash, clef = engines["clef-flash"], engines["clef"]
    probes = case_set(flash)[: 4 if SMOKE else 12]
    for request in probes:  # untimed: single records of these lengths compile once
        flash.decide(request)
    idle = []
    for request in probes:
        t0 = time.perf_counter()
        flash.decide(request)
        idle.append((time.perf_counter() - t0) * 1000)
    busy: list[float] = []
    bulk = threading.Thread(target=clef.decide_many, args=(cases,))
    bulk.start()
    time.sleep(0.2 if SMOKE else 1.0)  # Clef's run is going by then
    for request in probes:
        if not bulk.is_alive():
            break
        t0 = time.perf_counter()
        flash.decide(request)
        busy.append((time.perf_counter() - t0) * 1000)
    bulk.join()
    p = build.percentile
    results["interactive"] = {
        "flash_idle_p50_ms": p(idle, 0.5), "flash_idle_p95_ms": p(idle, 0.95),
        "flash_during_clef_bulk_p50_ms": p(busy, 0.5) if busy else None,
        "flash_during_clef_bulk_p95_ms": p(busy, 0.95) if busy else None, "samples_during": len(busy),
        "clef_bulk_batch_tokens": clef.config.bulk_batch_tokens}


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(Path(os.environ.get("BENCH_TINY_DIR", tempfile.mkdtemp(prefix="clef-bench-tiny-"))))
    detail = results["detail"]
    detail["command"] = " ".join(sys.argv)
    if DEVICE.type == "cuda":
        import transformers

        torch.cuda.reset_peak_memory_stats()
        detail["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "gpu": torch.cuda.get_device_name()}
    engines = build_engines(tiny)
    detail["config"] = {k: str(v) for k, v in vars(engines["clef"].config).items()}
    cases = case_set(engines["clef"])
    detail["case_set"] = {"cases": len(cases), "tokens": sum(len(engines["clef"].encode(c)) for c in cases)}
    memory_check(engines)
    alone(engines, cases)
    together(engines, cases)
    interactive(engines, cases)
    if DEVICE.type == "cuda":
        results["memory"]["peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
        results["memory"]["peak_reserved_gib"] = build.gib(torch.cuda.max_memory_reserved())
    detail["scheduler"] = {name: vars(e.scheduler.stats).copy() for name, e in engines.items()}
    for engine in engines.values():
        engine.close()
    engines.clear()
    gc.collect()
    save()
    build.print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
