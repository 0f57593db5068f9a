"""What the Decide page shows about a response: option tables, confidence, margin, labels, charts, budget, errors."""

from __future__ import annotations

import pytest

from workbench_ui import answers

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Spam?", "criteria": {"true": "It is spam."}},
    "team": {"type": "choice", "instructions": "Team?",
             "criteria": {"tech": "Broken things.", "billing": "Money.", "unknown": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
}
RESPONSE = {
    "model": "clef",
    "answers": {
        "spam": {"type": "noul", "noul": 0.3},
        "team": {"type": "choice", "choice": "billing", "confidence": 0.6,
                 "probabilities": {"tech": 0.25, "billing": 0.6, "unknown": 0.15}},
        "urgency": {"type": "score", "score": 1.3, "confidence": 0.5,
                    "legend": {"0": "low", "1": "medium", "2": "high"},
                    "probabilities": {"0": 0.2, "1": 0.3, "2": 0.5}},
    },
    "usage": {"input_tokens": 100, "output_tokens": 0},
}


def test_noul_table_and_summary():
    table = answers.option_table(QUESTIONS["spam"], RESPONSE["answers"]["spam"])
    assert list(table["option"]) == ["true", "false"]
    assert list(table["probability"]) == pytest.approx([0.3, 0.7])
    assert list(table["chosen"]) == [False, True]
    assert list(table["description"]) == ["It is spam.", answers.NOUL_DEFAULT_DESCRIPTIONS["false"]]
    summary = answers.summarize("spam", QUESTIONS["spam"], RESPONSE["answers"]["spam"])
    assert (summary.top_option, summary.label) == ("false", False)
    assert summary.confidence == pytest.approx(0.7)  # max(p, 1 - p)
    assert summary.margin == pytest.approx(0.4)  # |2p - 1|
    assert summary.score is None


def test_choice_table_keeps_the_response_order_and_highlights_the_choice():
    table = answers.option_table(QUESTIONS["team"], RESPONSE["answers"]["team"])
    assert list(table["option"]) == ["tech", "billing", "unknown"]
    assert list(table.loc[table["chosen"], "option"]) == ["billing"]
    assert list(table["description"]) == ["Broken things.", "Money.", ""]
    summary = answers.summarize("team", QUESTIONS["team"], RESPONSE["answers"]["team"])
    assert summary.confidence == pytest.approx(0.6)
    assert summary.margin == pytest.approx(0.35)  # 0.6 - 0.25
    assert summary.label == "billing"


def test_score_table_uses_legend_and_mode():
    table = answers.option_table(QUESTIONS["urgency"], RESPONSE["answers"]["urgency"])
    assert list(table["label"]) == ["0: low", "1: medium", "2: high"]
    assert list(table["chosen"]) == [False, False, True]
    summary = answers.summarize("urgency", QUESTIONS["urgency"], RESPONSE["answers"]["urgency"])
    assert summary.score == pytest.approx(1.3)
    assert summary.margin == pytest.approx(0.2)
    assert summary.label == 2


def test_margin_edge_cases():
    assert answers.margin([0.5, 0.5]) == 0
    assert answers.margin([1.0]) == 1.0
    assert answers.margin([0.1, 0.7, 0.2]) == pytest.approx(0.5)


def test_expected_labels_use_the_types_the_store_expects():
    assert answers.expected_labels(QUESTIONS, RESPONSE) == {"spam": False, "team": "billing", "urgency": 2}


def test_probability_chart_highlights_only_the_chosen_option():
    table = answers.option_table(QUESTIONS["team"], RESPONSE["answers"]["team"])
    spec = answers.probability_chart(table).to_dict()
    bars = spec["layer"][0]
    assert bars["mark"]["type"] == "bar"
    assert bars["encoding"]["color"]["scale"]["range"] == [answers.CHOSEN_COLOR, answers.OTHER_COLOR]
    data = next(iter(spec["datasets"].values()))
    assert [(row["option"], row["answer"]) for row in data] == [("tech", "other"), ("billing", "chosen"),
                                                               ("unknown", "other")]
    assert spec["layer"][0]["encoding"]["y"]["sort"] == ["tech", "billing", "unknown"]


COUNTS = {"prefix": 35, "media": 0, "state": 500, "schema": 300, "suffix": 14, "total": 849}


def test_budget_fits():
    status = answers.budget_status({**COUNTS, "max_length": 1000, "state_tokens_over": 0, "fixed_tokens_over": 0})
    assert status.message == "849 of 1,000 tokens used."


def test_budget_state_would_be_cut():
    status = answers.budget_status({**COUNTS, "max_length": 800})
    assert status.state_tokens_over == 49 and status.fixed_tokens_over == 0
    assert status.message == ("The record is 849 tokens; max_length is 800, so Run will be refused: choose to "
                              "truncate the state (its last 49 tokens are cut) or raise max_length.")
    truncating = answers.budget_status({**COUNTS, "max_length": 800}, "truncate_state")
    assert truncating.message == ("The record is 849 tokens; max_length is 800. The last 49 tokens of the state will "
                                  "be cut: the model will not read them.")


def test_budget_fixed_parts_over():
    status = answers.budget_status({**COUNTS, "max_length": 300})
    assert status.fixed_tokens_over == 49 and status.state_tokens_over == 500
    assert status.message.startswith("Even without the state, this record is 49 tokens over max_length 300")


def test_budget_table_shows_free_space_or_the_overflow():
    table = answers.budget_table({**COUNTS, "max_length": 1000})
    assert list(table["part"]) == [*answers.BUDGET_PARTS, "free"]
    assert list(table["end"]) == [35, 35, 535, 835, 849, 1000]
    over = answers.budget_table({**COUNTS, "max_length": 800})
    assert over.iloc[-1].to_dict() == {"part": "over max_length", "tokens": 49, "start": 800, "end": 849}
    exact = answers.budget_table({**COUNTS, "max_length": 849})
    assert list(exact["part"]) == list(answers.BUDGET_PARTS)
    spec = answers.budget_chart({**COUNTS, "max_length": 800}).to_dict()
    assert spec["encoding"]["color"]["scale"]["range"][-1] == "#d64545", "the overflow is drawn in red"
