"""System One wire format (spec §5): validate a request, turn per-option probabilities into a response.

Validation collects every problem in the request (not just the first), each with its location, so a client or the
workbench can show the message next to the field it concerns.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import Problem, RequestError

MAX_QUESTIONS = 64
MIN_CHOICE_OPTIONS, MAX_CHOICE_OPTIONS = 2, 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10
MAX_IMAGES = 4
MAX_VIDEOS = 4
MAX_OPTION_ID_CHARS = 100
QUESTION_ID = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
QUESTION_TYPES = ("noul", "choice", "score")

NOUL_DEFAULT_DESCRIPTIONS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}


@dataclass(frozen=True)
class Question:
    """One validated question, its options in the order the model reads them."""

    id: str
    type: str  # noul | choice | score
    instructions: Any  # str or any JSON value; rendered like the state
    option_ids: tuple[str, ...]  # model order: noul true,false; choice sorted by id; score "0".."n-1"
    option_descriptions: tuple[Any, ...]  # same order; None means "no description"
    caller_option_ids: tuple[str, ...]  # the order the caller wrote them (choice); used for the response


def _is_text(value: str) -> bool:
    """Valid JSON can carry unpaired surrogates ("\\ud800") that no tokenizer or UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_json_value(value: Any) -> bool:
    if isinstance(value, str):
        return _is_text(value)
    if value is None or isinstance(value, (bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_text(k) and _is_json_value(v) for k, v in value.items())
    return False


def parse_questions(request: Any) -> list[Question]:
    """Validate the request's questions and return them in schema order. Raises RequestError listing every problem."""
    problems: list[Problem] = []
    if not isinstance(request, dict):
        raise RequestError([Problem((), "the request must be a JSON object", "type_error.dict")])
    if "state" not in request:
        problems.append(Problem(("state",), "field required", "value_error.missing"))
    elif not _is_json_value(request["state"]):
        problems.append(Problem(("state",), "state must be a JSON value (no NaN, infinity or unpaired surrogates)",
                                "type_error.json"))

    questions = request.get("questions")
    parsed: list[Question] = []
    if questions is None:
        problems.append(Problem(("questions",), "field required", "value_error.missing"))
    elif not isinstance(questions, dict):
        problems.append(Problem(("questions",), "questions must be an object mapping id → question", "type_error.dict"))
    elif not 1 <= len(questions) <= MAX_QUESTIONS:
        problems.append(
            Problem(("questions",), f"between 1 and {MAX_QUESTIONS} questions allowed, got {len(questions)}",
                    "value_error.length")
        )
    else:
        for question_id, question in questions.items():
            parsed_question = _parse_question(question_id, question, problems)
            if parsed_question is not None:
                parsed.append(parsed_question)

    for media_key, limit in (("images", MAX_IMAGES), ("videos", MAX_VIDEOS)):
        media = request.get(media_key)
        if media is None:
            continue
        if not isinstance(media, list):
            problems.append(Problem((media_key,), f"{media_key} must be a list", "type_error.list"))
        elif len(media) > limit:
            problems.append(Problem((media_key,), f"at most {limit} {media_key} allowed, got {len(media)}",
                                    "value_error.length"))
    if problems:
        raise RequestError(problems)
    return parsed


def _parse_question(question_id: Any, question: Any, problems: list[Problem]) -> Question | None:
    loc = ("questions", question_id)
    before = len(problems)
    if not isinstance(question_id, str) or not QUESTION_ID.fullmatch(question_id):
        problems.append(Problem(loc, "question id must be 1–100 letters, digits, '_', '.' or '-'", "value_error.id"))
    if not isinstance(question, dict):
        problems.append(Problem(loc, "question must be an object", "type_error.dict"))
        return None
    kind = question.get("type")
    if kind not in QUESTION_TYPES:
        problems.append(Problem(loc + ("type",), f"type must be one of noul, choice, score; got {kind!r}",
                                "value_error.type"))
        return None
    instructions = question.get("instructions")
    if not _is_json_value(instructions):
        problems.append(Problem(loc + ("instructions",), "instructions must be text or JSON", "type_error.json"))
    criteria = question.get("criteria")
    criteria_loc = loc + ("criteria",)

    if kind == "noul":
        descriptions = dict(NOUL_DEFAULT_DESCRIPTIONS)
        if criteria is not None:
            if not isinstance(criteria, dict):
                problems.append(Problem(criteria_loc, "noul criteria must be null or a map with keys 'true'/'false'",
                                        "type_error.dict"))
            else:
                for key, description in criteria.items():
                    if key not in descriptions:
                        problems.append(Problem(criteria_loc + (key,), "noul criteria keys must be 'true' or 'false'",
                                                "value_error.key"))
                    elif not _is_json_value(description):
                        problems.append(Problem(criteria_loc + (key,), "description must be text or JSON",
                                                "type_error.json"))
                    elif description is not None:  # null keeps the default description
                        descriptions[key] = description
        option_ids = ("true", "false")
        caller_ids = option_ids
        option_descriptions = (descriptions["true"], descriptions["false"])
    elif kind == "choice":
        if not isinstance(criteria, dict):
            problems.append(Problem(criteria_loc, "choice criteria must be a map option id → description",
                                    "type_error.dict"))
            return None
        if not MIN_CHOICE_OPTIONS <= len(criteria) <= MAX_CHOICE_OPTIONS:
            problems.append(Problem(criteria_loc, f"choice needs {MIN_CHOICE_OPTIONS}–{MAX_CHOICE_OPTIONS} options, "
                                                  f"got {len(criteria)}", "value_error.length"))
        for option_id, description in criteria.items():
            if not option_id or len(option_id) > MAX_OPTION_ID_CHARS or not _is_text(option_id):
                problems.append(Problem(criteria_loc + (option_id,),
                                        f"option id must be 1–{MAX_OPTION_ID_CHARS} characters", "value_error.id"))
            if not _is_json_value(description):
                problems.append(Problem(criteria_loc + (option_id,), "description must be text, JSON or null",
                                        "type_error.json"))
        caller_ids = tuple(criteria)
        option_ids = tuple(sorted(criteria))  # the model reads choice options sorted by id
        option_descriptions = tuple(criteria[o] for o in option_ids)
    else:
        if not isinstance(criteria, list):
            problems.append(Problem(criteria_loc, "score criteria must be a list of level descriptions, lowest first",
                                    "type_error.list"))
            return None
        if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
            problems.append(Problem(criteria_loc, f"score needs {MIN_SCORE_LEVELS}–{MAX_SCORE_LEVELS} levels, "
                                                  f"got {len(criteria)}", "value_error.length"))
        for index, description in enumerate(criteria):
            if description is None or not _is_json_value(description):  # the legend shows every level
                problems.append(Problem(criteria_loc + (index,), "level description must be text or JSON",
                                        "type_error.json"))
        option_ids = tuple(str(i) for i in range(len(criteria)))
        caller_ids = option_ids
        option_descriptions = tuple(criteria)

    if len(problems) > before:
        return None
    return Question(question_id, kind, instructions, option_ids, option_descriptions, caller_ids)


def noul_confidence(p_true: float) -> float:
    """Noul answers carry no confidence on the wire; the workbench uses max(p, 1 − p), the probability of the
    answer it would give."""
    return max(p_true, 1.0 - p_true)


def format_answer(question: Question, probabilities: list[float]) -> dict:
    """One System One answer from the option probabilities in model order (reference rounding: 4 decimals)."""
    by_id = dict(zip(question.option_ids, probabilities))
    if question.type == "noul":
        return {"type": "noul", "noul": round(by_id["true"], 4)}
    if question.type == "choice":
        best = max(question.option_ids, key=lambda o: by_id[o])  # ties go to the first in model order
        return {
            "type": "choice",
            "choice": best,
            "confidence": round(by_id[best], 4),
            "probabilities": {o: round(by_id[o], 4) for o in question.caller_option_ids},
        }
    expectation = sum(i * p for i, p in enumerate(probabilities))
    return {
        "type": "score",
        "score": round(expectation, 4),
        "confidence": round(max(probabilities), 4),
        "legend": dict(zip(question.option_ids, question.option_descriptions)),
        "probabilities": {o: round(by_id[o], 4) for o in question.option_ids},
    }
