"""The System One contract module: what a request may hold, where each problem is reported, the option order the
model reads, the hosted service's limits as warnings, and the shared builders."""

from __future__ import annotations

import base64
import json

import pytest

from clef_engine import protocol
from clef_engine.errors import RequestError
from clef_engine.protocol import (
    HOSTED,
    NOUL_DEFAULT_DESCRIPTIONS,
    SystemOneRequest,
    SystemOneResponse,
    ValidationErrorBody,
    format_answer,
    hosted_service_problems,
    prepare,
)

UNUSUAL_IDS = ["with space", "질문", "🎯", "a/b"]


def problems_of(request) -> list:
    with pytest.raises(RequestError) as caught:
        prepare(request)
    return caught.value.problems


def test_any_non_empty_string_is_a_question_id():
    request = {"state": "x", "questions": {qid: {"type": "noul"} for qid in UNUSUAL_IDS}}
    assert [q.id for q in prepare(request).questions] == UNUSUAL_IDS


def test_one_option_choice_and_one_level_score_are_accepted():
    request = {"state": "x", "questions": {"c": {"type": "choice", "criteria": {"only": "The one."}},
                                           "s": {"type": "score", "criteria": ["flat"]}}}
    choice, score = prepare(request).questions
    assert (choice.option_ids, choice.option_descriptions) == (("only",), ("The one.",))
    assert (score.option_ids, score.option_descriptions) == (("0",), ("flat",))


def test_the_contract_has_no_upper_limits():
    """Sizes are bounded by the token budget and the body size, not by the contract."""
    request = {
        "state": "x",
        "questions": {f"q{i}": {"type": "choice", "criteria": {f"o{k}": None for k in range(300)}}
                      for i in range(70)} | {"s": {"type": "score", "criteria": [str(i) for i in range(20)]},
                                             "x" * 500: {"type": "noul"}},
        "images": ["data:image/png;base64,AAAA"] * 9,
        "videos": ["data:video/mp4;base64,AAAA"] * 9,
    }
    assert len(prepare(request).questions) == 72


def test_model_order_of_options_and_noul_defaults():
    request = {"state": "x", "questions": {
        "n": {"type": "noul", "criteria": {"false": "Still open.", "true": None}},
        "c": {"type": "choice", "criteria": {"zeta": "Z", "alpha": None, "mid": {"tier": 2}}},
        "s": {"type": "score", "instructions": "How bad?", "criteria": ["none", "some", "high"]},
    }}
    noul, choice, score = prepare(request).questions
    assert noul.option_ids == ("true", "false")
    assert noul.option_descriptions == (NOUL_DEFAULT_DESCRIPTIONS["true"], "Still open."), "null keeps the default"
    assert choice.option_ids == ("alpha", "mid", "zeta") and choice.caller_option_ids == ("zeta", "alpha", "mid")
    assert choice.option_descriptions == (None, {"tier": 2}, "Z")
    assert score.option_ids == score.caller_option_ids == ("0", "1", "2")
    assert score.instructions == "How bad?" and noul.instructions is None


def test_deeply_nested_json_is_checked_without_recursion_errors():
    """json.loads accepts nesting deeper than a recursive checker can walk; NaN at the bottom is still found."""
    depth = 900
    deep = json.loads("[" * depth + '{"a": 1.5}' + "]" * depth)
    request = {"state": deep, "questions": {"a": {"type": "noul", "instructions": deep}}}
    assert [q.id for q in prepare(request).questions]
    nan_at_bottom = json.loads("[" * depth + "NaN" + "]" * depth)
    (problem,) = problems_of({"state": nan_at_bottom, "questions": {"a": {"type": "noul"}}})
    assert problem.loc == ("state",) and "NaN" in problem.msg


def test_unknown_top_level_fields_and_any_model_name_are_accepted():
    request = {"model": "jev-latest", "state": ["any", {"json": 1}], "questions": {"a": {"type": "noul"}},
               "metadata": {"trace": "abc"}}
    assert [q.id for q in prepare(request).questions] == ["a"]
    assert protocol.validate_request(request).model == "jev-latest"


