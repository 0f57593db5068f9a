"""Issue 36, point 11: every message in plain words. Each number reads as the screen's other numbers do (thousands
separated, one rounding, one megabyte), and a message says one true thing once."""

from __future__ import annotations

import pytest

from clef_engine.errors import TokenBudgetError
from clef_engine.explain import check_cost
from workbench_ui import answers, links, state_input
from workbench_ui.state_input import MediaError


def test_a_not_found_link_counts_what_exists_in_words():
    one = links.missing("case set", 999, [4], lambda i: f"Tickets #{i}", param="set")
    assert "There is 1: pick it below." in one.message and "There are 1" not in one.message
    many = links.missing("case set", 999, list(range(1200)), str, param="set")
    assert "There are 1,200: pick one below." in many.message


def test_a_bar_and_the_confidence_above_it_round_alike():
    """0.8165 read 81.7% in the Confidence metric and 81.6% on its bar (pandas rounds 81.65 half to even)."""
    question = {"type": "choice", "criteria": {"billing": "Billing", "tech": "Tech"}}
    answer = {"type": "choice", "choice": "billing", "confidence": 0.8165,
              "probabilities": {"billing": 0.8165, "tech": 0.1835}}
    chart = answers.probability_chart(answers.option_table(question, answer))
    data = chart.data  # the layers share the chart's data
    labels = dict(zip(data["option"], data["percent"], strict=True))
    summary = answers.summarize("team", question, answer)
    assert labels["billing"] == answers.percent(summary.confidence) == "81.7%"
    assert labels["tech"] == "18.4%"


def test_a_file_size_and_its_limit_count_megabytes_as_the_uploader_chip_does():
    """Streamlit's chip calls 26,100,000 bytes "26.1MB"; the refusal called the same file 24.9 MB."""
    with pytest.raises(MediaError) as refused:
        state_input.check_image("scan.png", b"\x89PNG\r\n\x1a\n" + bytes(26_100_000 - 8))
    assert str(refused.value) == "scan.png: 26.1 MB is over the 20 MB image limit."
    assert "20 MB" in state_input.media_limits_text() and "64 MB" in state_input.media_limits_text()


def test_token_counts_in_a_refusal_have_thousands_separators():
    with pytest.raises(TokenBudgetError) as refused:
        check_cost(1_250, 63, 79_007, 65_536)
    assert "takes 79,007 tokens (the record, 1,250 tokens" in str(refused.value)
    assert "13,471 over the 65,536-token budget" in str(refused.value)


def test_the_budget_legend_names_every_part_whole():
    """Vega cuts a legend label at 160 px by default ("over max_le…"), and a legend wider than its chart is cut at the
    chart's edge: in one row, "over max_length" ended as "over ma" on Decide at 1280×900. Its columns must fit the
    narrowest chart: Decide's right column at 1024×768, 290 px wide (measured in Chromium)."""
    chart = answers.budget_chart({"prefix": 20, "schema": 300, "state": 900, "suffix": 10, "max_length": 1024})
    spec = chart.to_dict()
    legend = spec["encoding"]["color"]["legend"]
    assert legend["labelLimit"] == 0
    labels = spec["encoding"]["color"]["scale"]["domain"]
    columns = legend.get("columns", len(labels))  # Vega's grid: each column as wide as its widest entry
    width = sum(max(len(label) for label in labels[j::columns]) * 7 + 28 for j in range(columns))  # ~7 px a letter
    assert width <= 290, f"the legend needs ~{width} px in {columns} columns"
