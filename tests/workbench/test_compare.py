"""The comparison service (clef_workbench/compare.py) on the runs of tests/support/compare_runs.py, whose numbers are
worked out by hand below.

A, spam: correct 1 1 0 0 → accuracy 0.5; confidence .9 .8 .6 .6 → ECE = (.1 + .2 + 2·.6)/4 = 0.375;
         Brier = (.01 + .04 + .36 + .36)/4 = 0.1925.
A, tone: correct 1 0 0 1 → 0.5; ECE = (.3 + .6 + .8 + .1)/4 = 0.45; Brier = (.18 + .72 + 1.28 + .02)/4 = 0.55.
B, spam: all correct → 1.0; Brier = (.04 + .09 + .09 + .09)/4 = 0.0775.   B, tone: correct 1 1 0 1 → 0.75.
A vs B: spam agree 1 1 0 0 → 0.5, flips 103, 104 (both fixed by B); tone agree 1 0 1 1 → 0.75, flip 102 (fixed).

Bootstrap of the mean of four cases with two ones: the resampled mean is 0, .25, .5, .75, 1 with probabilities
1, 4, 6, 4, 1 (/16), so its 25 % and 75 % quantiles are 0.25 and 0.75 (a 50 % interval).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clef_workbench import compare, stats
from clef_workbench.store import Store
from tests.support.compare_runs import CASES, EXPECTED, RUN_A, RUN_B, RUN_C, SCHEMA, make_run
from tests.support.endpoints import RefusingEndpoint, serve

A, B, C = RUN_A.label, RUN_B.label, RUN_C.label
HALF = {"n_boot": 4000, "level": 0.5}  # see the module docstring for why (0.25, 0.75)


def test_labels_are_short_and_unique():
    assert (A, B, C) == ("#1 model-1 · triage v1", "#2 model-2 · triage v1", "#3 model-3 · triage v2")


def test_agreement_per_question_and_pair_with_flipped_cases():
    table = compare.agreement([RUN_A, RUN_B, RUN_C], **HALF)
    got = {(r.question_id, r.run_a, r.run_b): (r.n, r.agreements, r.agreement, r.flipped_case_ids)
           for r in table.itertuples()}
    assert got == {
        ("spam", A, B): (4, 2, 0.5, [103, 104]),
        ("tone", A, B): (4, 3, 0.75, [102]),
        ("spam", A, C): (3, 3, 1.0, []),  # C failed on 104: three cases in common; C has no tone question
        ("spam", B, C): (3, 2, 2 / 3, [103]),
    }
    spam_ab = table.iloc[0]
    assert (spam_ab.low, spam_ab.high) == (0.25, 0.75)
    assert (table.iloc[2].low, table.iloc[2].high) == (1.0, 1.0)  # no disagreement in any resample


def test_flips_say_which_way_the_answer_changed():
    table = compare.flips([RUN_A, RUN_B])
    rows = [(r.question_id, r.case_id, r.position, r.expected, r.predicted_a, r.predicted_b, r.change)
            for r in table.itertuples()]
    assert rows == [("spam", 103, 2, "false", "true", "false", "fixed"),
                    ("spam", 104, 3, "true", "false", "true", "fixed"),
                    ("tone", 102, 1, "a", "b", "a", "fixed")]
    broken = compare.flips([RUN_B, RUN_A])  # the other way round, the same flips broke it
    assert set(broken["change"]) == {"broken"}


def test_metrics_side_by_side_by_hand():
    table = compare.metrics([RUN_A, RUN_B, RUN_C], **HALF).set_index(["run_id", "question_id", "metric"])
    expected = {
        (1, "spam", "accuracy"): 0.5, (1, "spam", "ece"): 0.375, (1, "spam", "brier"): 0.1925,
        (1, "tone", "accuracy"): 0.5, (1, "tone", "ece"): 0.45, (1, "tone", "brier"): 0.55,
        (2, "spam", "accuracy"): 1.0, (2, "spam", "brier"): 0.0775, (2, "tone", "accuracy"): 0.75,
        (3, "spam", "accuracy"): 2 / 3,  # T F T against true false false
    }
    for key, value in expected.items():
        assert table.loc[key, "value"] == pytest.approx(value), key
    assert table.loc[(1, "spam", "accuracy"), "n"] == 4 and table.loc[(3, "spam", "accuracy"), "n"] == 3
    assert tuple(table.loc[(1, "spam", "accuracy"), ["low", "high"]]) == (0.25, 0.75)
    assert tuple(table.loc[(2, "spam", "accuracy"), ["low", "high"]]) == (1.0, 1.0)
    assert (table["low"] <= table["value"] + 1e-12).all() and (table["value"] <= table["high"] + 1e-12).all()
    latency = compare.metrics([RUN_A, RUN_B, RUN_C]).query("question_id.isna()").set_index(["run_id", "metric"])
    assert latency.loc[(1, "latency_p50_ms"), "value"] == 25.0 and latency.loc[(1, "latency_mean_ms"), "n"] == 4
    assert tuple(latency.loc[(2, "latency_p50_ms"), ["value", "low", "high"]]) == (100.0, 100.0, 100.0)
    assert latency.loc[(3, "latency_mean_ms"), "n"] == 3  # the failed case has no latency


def test_metrics_match_the_run_page_definitions():
    frame = stats.answer_frame(RUN_A.results, SCHEMA)
    table = compare.metrics([RUN_A, RUN_B], n_boot=10).set_index(["run_id", "question_id", "metric"])
    for question_id in ("spam", "tone"):
        calibration = stats.calibration(frame, question_id)
        assert table.loc[(1, question_id, "ece"), "value"] == pytest.approx(calibration["ece"])
        assert table.loc[(1, question_id, "brier"), "value"] == pytest.approx(calibration["brier"])


def test_case_matrix_browses_cases_by_runs():
    matrix = compare.case_matrix([RUN_A, RUN_B, RUN_C])
    assert list(matrix.index) == CASES and list(matrix[("position", "")]) == [0, 1, 2, 3]
    assert list(matrix.columns[1:]) == [("spam", "expected"), ("spam", A), ("spam", B), ("spam", C),
                                        ("tone", "expected"), ("tone", A), ("tone", B), ("tone", C)]
    assert list(matrix[("spam", "expected")]) == ["true", "false", "false", "true"]
    assert list(matrix[("spam", A)]) == ["true", "false", "true", "false"]
    assert list(matrix[("spam", C)]) == ["true", "false", "true", "error: TokenBudgetError: too long"]
    assert matrix[("tone", C)].isna().all()  # not in C's schema
    confidence = compare.case_matrix([RUN_A, RUN_B], value="confidence")
    assert list(confidence[("spam", A)]) == pytest.approx([0.9, 0.8, 0.6, 0.6])
    correct = compare.case_matrix([RUN_A, RUN_B], value="correct", question_ids=["tone"])
    assert list(correct[("tone", B)]) == [1.0, 1.0, 0.0, 1.0] and "spam" not in correct.columns.get_level_values(0)


def test_case_matrix_disagreements_only():
    assert list(compare.case_matrix([RUN_A, RUN_B, RUN_C], disagreements_only=True).index) == [102, 103, 104]
    assert list(compare.case_matrix([RUN_A, RUN_C], disagreements_only=True).index) == [104]  # answer vs failure
    assert list(compare.case_matrix([RUN_A, RUN_B], value="confidence", question_ids=["tone"],
                                    disagreements_only=True).index) == [102]


def test_runs_must_be_comparable():
    with pytest.raises(ValueError, match="at least two runs"):
        compare.agreement([RUN_A])
    other_set = make_run(9, SCHEMA, [0.5] * 4, [0.5] * 4, [1] * 4, case_set_id=8)
    with pytest.raises(ValueError, match="run 1 → case set 7, run 2 → case set 7, run 9 → case set 8"):
        compare.metrics([RUN_A, RUN_B, other_set])
    with pytest.raises(ValueError, match="listed twice"):
        compare.flips([RUN_A, RUN_A])
    with pytest.raises(ValueError, match="value must be one of"):
        compare.case_matrix([RUN_A, RUN_B], value="probability")


def test_bootstrap_interval_is_seeded_and_empty_safe():
    values = [np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])]
    first = compare.bootstrap_interval(values, compare.mean, seed=3)
    assert first == compare.bootstrap_interval(values, compare.mean, seed=3)
    assert first[0] < 0.625 < first[1]
    assert all(np.isnan(compare.bootstrap_interval([np.array([])], compare.mean)))


def test_load_runs_from_the_store(tmp_path):
    """The same numbers through the store's public API: cases, two runs, their results."""
    store = Store(tmp_path / "w.sqlite3")
    case_set = store.create_case_set("triage cases")
    ids = store.add_cases(case_set, [{"state": f"case {i}", "expected": EXPECTED[i]} for i in range(4)])
    run_ids = []
    for run in (RUN_A, RUN_B):
        run_id = store.create_run(case_set, schema=SCHEMA, model_id=run.run["model_id"])
        store.record_results(run_id, [{"case_id": case_id, "response": r["response"], "latency_ms": r["latency_ms"],
                                       "input_tokens": 10} for case_id, r in zip(ids, run.results, strict=True)])
        run_ids.append(run_id)
    runs = compare.load_runs(store, run_ids)
    table = compare.agreement(runs, n_boot=10)
    assert list(table["agreement"]) == [0.5, 0.75]
    assert table.iloc[0]["flipped_case_ids"] == [ids[2], ids[3]]
    other = store.create_case_set("other")
    store.add_cases(other, [{"state": "x"}])
    with pytest.raises(ValueError, match="different case sets"):
        compare.load_runs(store, [run_ids[0], store.create_run(other, schema=SCHEMA, model_id="m")])
    assert isinstance(compare.case_matrix(runs), pd.DataFrame)