def test_a_bad_request_names_every_location_at_once():
    request = {
        "model": 7,
        "state": float("nan"),
        "questions": {
            "": {"type": "noul"},
            "kind": {"type": "maybe"},
            "untyped": {"instructions": "?"},
            "empty": {"type": "choice", "criteria": {}},
            "levels": {"type": "score", "criteria": ["low", None]},
            "sides": {"type": "noul", "criteria": {"maybe": "x"}},
            "text": {"type": "noul", "instructions": "bad \ud800"},
            "shape": {"type": "score", "criteria": {"0": "x"}},
            "scalar": "noul",
        },
        "images": "not a list",
        "x_overflow": "drop",
    }
    problems = problems_of(request)
    assert {p.loc: p.msg for p in problems} == {
        ("model",): "must be a string",
        ("state",): "must be text or a JSON value (no NaN, infinity or unpaired surrogates)",
        ("questions", ""): "ids must be non-empty strings",
        ("questions", "kind", "type"): 'type must be one of noul, choice, score; got "maybe"',
        ("questions", "untyped", "type"): "field required: one of noul, choice, score",
        ("questions", "empty", "criteria"): "a choice needs at least one option",
        ("questions", "levels", "criteria", 1): "a level description must be text or JSON, not null",
        ("questions", "sides", "criteria", "maybe"): "noul criteria keys must be 'true' or 'false'",
        ("questions", "text", "instructions"): "must be text or a JSON value (no NaN, infinity or unpaired "
                                               "surrogates)",
        ("questions", "shape", "criteria"): "score criteria must be a list of level descriptions, lowest first",
        ("questions", "scalar"): 'a question must be an object with "type", "instructions", "criteria"',
        ("images",): "must be a list",
        ("x_overflow",): "x_overflow must be one of refuse, truncate_state",
    }
    assert all(set(p.as_dict()) == {"loc", "msg", "type"} for p in problems)


@pytest.mark.parametrize(("request_body", "loc", "message"), [
    ("not an object", (), "the request must be a JSON object"),
    ({"questions": {"a": {"type": "noul"}}}, ("state",), "field required"),
    ({"state": "x"}, ("questions",), "field required"),
    ({"state": "x", "questions": {}}, ("questions",), "at least one question is required"),
    ({"state": "x", "questions": [{"type": "noul"}]}, ("questions",), "must be an object"),
    ({"state": float("inf"), "questions": {"a": {"type": "noul"}}}, ("state",), "infinity"),
    ({"state": {"\ud800": 1}, "questions": {"a": {"type": "noul"}}}, ("state",), "unpaired surrogates"),
    ({"state": "x", "questions": {"a": {"type": "choice", "criteria": {"k": float("nan")}}}},
     ("questions", "a", "criteria", "k"), "NaN"),
    ({"state": "x", "questions": {"a": {"type": "choice", "criteria": {"": "empty id"}}}},
     ("questions", "a", "criteria", ""), "non-empty"),
    ({"state": "x", "questions": {"a": {"type": "noul"}}, "x_max_length": 0}, ("x_max_length",), "greater than"),
])
def test_bad_requests_name_the_field(request_body, loc, message):
    problems = problems_of(request_body)
    assert any(p.loc == loc and message in p.msg for p in problems), problems


def test_an_id_with_an_unpaired_surrogate_is_refused_with_a_location_json_can_carry():
    (problem,) = problems_of({"state": "x", "questions": {"\udc00": {"type": "noul"}}})
    assert problem.loc[0] == "questions" and "unpaired surrogates" in problem.msg
    problem.loc[1].encode("utf-8")  # the 422 body must be serializable


