"""What FP8 costs in answers, as measured and as people read it: the newest bench/lengths_and_precision.py result
(bench/results/*-lengths-and-precision.json) against issue 25's gate, and one line saying it. Kept apart from the
FP8 kernels (fast/fp8.py) and free of torch, so the engine's info, the server's model listing and the workbench's
sidebar read it without loading a kernel module."""

from __future__ import annotations

import json
from pathlib import Path

# The gate issue 25 sets for FP8 against the float32 truth: max |Δp| and the truth's top-two gap of any flipped answer
GATE_MAX_DP = 0.05
GATE_FLIP_MARGIN = 0.05
RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
RESULTS_GLOB = "*-lengths-and-precision.json"


def measured_fidelity(results_dir: Path = RESULTS_DIR) -> dict | str:
    """FP8's measured distance from the float32 answer, from the newest bench/results/*-lengths-and-precision.json
    (bench/lengths_and_precision.py), with whether it meets issue 25's gate; "not measured" if no such file has it."""
    for path in sorted(results_dir.glob(RESULTS_GLOB), reverse=True):
        try:
            fp8 = json.loads(path.read_text()).get("fp8") or {}
        except (OSError, ValueError):
            continue
        if fp8.get("max_dp") is None:
            continue
        margin = fp8.get("max_flip_margin")
        return {"max_dp": fp8["max_dp"], "flips": fp8.get("flips"), "max_flip_margin": margin,
                "questions": fp8.get("questions"), "shape": fp8.get("fidelity_shape"),
                "gate_met": fp8["max_dp"] <= GATE_MAX_DP and (margin or 0.0) <= GATE_FLIP_MARGIN,
                "source": f"bench/results/{path.name}"}
    return "not measured"


def describe_fidelity(fidelity: dict | str) -> str:
    """One line for people: 'max |Δp| 0.031 from float32, 4 of 240 answers flipped (gate met; ...)'."""
    if not isinstance(fidelity, dict):
        return "distance from float32 not measured"
    gate = "gate met" if fidelity.get("gate_met") else "gate missed"
    flips = fidelity.get("flips")
    questions = fidelity.get("questions")
    flipped = f", {flips} of {questions} answers flipped" if flips is not None and questions else ""
    return f"max |Δp| {fidelity['max_dp']:.3f} from float32{flipped} ({gate}; {fidelity.get('source')})"