def stored_runs(tmp_path, schema_b: dict = SCHEMA) -> tuple[Store, list[int], list[int]]:
    """RUN_A and RUN_B through the store (B under `schema_b`): the store, the case ids and the run ids."""
    store = Store(tmp_path / "w.sqlite3")
    case_set = store.create_case_set("triage cases")
    ids = store.add_cases(case_set, [{"state": f"case {i}", "expected": EXPECTED[i]} for i in range(4)])
    run_ids = []
    for run, schema in ((RUN_A, SCHEMA), (RUN_B, schema_b)):
        run_id = store.create_run(case_set, schema=schema, model_id=run.run["model_id"])
        store.record_results(run_id, [{"case_id": case_id, "response": r["response"], "latency_ms": r["latency_ms"],
                                       "input_tokens": 10} for case_id, r in zip(ids, run.results, strict=True)])
        run_ids.append(run_id)
    return store, ids, run_ids


def test_the_compare_view_has_every_table_ready_with_links_to_the_cases(tmp_path):
    reworded = {**SCHEMA, "questions": {**SCHEMA["questions"],
                                        "spam": {"type": "noul", "instructions": "Is it spam or junk?"}}}
    store, ids, run_ids = stored_runs(tmp_path, reworded)
    view = compare.build_view(store, run_ids, n_boot=200)
    a, b = (f"#{r} model-{n} · triage v1 (unsaved)" for r, n in zip(run_ids, (1, 2), strict=True))
    assert [r.label for r in view.runs] == [a, b]  # schemas never saved in a library: the label says so

    assert list(view.agreement.columns) == ["question_id", "run_a", "run_b", "n", "agreement", "interval", "flips",
                                            "flipped"]
    spam = view.agreement.iloc[0]
    assert (spam.question_id, spam.n, spam.agreement, spam.flips, spam.flipped) == (
        "spam", 4, 0.5, 2, f"#{ids[2]}, #{ids[3]}")
    assert spam.interval.startswith("[") and spam.interval.endswith("]")
    assert list(view.flips["open"]) == [compare.compare_link(run_ids, c) for c in (ids[2], ids[3], ids[1])]
    assert compare.compare_link(run_ids, ids[2]) == f"/compare?runs={run_ids[0]},{run_ids[1]}&case={ids[2]}"

    metrics = view.metrics.set_index(["question", "metric"])
    assert list(metrics.columns) == [a, b]
    assert metrics.loc[("spam", "accuracy"), b] == "1.000 [1.000, 1.000] n=4"
    assert metrics.loc[("spam", "brier"), a].startswith("0.193 [")  # 0.1925, rounded
    assert metrics.loc[("(all)", "latency_p50_ms"), b] == "100.0 [100.0, 100.0] n=4"

    assert list(view.matrix["case"]) == ids and list(view.matrix["open"]) == [compare.compare_link(run_ids, c)
                                                                             for c in ids]
    # promptfoo's grid: the state's first line per row, "answer (confidence)" under a compact header naming the
    # run (in full on hover), and a pass / fail verdict per cell against the expected answer
    assert list(view.matrix["state"]) == ["case 0", "case 1", "case 2", "case 3"]
    spam_a = f"spam · #{run_ids[0]}"
    assert list(view.matrix[spam_a]) == ["true (0.90)", "false (0.80)", "true (0.60)", "false (0.60)"]
    assert view.headers[spam_a] == a
    assert list(view.matrix["spam · expected"]) == ["true", "false", "false", "true"]
    assert list(view.verdicts[spam_a]) == ["pass", "pass", "fail", "fail"]
    styles = compare.matrix_styles(view.matrix, view.verdicts)
    assert list(styles[spam_a]) == [compare.VERDICT_STYLES[v] for v in ("pass", "pass", "fail", "fail")]
    assert set(styles["spam · expected"]) == {""}
    assert view.schema_changes == [(a, b, '~ question "spam", instructions: Is it [-spam?-]{+spam or junk?+}')]

    only = compare.build_view(store, run_ids, n_boot=10, disagreements_only=True)
    assert list(only.matrix["case"]) == ids[1:]  # case 0: both runs agree on both questions

    detail = compare.case_detail(view, ids[2])
    assert (detail["state"], detail["expected"]) == ("case 2", {"spam": False, "tone": "b"})
    assert [(r["run"], r["answers"]["spam"]["predicted"], r["latency_ms"]) for r in detail["runs"]] == [
        (a, "true", 30.0), (b, "false", 100.0)]
    assert detail["runs"][0]["answers"]["spam"]["probabilities"] == pytest.approx({"true": 0.6, "false": 0.4})
    assert compare.case_detail(view, 999_999) is None


