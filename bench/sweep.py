"""A schema sweep on the Clef-27B shape on one H200, next to one plain run and the naive way (issue 39).

    python bench/sweep.py OUT.json                    (CUDA; flash-linear-attention installed)
    BENCH_CPU_SMOKE=1 python bench/sweep.py OUT.json  (a scaled-down release on the CPU: checks the script only)

A release of the Clef-27B shape with random bf16 weights (never zeros, `build.write_release`) is written to
BENCH_RELEASE_DIR (default /tmp/clef-27b-random; ~54 GB, minutes) unless that folder already holds one (its
`.complete` marker): on a machine that stays warm, a first device call may write it (BENCH_WRITE_ONLY=1 stops there)
and a second measure. It is loaded through `clef_engine.load` (warm-up included) with the state cache's device tier
at BENCH_STATE_CACHE_GIB (64) so that every case's state stays cached for the re-run.

A case set of BENCH_CASES (200) cases, each state ~BENCH_STATE_TOKENS (2,100: past the cache's 2,048-token
`min_prefix_tokens`, so that a plain run finds the states) tokens, with random gold labels, in a workbench SQLite
store; a base schema of BENCH_QUESTIONS (3) questions, a noul and choices of 3 options (~340 tokens after the state,
the issue's workload; 4 questions: ~440), its automatic variants (13 for 3 questions) and alternatives written as an
analyst writes them (one question's instructions reworded each) up to 19 variants besides the base:

- plain_run_s: one run of the base schema through the workbench's JobRunner (what the Runs page does);
- sweep_s: the sweep of the 20 variants (`sweeps.run_sweep`: one state per case, every variant continued from it),
  state cache emptied first; state_prefills says how many states the engine computed;
- rerun_s: a plain run of the base with one question's instructions edited, right after the sweep (its states are
  cached: each record continues from its state);
- naive_s: the 20 variants as 20 plain runs, cache emptied before each; when BENCH_DEADLINE_S (560) would pass, the
  runs measured are scaled to 20 (`naive_runs_measured` says how many were);
- detail.profile (a diagnostic, after the re-run): one case's 20 variants (`Engine.decide_variants`, state cache
  emptied) under torch.profiler (GPU busy time against wall time, kernels by category), and again with a device
  sync around each phase (the state's prefill, the backbone over the variants, each variant's head, encoding);
  then a sweep of the first 12 cases under the profiler (`sweep_of_12_cases`: GPU busy time against wall time in
  the sweep's own loop, its held-out check included).

Writes OUT.json after every step: the issue's keys at the top level, the rest under "detail".
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build  # noqa: E402

SMOKE = os.environ.get("BENCH_CPU_SMOKE") == "1"
DEADLINE = time.perf_counter() + float(os.environ.get("BENCH_DEADLINE_S", "560"))
CASES = int(os.environ.get("BENCH_CASES", "6" if SMOKE else "200"))
STATE_TOKENS = int(os.environ.get("BENCH_STATE_TOKENS", "140" if SMOKE else "2100"))
CACHE_GIB = float(os.environ.get("BENCH_STATE_CACHE_GIB", "1" if SMOKE else "64"))
RELEASE = Path(os.environ.get("BENCH_RELEASE_DIR") or (tempfile.mkdtemp(prefix="clef-sweep-release-") if SMOKE
                                                       else "/tmp/clef-27b-random"))
VARIANTS = 20
QUESTIONS = int(os.environ.get("BENCH_QUESTIONS", "3"))  # 3: ~340 tokens after the state, the schema

results: dict = {"sweep_s": None, "plain_run_s": None, "naive_s": None, "rerun_s": None, "variants": None,
                 "cases": CASES, "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
                 "detail": {"errors": {}}}
OUT: Path


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def left() -> float:
    return DEADLINE - time.perf_counter()


section = build.sections(left, save, results["detail"]["errors"])


def release(tiny: Path) -> None:
    if (RELEASE / ".complete").exists():
        results["detail"]["release"] = {"reused": str(RELEASE)}
        return
    written = build.write_release(RELEASE, tiny, "clef", smoke=SMOKE)
    (RELEASE / ".complete").write_text("written by bench/sweep.py\n")
    results["detail"]["release"] = {"written": str(RELEASE), **written}
    save()


def written_variants(schema: dict, count: int) -> list:
    """`count` alternatives an analyst writes (`sweeps.variants_from_json`): one question's instructions reworded
    each, the questions in turn."""
    from clef_workbench import sweeps

    ids = list(schema["questions"])
    entries = [{"name": f"{ids[n % len(ids)]} reworded {n // len(ids) + 1}",
                "questions": {ids[n % len(ids)]: {**schema["questions"][ids[n % len(ids)]],
                                                  "instructions": f"Rewording {n + 1}: "
                                                  + schema["questions"][ids[n % len(ids)]]["instructions"]}}}
               for n in range(count)]
    return sweeps.variants_from_json(json.dumps(entries), schema) if entries else []


def case_set(engine, store, questions: dict) -> int:
    """CASES cases with states of ~STATE_TOKENS tokens and random gold answers to every question."""
    from clef_workbench.casesets import option_ids

    rng = random.Random(7)
    empty = engine.count_tokens({"state": "", "questions": questions})["total"]
    cases = [{"state": build.sized_state(engine, STATE_TOKENS + empty, questions, seed),
              "expected": {q: rng.choice(option_ids(question)) for q, question in questions.items()}}
             for seed in range(CASES)]
    for case in cases:
        case["expected"] = {q: v == "true" if questions[q]["type"] == "noul" else v
                            for q, v in case["expected"].items()}
    case_set_id = store.create_case_set("bench sweep")
    store.add_cases(case_set_id, cases)
    return case_set_id


def plain_run(engine, store, case_set_id: int, schema: dict) -> float:
    from clef_workbench.jobs import JobRunner

    run_id = store.create_run(case_set_id, schema=schema, model_id="clef")
    runner = JobRunner(store)
    started = time.perf_counter()
    runner.start(run_id, engine)
    runner.wait(run_id)
    seconds = time.perf_counter() - started
    progress = runner.progress(run_id)
    if progress["status"] != "finished" or progress["errors"]:
        raise RuntimeError(f"run {run_id}: {progress}")
    return seconds


def phases(engine, fn, iterations: int = 2) -> dict:
    """Per call of `fn`: milliseconds in each of the runner's phases, each timed with a device sync around it (the
    syncs add idle time; the prefill's backbone forward and head count in theirs too), and the call in all."""
    runner = engine.runner
    spent: dict[str, float] = {}

    def sync() -> None:
        if engine.config.cuda:
            torch.cuda.synchronize()

    def timed(owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def wrapper(*args, **kwargs):
            sync()
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
        setattr(owner, attribute, wrapper)

    timed(runner, "prefill_and_keep", "state_prefill_whole_record")
    timed(runner, "head_one", "heads")
    timed(runner.backbone, "forward", "backbone_forwards")
    timed(engine.encoder, "encode", "encode")
    started = time.perf_counter()
    try:
        for _ in range(iterations):
            fn()
    finally:
        for owner, attribute in ((runner, "prefill_and_keep"), (runner, "head_one"), (runner.backbone, "forward"),
                                 (engine.encoder, "encode")):
            delattr(owner, attribute)
    spent["call"] = time.perf_counter() - started
    return {name: round(seconds * 1000 / iterations, 1) for name, seconds in spent.items()}


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    import clef_engine
    from clef_engine.tiny import build_tiny_release
    from clef_workbench import sweeps
    from clef_workbench.store import Store

    detail = results["detail"]
    tiny = build_tiny_release(Path(tempfile.mkdtemp(prefix="clef-bench-tiny-")))
    section("write_release")(release)(tiny)
    if os.environ.get("BENCH_WRITE_ONLY") == "1" or not (RELEASE / ".complete").exists():
        save()
        return 0
    started = time.perf_counter()
    engine = clef_engine.load(RELEASE, device="cpu" if SMOKE else None, dtype="float32" if SMOKE else None,
                              state_cache_bytes=int(CACHE_GIB * 2**30))
    detail["load_s"] = round(time.perf_counter() - started, 1)
    engine.decide({"state": "a first answer", "questions": build.schema(1, 2, seed=1)})
    detail["first_answer_s"] = round(time.perf_counter() - started, 1)  # a fresh process's start (issue 38)
    while engine.state == "warming":  # the background warm-up's captures would share the GPU with the timed runs
        time.sleep(0.5)
    detail["ready_s"] = round(time.perf_counter() - started, 1)
    detail["warm_up_s"] = round(engine.warm_up_seconds, 1)
    detail["config"] = {k: str(v) for k, v in vars(engine.config).items()}
    if engine.config.cuda:
        detail["gpu"] = torch.cuda.get_device_name()
        detail["memory_loaded_gib"] = build.gib(engine.loaded_bytes)
    schema = {"name": "bench", "version": 1, "description": "",
              "questions": build.schema(QUESTIONS, 3, seed=3, noul_every=4)}
    store = Store(Path(tempfile.mkdtemp(prefix="clef-sweep-db-")) / "bench.sqlite3")
    case_set_id = case_set(engine, store, schema["questions"])
    counts = engine.count_tokens({"state": store.list_cases(case_set_id)[0]["state"], "questions": schema["questions"]})
    detail["tokens"] = {"record": counts["total"], "state": counts["state"], "schema_and_rest": counts["total"]
                        - counts["state"]}
    variants = sweeps.auto_variants(schema)
    variants += written_variants(schema, VARIANTS - 1 - len(variants))
    results["variants"] = len(variants) + 1
    save()
    print(f"loaded in {detail['load_s']} s; {CASES} cases of {counts['total']} tokens; {len(variants) + 1} variants",
          flush=True)

    @section("plain_run")
    def measure_plain() -> None:
        engine.runner.state_cache.clear()
        results["plain_run_s"] = round(plain_run(engine, store, case_set_id, schema), 2)

    @section("sweep")
    def measure_sweep() -> None:
        engine.runner.state_cache.clear(reset_stats=True)
        sweep_id = sweeps.start_sweep(store, case_set_id, schema, variants, model_id="clef")
        before = engine.runner.state_prefills
        case_done: list[float] = []
        started = time.perf_counter()
        progress = sweeps.run_sweep(store, sweep_id, engine, progress=lambda p: case_done.append(time.perf_counter())
                                    if p.status == "running" else None)
        results["sweep_s"] = round(time.perf_counter() - started, 2)
        tenth = max(1, len(case_done) // 10)  # the first and the last tenth of the cases: does a case slow down
        detail["sweep_timeline"] = {"first_tenth_s_per_case": round((case_done[tenth - 1] - started) / tenth, 3),
                                    "last_tenth_s_per_case": round((case_done[-1] - case_done[-tenth - 1]) / tenth, 3)
                                    if len(case_done) > tenth else None,
                                    "heldout_s": round(time.perf_counter() - case_done[-1], 2)}
        cache = engine.runner.state_cache.stats()
        detail["sweep"] = {"status": progress.status, "state_prefills": engine.runner.state_prefills - before,
                           "answers": len(store.list_sweep_answers(sweep_id)), "state_cache": cache,
                           "bytes_per_state": cache["device_bytes"] // max(1, cache["entries"]),
                           "states_held_at_the_device_default_8_gib": (8 * 2**30) // max(
                               1, cache["device_bytes"] // max(1, cache["entries"]))}

    @section("rerun")
    def measure_rerun() -> None:
        edited = {**schema, "questions": dict(schema["questions"])}
        first = next(iter(edited["questions"]))
        edited["questions"][first] = {**edited["questions"][first], "instructions": "Edited: which one applies?"}
        hits = engine.runner.state_cache.stats()["hits"]
        results["rerun_s"] = round(plain_run(engine, store, case_set_id, edited), 2)
        detail["rerun_cache_hits"] = engine.runner.state_cache.stats()["hits"] - hits

    @section("naive", needs_s=50)
    def measure_naive() -> None:
        seconds = []
        for variant in [sweeps.base_variant(schema), *variants]:
            if seconds and left() < 1.5 * max(seconds):
                break
            engine.runner.state_cache.clear()
            seconds.append(plain_run(engine, store, case_set_id, variant.schema))
        results["naive_s"] = round(sum(seconds) * VARIANTS / len(seconds), 2)
        detail["naive_runs_measured"] = len(seconds)
        detail["naive_run_s"] = [round(s, 2) for s in seconds]

    @section("profile", needs_s=60)
    def profile_case() -> None:
        from clef_workbench.casesets import build_request

        case = store.get_case(store.list_cases(case_set_id)[0]["id"])
        requests = [build_request(case, v.schema, model="clef") for v in [sweeps.base_variant(schema), *variants]]

        def one_case() -> None:
            engine.runner.state_cache.clear()
            engine.decide_variants(requests)

        one_case()
        detail["profile"] = {"kernels": build.kernel_table(one_case, iterations=2) if engine.config.cuda else None,
                             "phases_ms": phases(engine, one_case)}
        few = store.create_case_set("bench sweep, the first 12 cases")
        store.add_cases(few, [{"state": c["state"], "expected": c["expected"]}
                              for c in store.list_cases(case_set_id)[:12]])

        def a_sweep() -> None:  # the same cases' states again: under the profiler in the sweep's loop, threads and all
            engine.runner.state_cache.clear()
            sweeps.run_sweep(store, sweeps.start_sweep(store, few, schema, variants, model_id="clef"), engine)

        detail["profile"]["sweep_of_12_cases"] = (build.kernel_table(a_sweep, iterations=1) if engine.config.cuda
                                                  else a_sweep())  # on the CPU: the script only

    measure_plain()
    measure_sweep()
    measure_rerun()
    if os.environ.get("BENCH_PROFILE", "1") == "1":  # 0: its minute goes to the naive runs instead
        profile_case()
    measure_naive()
    if results["plain_run_s"]:
        detail["ratios"] = {key: round(results[key] / results["plain_run_s"], 2)
                            for key in ("sweep_s", "rerun_s", "naive_s") if results[key] is not None}
    detail["state_prefills_total"] = engine.runner.state_prefills
    engine.close()
    save()
    build.print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
