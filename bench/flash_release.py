"""Write a Clef-Flash-shaped release (spec §1 sizes, random bf16 weights) to disk, load it through
`clef_engine.load`, decide one request, and report load time and memory.

    python bench/flash_release.py OUT_DIR RESULT_JSON [--keep]

The release has every file of a real one (`bench/build.py: write_release`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.build import gib, write_release  # noqa: E402


def request() -> dict:
    return {"model": "clef-flash", "state": {"ticket": "customer reports a refund not received for order 1234",
                                             "amount": 125.5, "vendor": "acme"},
            "questions": {"refund_due": {"type": "noul", "instructions": "Is a refund due?"},
                          "priority": {"type": "choice", "instructions": "Priority of the ticket",
                                       "criteria": {"high": "urgent", "medium": None, "low": "can wait"}},
                          "severity": {"type": "score", "instructions": "How severe",
                                       "criteria": ["none", "minor", "major", "critical"]}}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    import clef_engine
    from clef_engine.tiny import build_tiny_release

    tiny = build_tiny_release(args.directory.parent / "tiny-for-flash")
    args.directory.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["write"] = write_release(args.directory, tiny, "clef-flash")
    print("written", result["write"], flush=True)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    engine = clef_engine.load(args.directory)
    result["load_s"] = round(time.perf_counter() - started, 1)
    info = engine.info()
    answer = engine.decide(request())
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.decide(request())
        times.append((time.perf_counter() - t0) * 1000)
    memory = engine.memory()
    result.update(
        engine_load_seconds=info["load_seconds"], kernels=info["kernels"],
        backbone_parameters=info["backbone_parameters"],
        head_parameters=info["head_parameters"],
        memory_gib={"loaded": gib(memory["loaded"]), "peak_allocated": gib(memory["peak_allocated"]),
                    "peak_reserved": gib(memory["peak_reserved"])},
        answer=answer, decide_ms_after_warmup=sorted(times)[len(times) // 2],
        input_tokens=answer["usage"]["input_tokens"],
    )
    args.result.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "answer"}, indent=1, default=str))
    engine.close()
    if not args.keep:
        shutil.rmtree(args.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