def test_runs_to_pick_and_links():
    runs = [{"id": 5, "case_set_id": 1}, {"id": 4, "case_set_id": 2}, {"id": 3, "case_set_id": 1}]
    assert compare.runs_by_case_set(runs) == {1: [runs[0], runs[2]]}  # a set with one run has nothing to compare
    assert compare.parse_run_ids("3,4, x,,12") == [3, 4, 12]
    assert compare.parse_run_ids(None) == []


def test_model_choices_of_a_manager_with_several_models():
    from types import SimpleNamespace

    from clef_workbench.model_loader import DEMO_SOURCE

    engine, flash = object(), object()
    several = SimpleNamespace(loaded=lambda: [
        SimpleNamespace(name="clef-demo", source=DEMO_SOURCE, label="Demo", engine=engine, is_demo=True),
        SimpleNamespace(name="clef-flash", source="Cloudflare/clef-flash", label="Clef-Flash (9B)", engine=flash,
                        is_demo=False)])
    assert [(c.name, c.engine, c.is_demo) for c in compare.model_choices(several)] == [
        ("clef-demo", engine, True), ("clef-flash", flash, False)]


def test_the_one_action_refuses_a_stopped_endpoint_and_leaves_no_run(tmp_path):
    """Point 12: "run this schema with these models" on a remote model whose server stopped refuses at once, naming
    the model and the reason, and records no run at all (not one pending run per model)."""
    from clef_engine.remote import RemoteEngine
    from clef_workbench.jobs import EngineUnreachableError, JobRunner

    store = Store(tmp_path / "w.sqlite3")
    case_set = store.create_case_set("triage cases")
    store.add_cases(case_set, [{"state": f"case {i}"} for i in range(3)])
    server = serve(RefusingEndpoint)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    remote = RemoteEngine(url, max_retries=0)  # added while its server was up
    server.shutdown()
    server.server_close()

    class LocalEngine:  # a local model has nothing to check; it must not be started when another model is refused
        def info(self):
            raise AssertionError("no run is recorded for any model when one endpoint is down")

    try:
        with pytest.raises(EngineUnreachableError) as refused:
            compare.start_runs(store, JobRunner(store), case_set, SCHEMA,
                               {"remote-jev": remote, "local": LocalEngine()})
    finally:
        remote.close()
    assert str(refused.value).startswith("No run was started: the endpoint of remote-jev did not answer")
    assert f"could not reach {url}" in str(refused.value)
    assert store.list_runs() == []
