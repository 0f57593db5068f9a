"""Run statistics against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest

from clef_workbench import stats

SCHEMA = {
    "name": "t",
    "version": "1",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"a": None, "b": None, "c": None}},
        "severity": {"type": "score", "instructions": "How bad?", "criteria": ["low", "mid", "high"]},
    },
}


def result(case_id, *, noul=None, choice=None, score=None, expected=None, latency=None, tokens=None,
           started="2026-01-01T00:00:00.000+00:00", finished="2026-01-01T00:00:01.000+00:00", error=None):
    answers = {}
    if noul is not None:
        answers["urgent"] = {"type": "noul", "noul": noul}
    if choice is not None:
        best = max(choice, key=choice.get)
        answers["team"] = {"type": "choice", "choice": best, "confidence": choice[best], "probabilities": choice}
    if score is not None:
        probs = {str(i): p for i, p in enumerate(score)}
        answers["severity"] = {"type": "score", "score": sum(i * p for i, p in enumerate(score)),
                               "confidence": max(score), "probabilities": probs}
    return {"case_id": case_id, "position": case_id, "response": None if error else {"answers": answers},
            "error": error, "expected": expected or {}, "latency_ms": latency, "input_tokens": tokens,
            "started_at": started, "finished_at": finished}


def t(seconds: float) -> str:
    return f"2026-01-01T00:00:{seconds:06.3f}+00:00"


def test_latency_percentiles_use_linear_interpolation():
    results = [result(i, noul=0.9, latency=ms, started=t(0), finished=t(1))
               for i, ms in enumerate([40, 10, 100, 30, 20])]
    results.append(result(9, error="RequestError: bad", started=t(0), finished=t(1)))
    out = stats.latency_stats(results)
    # sorted 10 20 30 40 100; p95: h = 4·0.95 = 3.8 → 40 + 0.8·60 = 88; p99: h = 3.96 → 40 + 0.96·60 = 97.6
    assert out["count"] == 5 and out["errors"] == 1
    assert out["p50"] == pytest.approx(30)
    assert out["p95"] == pytest.approx(88)
    assert out["p99"] == pytest.approx(97.6)
    assert out["max"] == 100
    assert out["window_s"] == pytest.approx(1.0)


def test_throughput_counts_only_busy_time():
    # chunks [0,2] and [1,3] overlap → 3 s busy; [10,11] after a pause → 1 s; total 4 s, not 11 s
    results = [
        result(1, noul=0.9, tokens=100, started=t(0), finished=t(2)),
        result(2, noul=0.9, tokens=300, started=t(1), finished=t(3)),
        result(3, noul=0.9, tokens=200, started=t(10), finished=t(11)),
        result(4, noul=0.9, tokens=200, started=t(10), finished=t(11)),
    ]
    assert stats.busy_seconds(results) == pytest.approx(4.0)
    out = stats.throughput(results, n_questions=3)
    assert out["records_per_s"] == pytest.approx(1.0)
    assert out["decisions_per_s"] == pytest.approx(3.0)
    assert out["tokens_per_s"] == pytest.approx(800 / 4)
    assert out["tokens_per_record_mean"] == pytest.approx(200)
    assert out["tokens_per_record_median"] == pytest.approx(200)


NOUL_CASES = [
    # P(true), expected  → predicted, confidence, correct
    (0.9, True),   # true, 0.90, right
    (0.8, False),  # true, 0.80, wrong
    (0.3, False),  # false, 0.70, right
    (0.35, True),  # false, 0.65, wrong
]


def noul_frame():
    results = [result(i, noul=p, expected={"urgent": exp}) for i, (p, exp) in enumerate(NOUL_CASES)]
    return stats.answer_frame(results, SCHEMA)


def test_noul_accuracy_confidence_and_margin():
    frame = noul_frame()
    assert list(frame["predicted"]) == ["true", "true", "false", "false"]
    assert list(frame["confidence"]) == pytest.approx([0.9, 0.8, 0.7, 0.65])
    assert list(frame["margin"]) == pytest.approx([0.8, 0.6, 0.4, 0.3])
    accuracy = stats.accuracy_by_question(frame).set_index("question_id")
    assert accuracy.loc["urgent", "n_expected"] == 4
    assert accuracy.loc["urgent", "n_correct"] == 2
    assert accuracy.loc["urgent", "accuracy"] == pytest.approx(0.5)


def test_noul_ece_and_binary_brier():
    cal = stats.calibration(noul_frame(), "urgent", bins=10)
    # each case alone in its bin (0.9→9, 0.8→8, 0.7→7, 0.65→6): ECE = (0.1 + 0.8 + 0.3 + 0.65) / 4 = 0.4625
    assert cal["ece"] == pytest.approx(0.4625)
    # Brier: (0.9−1)² + 0.8² + 0.3² + (0.35−1)² = 0.01 + 0.64 + 0.09 + 0.4225 = 1.1625; / 4 = 0.290625
    assert cal["brier"] == pytest.approx(0.290625)
    bins = cal["bins"].set_index("bin_low")
    assert bins["count"].sum() == 4
    assert bins.loc[0.7, "count"] == 1  # 1 − 0.3 is not pushed down into the 0.6 bin by float rounding
    assert bins.loc[0.7, "accuracy"] == 1.0


def test_ece_with_shared_bin():
    # two cases in one bin: confidences 0.92 and 0.96 (mean 0.94), one right → |0.5 − 0.94| · 2/2 = 0.44
    results = [result(1, noul=0.92, expected={"urgent": True}), result(2, noul=0.96, expected={"urgent": False})]
    cal = stats.calibration(stats.answer_frame(results, SCHEMA), "urgent")
    assert cal["ece"] == pytest.approx(0.44)


def test_choice_multiclass_brier_and_confusion():
    results = [
        result(1, choice={"a": 0.5, "b": 0.3, "c": 0.2}, expected={"team": "a"}),  # right
        result(2, choice={"a": 0.1, "b": 0.6, "c": 0.3}, expected={"team": "c"}),  # wrong: b for c
        result(3, choice={"a": 0.2, "b": 0.7, "c": 0.1}, expected={"team": "b"}),  # right
        result(4, choice={"a": 0.4, "b": 0.35, "c": 0.25}),                       # no expected answer
    ]
    frame = stats.answer_frame(results, SCHEMA)
    cal = stats.calibration(frame, "team")
    # (0.25 + 0.09 + 0.04) + (0.01 + 0.36 + 0.49) + (0.04 + 0.09 + 0.01) = 0.38 + 0.86 + 0.14 = 1.38; / 3 = 0.46
    assert cal["brier"] == pytest.approx(0.46)
    assert cal["n"] == 3
    matrix = stats.confusion_matrix(frame, "team", labels=["a", "b", "c"])
    assert list(matrix.index) == ["a", "b", "c"] and list(matrix.columns) == ["a", "b", "c"]
    assert matrix.loc["a", "a"] == 1 and matrix.loc["b", "b"] == 1 and matrix.loc["c", "b"] == 1
    assert int(matrix.to_numpy().sum()) == 3
    least = stats.least_confident(frame, n=1)
    assert least.loc[0, "case_id"] == 4 and least.loc[0, "margin"] == pytest.approx(0.05)


def test_score_mae_and_mode_prediction():
    results = [
        result(1, score=[0.1, 0.4, 0.5], expected={"severity": 2}),  # score 1.4, |1.4 − 2| = 0.6; mode 2 right
        result(2, score=[0.8, 0.2, 0.0], expected={"severity": 0}),  # score 0.2, |0.2 − 0| = 0.2; mode 0 right
    ]
    frame = stats.answer_frame(results, SCHEMA)
    mae = stats.score_mae(frame).set_index("question_id")
    assert mae.loc["severity", "mae"] == pytest.approx(0.4)
    assert mae.loc["severity", "n_expected"] == 2
    assert list(frame["predicted"]) == ["2", "0"]
    assert stats.accuracy_by_question(frame).loc[0, "accuracy"] == 1.0


def test_slowest_cases_ignore_errors():
    results = [result(1, noul=0.9, latency=5), result(2, noul=0.9, latency=50), result(3, noul=0.9, latency=20),
               result(4, error="TokenBudgetError: over")]
    slow = stats.slowest_cases(results, n=2)
    assert list(slow["case_id"]) == [2, 3]


def test_empty_run_gives_empty_stats_not_errors():
    assert stats.latency_stats([])["count"] == 0
    assert stats.throughput([], 3)["records_per_s"] is None
    frame = stats.answer_frame([], SCHEMA)
    assert stats.accuracy_by_question(frame).empty
    cal = stats.calibration(frame, "urgent")
    assert cal["ece"] is None and cal["n"] == 0
    assert math.isnan(stats.calibration(frame, "urgent")["bins"]["accuracy"].iloc[0])


def test_browse_table_joins_state_expected_and_answers_and_filters():
    from clef_workbench.stats import browse_table, filter_browse

    schema = {"questions": {"team": {"type": "choice", "criteria": {"billing": None, "tech": None}},
                            "urgent": {"type": "noul"}}}

    def result(case_id, state, tags, expected, p_billing, p_true):
        return {"case_id": case_id, "position": case_id, "state": state, "tags": tags, "expected": expected,
                "response": {"answers": {
                    "team": {"type": "choice", "probabilities": {"billing": p_billing, "tech": 1 - p_billing}},
                    "urgent": {"type": "noul", "noul": p_true}}}}

    results = [result(1, "Refund me twice", ["vip"], {"team": "billing"}, 0.9, 0.2),
               result(2, {"body": "App crashes"}, [], {"team": "billing", "urgent": True}, 0.3, 0.55),
               {"case_id": 3, "position": 3, "state": "x", "error": "TokenBudgetError", "response": None}]
    table = browse_table(results, schema)
    assert len(table) == 4
    first = table.iloc[0].to_dict()
    assert first["state"] == "Refund me twice" and first["expected"] == "billing" and first["correct"] is True
    assert first["probabilities"] == "billing 0.90 · tech 0.10"
    assert table.iloc[2]["state"] == '{"body": "App crashes"}'
    assert table.iloc[1]["correct"] is None, "no expected answer: neither right nor wrong"
    wrong = filter_browse(table, wrong_only=True)
    assert wrong[["case", "question"]].values.tolist() == [[2, "team"]]
    assert filter_browse(table, confidence_below=0.6)[["case", "question"]].values.tolist() == [[2, "urgent"]]
    assert filter_browse(table, questions=["urgent"], tags=["vip"])["case"].tolist() == [1]
    assert filter_browse(table, search="CRASHES")["case"].tolist() == [2, 2]
    assert filter_browse(table, search="tech")["predicted"].tolist() == ["tech"]