def test_hosted_service_limits_are_reported_not_enforced():
    request = {"state": "x", "questions": {
        "with space": {"type": "noul"},
        "one": {"type": "choice", "criteria": {"only": None}},
        "flat": {"type": "score", "criteria": ["only"]},
        "many": {"type": "score", "criteria": [str(i) for i in range(HOSTED.score_levels[-1] + 1)]},
        "fine": {"type": "choice", "criteria": {"a": None, "b": None}},
    }}
    prepare(request)  # the contract accepts all of it
    found = {p.loc: p.msg for p in hosted_service_problems(request["questions"])}
    prefix = "the hosted service would refuse this: "
    assert found == {
        ("questions", "with space"): prefix + "question ids must be 1–100 letters, digits, '_', '.' or '-'",
        ("questions", "one", "criteria"): prefix + "a choice takes 2–255 options, this has 1",
        ("questions", "flat", "criteria"): prefix + "a score takes 2–10 levels, this has 1",
        ("questions", "many", "criteria"): prefix + "a score takes 2–10 levels, this has 11",
    }
    too_many = {f"q{i}": {"type": "noul"} for i in range(HOSTED.questions[-1] + 1)}
    assert [p.loc for p in hosted_service_problems(too_many)] == [("questions",)]
    assert hosted_service_problems({f"q{i}": {"type": "noul"} for i in range(HOSTED.questions[-1])}) == []


def test_answers_fit_the_response_model():
    request = {"state": "x", "questions": {"n": {"type": "noul"},
                                           "c": {"type": "choice", "criteria": {"b": None, "a": None}},
                                           "s": {"type": "score", "criteria": ["lo", "hi"]}}}
    noul, choice, score = prepare(request).questions
    answers = {"n": format_answer(noul, [0.25, 0.75]), "c": format_answer(choice, [0.6, 0.4]),
               "s": format_answer(score, [0.2, 0.8])}
    assert answers["c"] == {"type": "choice", "choice": "a", "confidence": 0.6, "probabilities": {"b": 0.4, "a": 0.6}}
    assert answers["s"]["score"] == 0.8 and answers["s"]["legend"] == {"0": "lo", "1": "hi"}
    response = {"model": "clef", "answers": answers, "usage": {"input_tokens": 12, "output_tokens": 0},
                "x_token_counts": {"state": 1}}
    assert SystemOneResponse.model_validate(response).model_dump()["answers"] == answers


def test_json_schemas_for_an_openapi_document():
    request_schema = SystemOneRequest.model_json_schema()
    assert {"state", "questions"} <= set(request_schema["required"])
    question = request_schema["properties"]["questions"]["additionalProperties"]
    assert question["discriminator"]["propertyName"] == "type"
    assert set(question["discriminator"]["mapping"]) == {"noul", "choice", "score"}
    assert request_schema["properties"]["images"]["anyOf"][0]["items"]["anyOf"][0]["type"] == "string"
    assert set(SystemOneResponse.model_json_schema()["required"]) == {"model", "answers", "usage"}
    assert ValidationErrorBody.model_json_schema()["required"] == ["detail"]


def test_request_builder_and_data_url():
    data = b"\x89PNG\r\n\x1a\nbytes"
    url = protocol.data_url("image/png", data)
    assert url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == data
    questions = {"a": {"type": "noul"}}
    assert protocol.build_request("s", questions) == {"model": "clef", "state": "s", "questions": questions}
    request = protocol.build_request({"k": 1}, questions, images=[url], videos=iter([url]), model="clef-flash")
    assert request["images"] == request["videos"] == [url] and request["model"] == "clef-flash"
    prepare(request)


def test_answer_keys_in_the_callers_order():
    assert protocol.option_ids("noul", None) == ("true", "false")
    assert protocol.option_ids("choice", {"z": None, "a": None}) == ("z", "a")
    assert protocol.option_ids("score", ["lo", "mid", "hi"]) == ("0", "1", "2")
    assert protocol.option_ids("choice", None) == () and protocol.option_ids("score", "bad") == ()


def test_the_workbench_uses_the_contract_module():
    """One owner: the workbench's names are the protocol's objects, not copies that can drift."""
    from clef_workbench import casesets, schemas
    from workbench_ui import answers, state_input

    assert schemas.QUESTION_TYPES is protocol.QUESTION_TYPES
    assert answers.NOUL_DEFAULT_DESCRIPTIONS is protocol.NOUL_DEFAULT_DESCRIPTIONS
    assert casesets.data_url is protocol.data_url
    assert state_input.MAX_IMAGES == protocol.HOSTED.max_images
    assert casesets.option_ids({"type": "choice", "criteria": {"z": None, "a": None}}) == ["z", "a"]
