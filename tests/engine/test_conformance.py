"""System One conformance through the engine on the tiny release: what the release code accepts gets answered, keyed
as the caller wrote it; bad requests name every field at fault."""

from __future__ import annotations

import pytest

from clef_engine import RequestError
from clef_engine.protocol import SystemOneResponse

UNUSUAL_IDS = ["with space", "질문", "🎯", "a/b"]


def test_any_non_empty_question_id_is_answered_under_that_id(tiny_engine):
    request = {"model": "jev-latest", "state": {"ticket": "Refund please"}, "questions": {
        "with space": {"type": "noul", "instructions": "Is it a refund?"},
        "질문": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": "Broken"}},
        "🎯": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]},
        "a/b": {"type": "noul", "criteria": {"true": "Yes."}},
    }}
    response = tiny_engine.decide(request)
    assert list(response["answers"]) == UNUSUAL_IDS
    assert [a["type"] for a in response["answers"].values()] == ["noul", "choice", "score", "noul"]
    assert response["model"] == "jev-latest"
    SystemOneResponse.model_validate(response)


def test_one_option_choice_has_probability_one(tiny_engine):
    request = {"state": "anything", "questions": {
        "only": {"type": "choice", "instructions": "Pick", "criteria": {"the-one": "The only option."}},
        "spam": {"type": "noul", "instructions": "Spam?"},
    }}
    answer = tiny_engine.decide(request)["answers"]["only"]
    assert answer == {"type": "choice", "choice": "the-one", "confidence": 1.0, "probabilities": {"the-one": 1.0}}


def test_one_level_score_has_score_zero_and_confidence_one(tiny_engine):
    request = {"state": "anything", "questions": {"flat": {"type": "score", "criteria": ["the only level"]}}}
    answer = tiny_engine.decide(request)["answers"]["flat"]
    assert answer == {"type": "score", "score": 0.0, "confidence": 1.0, "legend": {"0": "the only level"},
                      "probabilities": {"0": 1.0}}


def test_beyond_the_hosted_limits_is_still_answered(tiny_engine):
    """11 levels and 70 questions are over the hosted service's limits, not the contract's."""
    questions = {f"q{i}": {"type": "noul", "instructions": f"Q{i}?"} for i in range(69)}
    questions["eleven"] = {"type": "score", "criteria": [f"level {i}" for i in range(11)]}
    response = tiny_engine.decide({"state": "x", "questions": questions})
    assert len(response["answers"]) == 70
    assert sum(response["answers"]["eleven"]["probabilities"].values()) == pytest.approx(1.0, abs=1e-3)


def test_a_bad_request_names_each_location(tiny_engine):
    request = {"state": "x", "model": ["not", "a", "string"], "questions": {
        "": {"type": "noul"},
        "kind": {"type": "maybe"},
        "empty": {"type": "choice", "criteria": {}},
        "none": {"type": "score", "criteria": []},
        "sides": {"type": "noul", "criteria": {"maybe": "x"}},
        "levels": {"type": "score", "criteria": ["low", float("nan")]},
    }}
    with pytest.raises(RequestError) as caught:
        tiny_engine.decide(request)
    assert {p.loc for p in caught.value.problems} == {
        ("model",),
        ("questions", ""),
        ("questions", "kind", "type"),
        ("questions", "empty", "criteria"),
        ("questions", "none", "criteria"),
        ("questions", "sides", "criteria", "maybe"),
        ("questions", "levels", "criteria", 1),
    }
    assert "questions.none.criteria: a score needs at least one level" in str(caught.value)
