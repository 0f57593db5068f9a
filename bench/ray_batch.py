"""A case-set run on Ray against the same run in process: wall time, records/s, tokens/s and CPU time of each, and
the answers compared.

    python bench/ray_batch.py OUT.json [--model SOURCE] [--cases N] [--replicas 1,2] [--repeats R] [--threads T]

Without --model the tiny release is built in a temporary folder. In process: clef_engine.load + JobRunner (chunks of
--chunk-size records as the Runs page sets them, or with 0 JobRunner's token-sized chunks). On Ray: a local cluster
started here (every CPU and GPU of the machine) and RayJobRunner over a ReplicaPool of each size in --replicas (one
GPU each when there are GPUs, else one CPU each), started before the clock starts: a run's time is from start to the
last result recorded, for both.

On the CPU, rounds alternate in process and Ray so that a machine shared with other work slows both alike, and each
run reports its CPU time (this process, plus the replicas' on Ray; not Ray's own daemons): wall time measures the
share of the machine a run got, CPU time what it cost. --threads sets torch's threads in process; a CPU replica has
one (Ray sets OMP_NUM_THREADS to its one CPU), so in process at 1 thread against one replica is Ray's overhead alone.
On a GPU, every in-process run comes first and the engine is closed before the replicas load (one GPU holds one
copy of Clef).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clef_workbench.jobs import JobRunner  # noqa: E402
from clef_workbench.store import RunSettings, Store  # noqa: E402

SCHEMA = json.loads((ROOT / "schemas" / "support-ticket-routing.json").read_text())
TICKETS = [example["state"] for example in SCHEMA.pop("examples")]


def case_set(store: Store, count: int) -> int:
    set_id = store.create_case_set(f"bench-{count}")
    store.add_cases(set_id, [{"state": f"{TICKETS[i % len(TICKETS)]} (#{i})"} for i in range(count)])
    return set_id


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (all their threads) from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def timed_run(store: Store, set_id: int, runner: JobRunner, engine, settings: RunSettings, pids: list[int]) -> dict:
    """One run; its wall time, and the CPU time of `pids` (this process, plus the replicas on Ray) over it: on a
    machine shared with other work, wall time measures the share the run got, CPU time what it cost."""
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="bench", settings=settings)
    cpu = cpu_seconds(pids)
    started = time.perf_counter()
    runner.start(run_id, engine)
    runner.wait(run_id)
    wall = time.perf_counter() - started
    cpu = cpu_seconds(pids) - cpu
    run = store.get_run(run_id)
    assert run["status"] == "finished" and run["errors"] == 0, run
    results = store.list_results(run_id)
    tokens = sum(r["input_tokens"] for r in results)
    return {"run_id": run_id, "wall_s": round(wall, 3), "records_per_s": round(len(results) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "tokens": tokens, "cpu_s": round(cpu, 2),
            "cpu_ms_per_1k_tokens": round(cpu / tokens * 1e6, 1)}


def max_abs_diff(store: Store, run_a: int, run_b: int) -> float:
    worst = 0.0
    for a, b in zip(store.list_results(run_a), store.list_results(run_b), strict=True):
        for qid, answer in a["response"]["answers"].items():
            other = b["response"]["answers"][qid]
            for key, value in (answer.get("probabilities") or {"noul": answer.get("noul")}).items():
                theirs = (other.get("probabilities") or {"noul": other.get("noul")})[key]
                worst = max(worst, abs(value - theirs))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model")
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--device")
    args = parser.parse_args()

    import ray
    import torch

    import clef_engine
    from clef_engine.tiny import build_tiny_release
    from clef_workbench.distributed import RayJobRunner, ReplicaPool

    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    source = args.model or str(build_tiny_release(work / "tiny", seed=0))
    store = Store(work / "bench.db")
    set_id = case_set(store, args.cases)
    settings = RunSettings(max_length=8_192, chunk_size=args.chunk_size or None)  # 0: chunks sized by tokens
    torch.set_num_threads(args.threads)
    report: dict = {"model": args.model or "tiny release (python -m clef_engine tiny)", "cases": args.cases,
                    "schema": SCHEMA["name"], "threads_in_process": args.threads, "cpu_count": os.cpu_count(),
                    "load_average_before": os.getloadavg(), "in_process": [], "ray": {}}

    ray.init(include_dashboard=False, log_to_driver=False)
    report["cluster"] = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    engine = clef_engine.load(source, device=args.device)
    on_gpu = engine.device.type == "cuda"
    if on_gpu:  # one GPU holds one copy of the model: every in-process run first, then the replicas
        report["in_process"] = [timed_run(store, set_id, JobRunner(store), engine, settings, [os.getpid()])
                                for _ in range(args.repeats)]
        engine.close()
        del engine
        torch.cuda.empty_cache()
    last = {}
    for count in [int(n) for n in args.replicas.split(",")]:
        started = time.perf_counter()
        pool = ReplicaPool.start(source, replicas=count)
        pids = [os.getpid(), *ray.get([slot.actor.pid.remote() for slot in pool.slots])]
        entry = report["ray"][str(count)] = {"pool_start_s": round(time.perf_counter() - started, 2),
                                             "device": pool.info["device"], "runs": []}
        for _ in range(args.repeats):
            if not on_gpu:  # alternate with the in-process run: a machine shared with other work slows both alike
                report["in_process"].append(timed_run(store, set_id, JobRunner(store), engine, settings,
                                                      [os.getpid()]))
                last["in_process"] = report["in_process"][-1]["run_id"]
            entry["runs"].append(timed_run(store, set_id, RayJobRunner(store, pool=pool), None, settings, pids))
            last[count] = entry["runs"][-1]["run_id"]
            print(json.dumps({"replicas": count, "ray": entry["runs"][-1],
                              "in_process": report["in_process"][-1]}), flush=True)
        pool.close()
    last.setdefault("in_process", report["in_process"][-1]["run_id"])

    local_tps = statistics.median(r["tokens_per_s"] for r in report["in_process"])
    local_cpu = statistics.median(r["cpu_ms_per_1k_tokens"] for r in report["in_process"])
    report["summary"] = {"in_process_tokens_per_s": local_tps, "in_process_cpu_ms_per_1k_tokens": local_cpu,
                         "in_process_runs": len(report["in_process"])}
    for count, entry in report["ray"].items():
        tps = statistics.median(r["tokens_per_s"] for r in entry["runs"])
        cpu = statistics.median(r["cpu_ms_per_1k_tokens"] for r in entry["runs"])
        report["summary"][f"ray_{count}_tokens_per_s"] = tps
        report["summary"][f"ray_{count}_vs_in_process"] = round(tps / local_tps, 3)
        report["summary"][f"ray_{count}_cpu_ms_per_1k_tokens"] = cpu
        report["summary"][f"ray_{count}_cpu_vs_in_process"] = round(cpu / local_cpu, 3)
    report["max_abs_diff_probability"] = {str(count): max_abs_diff(store, last["in_process"], run_id)
                                          for count, run_id in last.items() if count != "in_process"}
    report["load_average_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
