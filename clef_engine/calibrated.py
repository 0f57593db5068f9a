"""How sure, over HTTP: `"x_calibration": "<name>"` on `POST /v1/systemone` adds `"x_calibrated"` answers.

A calibration is a map per question from the model's distribution to a calibrated one, fitted by the workbench on a
run's labelled cases (`clef_workbench.calibration`): Platt scaling of the log-odds for `noul`,
P'(true) = σ(a · logit P(true) + b); a temperature for `choice` and `score`, P'(k) ∝ P(k)^(1/T), which keeps the
ranking of the options. This module holds only the maps and their arithmetic (no fitting, no store, no torch), so
that the standalone server can apply calibrations exported to a file, and the workbench-served API the ones in its
store, through the same `CalibrationProvider`.

The file `clef-engine serve --calibrations FILE` reads is what `python -m clef_workbench calibrate --export FILE`
writes: `{"calibrations": {name: {"questions": {question_id: {"question_type", "method", "a", "b", "temperature"}},
"schema_name", "model_id", "run_id"}}}` (the last three say what it was fitted on; they are not needed to apply it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("platt", "temperature")
_EPS = 1e-12


@dataclass(frozen=True)
class QuestionMap:
    """One question's fitted map: `method` "platt" (`a`, `b`) for noul, "temperature" for choice and score."""

    question_type: str
    method: str
    a: float = 1.0
    b: float = 0.0
    temperature: float = 1.0

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> QuestionMap:
        if params.get("method") not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {params.get('method')!r}")
        return cls(question_type=str(params["question_type"]), method=params["method"],
                   a=float(params.get("a", 1.0)), b=float(params.get("b", 0.0)),
                   temperature=float(params.get("temperature", 1.0)))

    def apply(self, distribution: Mapping[str, float]) -> dict[str, float]:
        """The calibrated distribution (the same keys, summing to 1)."""
        if self.method == "platt":
            p_true = min(max(float(distribution["true"]), _EPS), 1 - _EPS)
            z = self.a * math.log(p_true / (1 - p_true)) + self.b
            calibrated = 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))
            return {"true": calibrated, "false": 1.0 - calibrated}
        logits = {k: math.log(min(max(float(p), _EPS), 1.0)) / self.temperature for k, p in distribution.items()}
        top = max(logits.values())
        weights = {k: math.exp(v - top) for k, v in logits.items()}
        total = sum(weights.values())
        return {k: w / total for k, w in weights.items()}


Calibration = dict[str, QuestionMap]  # question id → its map
CalibrationProvider = Callable[[], Mapping[str, Calibration]]  # name → calibration, read per request


def distribution_of(answer: Mapping[str, Any]) -> dict[str, float]:
    """Every option's probability in a System One answer (noul: "true" and "false")."""
    if answer["type"] == "noul":
        p_true = float(answer["noul"])
        return {"true": p_true, "false": 1.0 - p_true}
    return {str(k): float(v) for k, v in answer["probabilities"].items()}


def calibrated_answer(answer: Mapping[str, Any], distribution: Mapping[str, float]) -> dict:
    """A System One answer with `distribution` (calibrated) in place of the model's probabilities, its choice,
    confidence and score recomputed as the contract defines them (4 decimals)."""
    if answer["type"] == "noul":
        return {"type": "noul", "noul": round(distribution["true"], 4)}
    probabilities = {option: round(distribution[option], 4) for option in answer["probabilities"]}
    if answer["type"] == "choice":
        best = max(probabilities, key=lambda option: distribution[option])
        return {"type": "choice", "choice": best, "confidence": probabilities[best], "probabilities": probabilities}
    return {**answer, "score": round(sum(int(level) * p for level, p in distribution.items()), 4),
            "confidence": round(max(distribution.values()), 4), "probabilities": probabilities}


def calibrate_answers(calibration: Calibration, answers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """The answers a calibration has a map for (of the same question type), calibrated; the others left out: a
    client reads those raw."""
    out = {}
    for question_id, answer in answers.items():
        question = calibration.get(question_id)
        if question is not None and answer.get("type") == question.question_type:
            out[question_id] = calibrated_answer(answer, question.apply(distribution_of(answer)))
    return out


def calibrations_from_export(document: Mapping[str, Any]) -> dict[str, Calibration]:
    """The calibrations of an exported document (see the module's docstring), by name."""
    return {name: {question_id: QuestionMap.from_dict(params)
                   for question_id, params in entry["questions"].items()}
            for name, entry in document["calibrations"].items()}


def load_calibrations(path: str | Path) -> dict[str, Calibration]:
    """The calibrations in an exported file. Raises ValueError saying what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        return calibrations_from_export(document)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: not a calibrations file written by `python -m clef_workbench calibrate "
                         f"--export` ({type(exc).__name__}: {exc})") from None
