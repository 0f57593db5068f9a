"""A new schema on a cached 16k-token state, Clef-27B architecture: the continuation eager vs replayed from a CUDA
graph, same run, same requests (answers compared, `decide` wall time).

    python bench/cached_graph_check.py OUT_DIR     (CUDA, flash-linear-attention installed)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build, h200  # noqa: E402


def main() -> None:
    from clef_engine.tiny import build_tiny_release

    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join(sys.argv)}

    def save() -> None:
        (out_dir / "cached_graph_check.json").write_text(json.dumps(report, indent=1, default=str))

    tiny = build_tiny_release(Path("/tmp/clef-bench-tiny"))
    engine = build.random_engine(build.clef_config("clef", tiny), tiny)
    state = h200.sized_request(engine, 16_384 - 400, seed=77)["state"]
    variants = [{"model": "clef", "state": state, "questions": h200.schema(4, 3, seed=900 + v)} for v in range(6)]

    def decide_ms(request) -> tuple[float, dict]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        answer = engine.decide(request)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1000, answer

    report["first_decide_ms_miss_store_and_compile"] = round(decide_ms(variants[0])[0], 1)
    save()
    graphs = engine.graphs
    graphs.continuation_disabled = "off for the eager half of this check"
    decide_ms(variants[1])  # compiles the eager continuation's kernels
    eager = {v: decide_ms(variants[v]) for v in (2, 3, 4, 5)}
    report["eager_decide_ms"] = [round(eager[v][0], 1) for v in eager]
    save()
    graphs.continuation_disabled = None
    for v in (2, 3, 4, 5):
        decide_ms(variants[v])  # captures each length bucket once
    graphed = {v: decide_ms(variants[v]) for v in (2, 3, 4, 5)}
    report["graph_decide_ms"] = [round(graphed[v][0], 1) for v in graphed]
    worst = 0.0
    for v in graphed:
        for question, answer in graphed[v][1]["answers"].items():
            for key, value in answer.items():
                if isinstance(value, float):
                    worst = max(worst, abs(value - eager[v][1]["answers"][question][key]))
    report["max_abs_difference_graph_vs_eager_answers"] = worst
    report["eager_p50_ms"] = round(statistics.median(report["eager_decide_ms"]), 1)
    report["graph_p50_ms"] = round(statistics.median(report["graph_decide_ms"]), 1)
    report["graphs"] = graphs.describe()
    report["cache"] = engine.state_cache.stats()
    report["memory_peak_allocated_gib"] = build.gib(torch.cuda.max_memory_allocated())
    save()
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
