"""How sure, over HTTP: `"x_calibration": "<name>"` on `POST /v1/systemone` adds `"x_calibrated"` answers.

A calibration maps, per question, the model's distribution to a calibrated one, as the workbench fitted it
(`clef_workbench.calibration`): Platt scaling for `noul`, P'(true) = σ(a · logit P(true) + b); a temperature for
`choice` and `score`, P'(k) ∝ P(k)^(1/T), which keeps the options' ranking. Only the maps and their arithmetic are
here (no fitting, store or torch), so the standalone server applies the ones exported to a file (`clef-engine serve
--calibrations FILE`, from `calibrate --export`: `{"calibrations": {name: {"questions": {question_id:
{"question_type", "method", "a", "b", "temperature"}}, ...}}}`) and the workbench's API the ones in its store. A map
is checked when it is read, so that applying it can never fail.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .protocol import Question, format_answer

METHOD_OF_TYPE = {"noul": "platt", "choice": "temperature", "score": "temperature"}
# Wider than the fitter's bounds (clef_workbench.calibration: |a|, |b| ≤ 50, T from 1/20 to 20); past them a map only
# turns every answer one-hot or uniform, and a temperature near 0 makes P^(1/T) overflow.
PARAMETER_RANGES = {"a": (-100.0, 100.0), "b": (-100.0, 100.0), "temperature": (0.01, 100.0)}
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
    def from_dict(cls, params: Any) -> QuestionMap:
        """The map `params` describe; ValueError saying what is wrong with them."""
        if not isinstance(params, Mapping):
            raise ValueError(f"a question's map must be an object, not {type(params).__name__}")
        question_type, method = params.get("question_type"), params.get("method")
        if question_type not in METHOD_OF_TYPE:
            raise ValueError(f"question_type must be one of {', '.join(METHOD_OF_TYPE)}; got {question_type!r}")
        if method != METHOD_OF_TYPE[question_type]:
            raise ValueError(f"a {question_type} question is calibrated by method {METHOD_OF_TYPE[question_type]!r}; "
                             f"got {method!r}")
        numbers = {name: _parameter(name, params.get(name, getattr(cls, name))) for name in PARAMETER_RANGES}
        return cls(question_type=question_type, method=method, **numbers)

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


def _parameter(name: str, value: Any) -> float:
    low, high = PARAMETER_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:  # NaN fails too
        raise ValueError(f"{name} must be a number from {low:g} to {high:g}; got {value!r}")
    return float(value)


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
    confidence and score recomputed as the contract defines them (ties: the first option in the answer's order)."""
    options = tuple(distribution) if answer["type"] == "noul" else tuple(answer["probabilities"])
    legend = tuple(answer.get("legend", {}).get(option) for option in options)
    formatted = format_answer(Question("", answer["type"], None, options, legend, options),
                              [distribution[option] for option in options])
    if "legend" not in answer:  # kept as the answer had it
        formatted.pop("legend", None)
    return formatted


def calibrate_answers(calibration: Calibration, answers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """The answers a calibration has a map for (of the same question type), calibrated; the others left out: a
    client reads those raw."""
    out = {}
    for question_id, answer in answers.items():
        question = calibration.get(question_id)
        if question is not None and answer.get("type") == question.question_type:
            out[question_id] = calibrated_answer(answer, question.apply(distribution_of(answer)))
    return out


def calibrations_from_export(document: Any) -> dict[str, Calibration]:
    """The calibrations of an exported document (see the module's docstring), by name. ValueError saying what is
    wrong, and where, with a document that is not one."""
    calibrations = document.get("calibrations") if isinstance(document, Mapping) else None
    if not isinstance(calibrations, Mapping):
        raise ValueError('not a calibrations file written by `python -m clef_workbench calibrate --export`: it needs '
                         'a top-level object {"calibrations": {name: {"questions": {...}}}}')
    out: dict[str, Calibration] = {}
    for name, entry in calibrations.items():
        questions = entry.get("questions") if isinstance(entry, Mapping) else None
        if not isinstance(questions, Mapping):
            raise ValueError(f"calibration {name!r}: it needs \"questions\", an object of question id → map")
        out[name] = {}
        for question_id, params in questions.items():
            try:
                out[name][question_id] = QuestionMap.from_dict(params)
            except ValueError as exc:
                raise ValueError(f"calibration {name!r}, question {question_id!r}: {exc}") from None
    return out


def load_calibrations(path: str | Path) -> dict[str, Calibration]:
    """The calibrations in an exported file. Raises ValueError saying what is wrong with it, and where."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        return calibrations_from_export(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a calibrations file") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
