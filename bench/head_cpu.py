"""Host cost of the batched joint head on the CPU (demo release): `layout` time and the aten ops of one forward.

    python bench/head_cpu.py [CHECKOUT]

CHECKOUT (default: this one) is the root of the checkout whose `clef_engine` is measured: point it at an export
of an older commit to compare before / after. Cases: the H200 head profile's record (64 questions x 10 options,
~16k tokens) and a small request (1k tokens, 4 questions x 3 options). Op counts are a stand-in for GPU kernel
launches: `top_level` counts the aten calls the head makes itself, `non_view` leaves out views and reshapes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import clef_engine  # noqa: E402
from bench import h200  # noqa: E402
from clef_engine.model.head import layout  # noqa: E402

VIEWS = {"view", "slice", "transpose", "unsqueeze", "select", "as_strided", "t", "expand", "chunk", "split",
         "detach", "alias", "resolve_conj", "resolve_neg", "narrow", "squeeze", "permute", "empty", "_unsafe_view"}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 3)


def aten_ops(fn) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    events = [e for e in profile.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"all": len(events), "top_level": len(top),
            "non_view": sum(e.name.removeprefix("aten::") not in VIEWS for e in top)}


def measure(engine, record) -> dict:
    hidden = torch.randn(len(record), engine.head.config.hidden_size, dtype=engine.dtype)
    batch = layout([record], [0], [len(record)])
    with torch.inference_mode():
        full = lambda: engine.head_probabilities(hidden, [record], [0], [len(record)])  # noqa: E731
        return {
            "tokens": len(record),
            "layout_ms": median_ms(lambda: layout([record], [0], [len(record)]), 50),
            "head_probabilities_ms": median_ms(full, 20),
            "forward_ops": aten_ops(lambda: engine.head(hidden, engine.output_embeddings, batch)),
            "head_probabilities_ops": aten_ops(full),
        }


def main() -> None:
    torch.set_num_threads(1)  # steadier on a small shared CPU; the counts do not depend on it
    engine = clef_engine.load(clef_engine.demo_release(), device="cpu")
    big = h200.sized_request(engine, 0, 64, 10, seed=64)
    big["state"] = " ".join(h200.WORDS * 8)  # as bench/profile_h200.py's head_64x10
    cases = {"64x10": engine.encode(big, max_length=2**31 - 1),
             "4x3": engine.encode(h200.sized_request(engine, 1000, 4, 3, seed=1), max_length=2**31 - 1)}
    out = {"clef_engine": clef_engine.__file__}
    for name, record in cases.items():
        out[name] = measure(engine, record)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
