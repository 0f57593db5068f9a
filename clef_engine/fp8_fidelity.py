"""What FP8 costs in answers, as measured and as people read it: the newest bench/lengths_and_precision.py result
(bench/results/*-lengths-and-precision.json, or issue 38's *-start-and-shapes.json that carries its `fp8` keys)
against issue 25's gate, and one line saying it. Kept apart from the FP8 kernels (fast/fp8.py) and free of torch, so
the engine's info, the server's model listing and the workbench's sidebar read it without loading a kernel module."""

from __future__ import annotations

import json
from pathlib import Path

# The gate issue 25 sets for FP8 against the float32 truth: max |Δp| and the truth's top-two gap of any flipped answer
GATE_MAX_DP = 0.05
GATE_FLIP_MARGIN = 0.05
# What fast/fp8.py runs, as the benchmark records it in `fp8.scheme`: a result of another scheme (the row-wise one
# before issue 38 wrote none) still counts, as the newest measurement there is, and says which scheme it measured
SCHEME = "block: e4m3 128x128 weight blocks, 1x128 activation groups; o_proj, out_proj, down_proj in bf16"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
RESULTS_GLOBS = ("*-lengths-and-precision.json", "*-start-and-shapes.json")


def measured_fidelity(results_dir: Path = RESULTS_DIR) -> dict | str:
    """FP8's measured distance from the float32 answer, from the newest results file of RESULTS_GLOBS (by its
    date-first name) that has one, with whether it meets issue 25's gate; "not measured" if none has it."""
    paths = {path for pattern in RESULTS_GLOBS for path in results_dir.glob(pattern)}
    for path in sorted(paths, key=lambda path: path.name, reverse=True):
        try:
            fp8 = json.loads(path.read_text()).get("fp8") or {}
        except (OSError, ValueError):
            continue
        if fp8.get("max_dp") is None:
            continue
        margin = fp8.get("max_flip_margin")
        return {"max_dp": fp8["max_dp"], "flips": fp8.get("flips"), "max_flip_margin": margin,
                "questions": fp8.get("questions"), "shape": fp8.get("fidelity_shape"),
                "scheme": fp8.get("scheme", "row-wise scales, every projection FP8"),
                "gate_met": fp8["max_dp"] <= GATE_MAX_DP and (margin or 0.0) <= GATE_FLIP_MARGIN,
                "source": f"bench/results/{path.name}"}
    return "not measured"


def describe_fidelity(fidelity: dict | str) -> str:
    """One line for people: 'max |Δp| 0.031 from float32, 4 of 240 answers flipped (gate met; ...)'; a missed gate
    says by how much."""
    if not isinstance(fidelity, dict):
        return "distance from float32 not measured"
    if fidelity.get("gate_met"):
        gate = "gate met"
    else:
        over = [f"max |Δp| {fidelity['max_dp']:.3f} > {GATE_MAX_DP}" if fidelity["max_dp"] > GATE_MAX_DP else "",
                f"a flip at a margin of {fidelity['max_flip_margin']:.3f} > {GATE_FLIP_MARGIN}"
                if (fidelity.get("max_flip_margin") or 0.0) > GATE_FLIP_MARGIN else ""]
        gate = f"gate missed: {' and '.join(part for part in over if part)}"
    flips = fidelity.get("flips")
    questions = fidelity.get("questions")
    flipped = f", {flips} of {questions} answers flipped" if flips is not None and questions else ""
    return f"max |Δp| {fidelity['max_dp']:.3f} from float32{flipped} ({gate}; {fidelity.get('source')})"
