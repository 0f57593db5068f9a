"""Generated `x_explain` bodies against one real server process on the tiny release: states of many or huge
sentences, JSON states wide and deep, units the record has no segments of, junk options, tight budgets, truncation,
an image. Each is answered 200 with an explanation of every question, or refused 413/422 in our words; never a 5xx,
a traceback or a hang (each answer within the client's timeout), and the server lives on."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.api import INTERNAL_NAMES
from tests.support.media import b64, plain_png
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow  # a real server process

EXAMPLES = 30
ANSWER_SECONDS = 120  # a hang is a request unanswered this long

QUESTIONS = {"late": {"type": "noul", "instructions": "Is the parcel late?"},
             "tone": {"type": "choice", "instructions": "What is the tone?",
                      "criteria": {"calm": None, "angry": "The customer is angry."}},
             "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["later", "now"]}}
IMAGE = f"data:image/png;base64,{b64(plain_png(24, 16))}"

sentence = st.sampled_from(["The parcel is late.", "I want a refund!", "Why?", "ok", "…", "é\u0301.", "a. ",
                            "\n", "  ", "Line without an end"])
text_state = st.one_of(
    st.lists(sentence, max_size=40).map(" ".join),
    st.tuples(sentence, st.integers(1, 200_000)).map(lambda pair: pair[0] * pair[1]),  # up to megabytes
)
json_leaf = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12)
json_state = st.one_of(
    st.recursive(json_leaf, lambda children: st.lists(children, max_size=5)
                 | st.dictionaries(st.text(max_size=6), children, max_size=5), max_leaves=30),
    st.integers(1, 20_000).map(lambda n: {"items": [0] * n}),  # wide
    st.integers(1, 60).map(lambda depth: json.loads("[" * depth + "1" + "]" * depth)),  # deep
)
explain_option = st.one_of(
    st.just(True),
    st.sampled_from(["sentence", "line", "field", "region", "frame", "word", "", None]).map(lambda u: {"unit": u}),
    st.sampled_from([False, None, "yes", 1, [], {"unit": "field", "extra": 1}, {"units": "line"}]),
)
body = st.fixed_dictionaries(
    {"state": text_state | json_state, "questions": st.just(QUESTIONS), "x_explain": explain_option},
    optional={"x_overflow": st.sampled_from(["refuse", "truncate_state"]),
              "x_max_length": st.sampled_from([1, 300, 2_000, 16_384, 1_048_576]),
              "images": st.just([IMAGE])})


def test_generated_x_explain_bodies_get_an_answer_or_a_4xx(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=ANSWER_SECONDS) as http:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request=body)
        def check(request: dict) -> None:
            response = http.post("/v1/systemone", json=request)
            assert response.status_code in (200, 413, 422), (response.status_code, response.text[:500])
            assert not INTERNAL_NAMES.search(response.text), response.text[:500]
            if response.status_code == 200 and request["x_explain"] not in (None, False):
                explained = response.json()["x_explanations"]
                assert list(explained) == list(QUESTIONS)
                assert all(json.dumps(segment, allow_nan=False) for segments in explained.values()
                           for segment in segments)
            elif response.status_code == 413:
                assert response.json()["detail"]["error_type"] in ("token_budget_exceeded", "request_too_large")
            assert server.alive()

        check()
