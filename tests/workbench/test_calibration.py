"""Calibration on labelled cases: the held-out ECE of an over-confident model goes down, the map keeps the ranking,
and a question with too few labels is refused with the reason."""

import numpy as np
import pytest

from clef_workbench import calibration, stats
from clef_workbench.store import RunSettings

SCHEMA = {"questions": {
    "urgent": {"type": "noul"},
    "team": {"type": "choice", "options": {"billing": {}, "tech": {}, "sales": {}}},
    "rare": {"type": "noul"},
}}


def _overconfident_results(n: int, seed: int = 7) -> list[dict]:
    """Results whose probabilities are sharper than the truth: labels are drawn from the model's own probabilities
    flattened (logits divided by 3)."""
    rng = np.random.default_rng(seed)
    results = []
    for case in range(n):
        z = rng.normal(0, 4)
        p_true = 1 / (1 + np.exp(-z))
        logits = rng.normal(0, 4, size=3)
        sharp = np.exp(logits) / np.exp(logits).sum()
        flat = np.exp(logits / 3) / np.exp(logits / 3).sum()
        options = ["billing", "tech", "sales"]
        expected = {"urgent": bool(rng.random() < 1 / (1 + np.exp(-z / 3))),
                    "team": options[int(rng.choice(3, p=flat))]}
        if case < 10:
            expected["rare"] = bool(rng.random() < 0.5)
        results.append({
            "case_id": case, "position": case, "error": None, "latency_ms": 1.0, "input_tokens": 10,
            "expected": expected,
            "response": {"answers": {
                "urgent": {"type": "noul", "noul": float(p_true)},
                "team": {"type": "choice", "probabilities": dict(zip(options, sharp.tolist(), strict=True))},
                "rare": {"type": "noul", "noul": 0.9},
            }},
        })
    return results


@pytest.fixture(scope="module")
def reports() -> dict[str, calibration.QuestionReport]:
    frame = stats.answer_frame(_overconfident_results(600), SCHEMA)
    return {r.question_id: r for r in calibration.calibrate(frame)}


@pytest.mark.parametrize("question_id", ["urgent", "team"])
def test_held_out_ece_of_an_overconfident_model_goes_down(reports, question_id):
    report = reports[question_id]
    assert report.refused is None and report.n == 600
    assert report.ece_after.value < report.ece_before.value
    # the improvement is not noise: its paired bootstrap interval (the same resampled cases) excludes zero
    assert report.ece_reduction.low > 0
    assert report.brier_after.value < report.brier_before.value


def test_the_fitted_maps_soften_what_was_overconfident(reports):
    assert reports["urgent"].calibration.method == "platt" and 0 < reports["urgent"].calibration.a < 1
    assert reports["team"].calibration.method == "temperature" and reports["team"].calibration.temperature > 1


def test_point_figures_are_the_run_statistics_own(reports):
    frame = stats.answer_frame(_overconfident_results(600), SCHEMA)
    before = stats.calibration(frame, "team")
    assert reports["team"].ece_before.value == pytest.approx(before["ece"], abs=1e-12)
    assert reports["team"].brier_before.value == pytest.approx(before["brier"], abs=1e-12)
    assert int(reports["team"].bins_after["count"].sum()) == 600


def test_too_few_labels_is_refused_with_the_reason(reports):
    rare = reports["rare"]
    assert rare.calibration is None and rare.n == 10
    assert "10 labelled case(s)" in rare.refused and "at least 30" in rare.refused
    table = calibration.summary_table(list(reports.values()))
    assert table.set_index("question").loc["rare", "note"] == rare.refused


def test_a_temperature_keeps_the_ranking_and_sums_to_one():
    team = calibration.QuestionCalibration("team", "choice", "temperature", temperature=2.5)
    raw = {"billing": 0.7, "tech": 0.2, "sales": 0.1}
    out = team.apply(raw)
    assert sorted(out, key=out.get) == sorted(raw, key=raw.get)
    assert sum(out.values()) == pytest.approx(1.0) and out["billing"] < 0.7


def test_stored_payload_round_trips_and_calibrates_a_response(reports):
    payload = calibration.calibration_payload(list(reports.values()))
    maps = calibration.maps_from_payload(payload)
    assert set(maps) == {"urgent", "team"}
    response = {"answers": {"urgent": {"type": "noul", "noul": 0.99},
                            "team": {"type": "choice", "probabilities": {"billing": 0.9, "tech": 0.05,
                                                                          "sales": 0.05}}}}
    calibrated = calibration.calibrated_answers(maps, response)
    assert calibrated["urgent"]["noul"] < 0.99 and calibrated["team"]["probabilities"]["billing"] < 0.9


@pytest.mark.slow
def test_calibrate_from_the_command_line_on_a_real_run(tmp_path, tiny_engine):
    """import labelled cases → run on the tiny release → `python -m clef_workbench calibrate` prints the before/after
    table and keeps the calibration with the run's schema and model; the over-confident question's held-out ECE
    goes down."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from clef_workbench.jobs import JobRunner
    from clef_workbench.store import Store

    root = Path(__file__).resolve().parents[2]
    schema = json.loads((root / "schemas" / "support-ticket-routing.json").read_text())
    schema.pop("examples", None)
    rng = np.random.default_rng(3)
    teams, levels = list(schema["questions"]["team"]["criteria"]), len(schema["questions"]["priority"]["criteria"])
    # the tiny model puts ~0.85 on one priority level for every ticket; these labels are uniform: over-confident
    cases = [{"state": f"Ticket {i}: order {1000 + 37 * i} arrived damaged, invoice {i} charged twice",
              "expected": {"team": teams[int(rng.integers(len(teams)))], "priority": int(rng.integers(levels))}}
             for i in range(60)]
    db = tmp_path / "w.db"
    store = Store(db)
    set_id = store.create_case_set("labelled")
    store.add_cases(set_id, cases)
    run_id = store.create_run(set_id, schema=schema, model_id="tiny", settings=RunSettings(chunk_size=16))
    runner = JobRunner(store)
    runner.start(run_id, tiny_engine)
    assert runner.wait(run_id, timeout=600)

    done = subprocess.run([sys.executable, "-m", "clef_workbench", "calibrate", "--db", str(db), "--run",
                           str(run_id)], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ECE before" in done.stdout and "priority" in done.stdout and "saved" in done.stdout
    [stored] = store.list_calibrations(schema_name=schema["name"], model_id="tiny")
    assert stored["run_id"] == run_id
    priority = next(r for r in stored["payload"]["report"] if r["question_id"] == "priority")
    assert priority["n"] == 60 and priority["ece_after"]["value"] < priority["ece_before"]["value"]
    assert stored["payload"]["questions"]["priority"]["temperature"] > 1

    # a second calibration of a run without labels is refused with the reason, exit 2 (wrong input, as sweep's)
    bare = store.create_case_set("bare")
    store.add_cases(bare, [{"state": "no labels here"}])
    bare_run = store.create_run(bare, schema=schema, model_id="tiny")
    runner.start(bare_run, tiny_engine)
    assert runner.wait(bare_run, timeout=300)
    refused = subprocess.run([sys.executable, "-m", "clef_workbench", "calibrate", "--db", str(db), "--run",
                              str(bare_run)], cwd=root, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "calibrating needs at least 30" in refused.stderr
    for numbers in (["--folds", "1"], ["--folds", "0"], ["--min-labelled", "-3"], ["--run", "99"]):
        wrong = subprocess.run([sys.executable, "-m", "clef_workbench", "calibrate", "--db", str(db), "--run",
                                str(bare_run), *numbers], cwd=root, capture_output=True, text=True, timeout=300)
        assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, (numbers, wrong.stderr[-2000:])
        assert numbers[0] in wrong.stderr


def _store_with_two_runs(tmp_path):
    """A store with one case set and two finished runs of it whose answers are given (no engine needed)."""
    from clef_workbench.store import Store

    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    case_ids = store.add_cases(set_id, [{"state": f"ticket {i}"} for i in range(4)])
    runs = []
    for model, p_true in (("model-a", [0.9, 0.8, 0.3, 0.6]), ("model-b", [0.85, 0.2, 0.35, 0.7])):
        run_id = store.create_run(set_id, schema={"name": "t", "questions": {"urgent": {"type": "noul"}}},
                                  model_id=model)
        store.record_results(run_id, [{"case_id": c, "response": {"answers": {"urgent": {"type": "noul",
                                                                                          "noul": p}}},
                                       "error": None, "latency_ms": 1.0, "input_tokens": 3,
                                       "started_at": "2026-12-02T00:00:00+00:00",
                                       "finished_at": "2026-12-02T00:00:01+00:00"}
                                      for c, p in zip(case_ids, p_true, strict=True)])
        runs.append(run_id)
    return store, case_ids, runs


def test_review_routes_cases_two_models_disagree_on(tmp_path):
    from clef_workbench import review

    store, case_ids, (run_a, run_b) = _store_with_two_runs(tmp_path)
    rules = review.ReviewRules(margin_below=None, disagree_with_run=run_b)
    items = review.candidates(store, run_a, rules)
    assert [(i["case_id"], i["reason"]) for i in items] == [(case_ids[1], f"run {run_b} answered 'false'")]
    assert review.preview(store, run_a, rules)["by_rule"]["disagrees with another run"] == 1


def test_review_thresholds_read_calibrated_confidence_when_a_calibration_is_named(tmp_path):
    from clef_workbench import review

    store, case_ids, (run_a, _) = _store_with_two_runs(tmp_path)
    softer = calibration.QuestionCalibration("urgent", "noul", "platt", a=0.3, b=0.0)
    store.save_calibration("softer", store.get_run(run_a),
                           {"questions": {"urgent": calibration.asdict(softer)}, "report": []})
    raw = review.candidates(store, run_a, review.ReviewRules(margin_below=None, confidence_below=0.75))
    calibrated = review.candidates(store, run_a, review.ReviewRules(margin_below=None, confidence_below=0.75,
                                                                    calibration="softer"))
    assert {i["case_id"] for i in raw} == {case_ids[2], case_ids[3]}  # 0.7 and 0.6 are under 0.75
    # Platt with a = 0.3 pulls every answer towards 0.5: all four fall under 0.75, and the item keeps that figure
    assert {i["case_id"] for i in calibrated} == set(case_ids)
    first = next(i for i in calibrated if i["case_id"] == case_ids[0])
    assert first["reason"].startswith("calibrated confidence") and first["confidence"] < 0.75


def test_a_calibrated_response_keeps_the_contracts_shape_and_labels_only_what_it_changed(tmp_path):
    store, _, (run_a, _) = _store_with_two_runs(tmp_path)
    softer = calibration.QuestionCalibration("urgent", "noul", "platt", a=0.5, b=0.0)
    team = calibration.QuestionCalibration("team", "choice", "temperature", temperature=3.0)
    store.save_calibration("soft", store.get_run(run_a), {"questions": {"urgent": calibration.asdict(softer),
                                                                        "team": calibration.asdict(team)},
                                                          "report": []})
    response = {"answers": {
        "urgent": {"type": "noul", "noul": 0.9},
        "team": {"type": "choice", "choice": "billing", "confidence": 0.8,
                 "probabilities": {"billing": 0.8, "tech": 0.15, "sales": 0.05}},
        "mood": {"type": "choice", "choice": "calm", "confidence": 0.6, "probabilities": {"calm": 0.6, "angry": 0.4}},
    }}
    stored, answers = calibration.calibrated_response(store, "soft", response)
    assert stored["name"] == "soft" and answers["mood"] == response["answers"]["mood"]  # no map: as it was
    assert 0.5 < answers["urgent"]["noul"] < 0.9
    assert answers["team"]["choice"] == "billing" and answers["team"]["confidence"] < 0.8
    assert answers["team"]["confidence"] == answers["team"]["probabilities"]["billing"]
    assert sum(answers["team"]["probabilities"].values()) == pytest.approx(1.0, abs=2e-4)


def test_the_held_out_folds_are_scikit_learns_kfold_folds():
    """`k_folds` replaced scikit-learn's KFold(shuffle=True) without changing a stored report: these are the folds
    KFold(3, shuffle=True, random_state=0) made for 7 cases; and every case is held out exactly once."""
    folds = [(list(train), list(test)) for train, test in calibration.k_folds(7, 3, 0)]
    assert folds == [([0, 3, 4, 5], [1, 2, 6]), ([1, 2, 4, 5, 6], [0, 3]), ([0, 1, 2, 3, 6], [4, 5])]
    for count, k, seed in [(10, 5, 1), (31, 5, 42), (5, 5, 3)]:
        held_out = sorted(i for _, test in calibration.k_folds(count, k, seed) for i in test)
        assert held_out == list(range(count))
        assert all(sorted([*train, *test]) == list(range(count)) for train, test in calibration.k_folds(count, k, seed))


def _results(n: int, sharpness: float, seed: int) -> list[dict]:
    """Choice answers for `team` whose labels are drawn from the model's logits divided by `sharpness`: 1 makes the
    model exactly calibrated; a large one makes the labels (almost) uniform, whatever the model says."""
    rng = np.random.default_rng(seed)
    options = ["billing", "tech", "sales"]
    results = []
    for case in range(n):
        logits = rng.normal(0, 4, size=3)
        sharp = np.exp(logits) / np.exp(logits).sum()
        truth = np.exp(logits / sharpness) / np.exp(logits / sharpness).sum()
        results.append({"case_id": case, "position": case, "error": None, "latency_ms": 1.0, "input_tokens": 10,
                        "expected": {"team": options[int(rng.choice(3, p=truth))]},
                        "response": {"answers": {"team": {"type": "choice", "probabilities": dict(
                            zip(options, sharp.tolist(), strict=True))}}}})
    return results


def _team_report(results: list[dict]) -> calibration.QuestionReport:
    [report] = calibration.calibrate(stats.answer_frame(results, {"questions": {"team": SCHEMA["questions"]["team"]}}))
    return report


def test_a_calibration_that_helps_is_applied_and_says_by_how_much(reports):
    helped = calibration.verdict(reports["team"].calibration, reports["team"].ece_reduction)
    assert helped.applied and helped.reason.startswith("applied: held-out ECE reduction +")
    assert calibration.summary_table([reports["team"]]).loc[0, "note"] == helped.reason


def test_a_calibration_whose_held_out_interval_reaches_zero_is_not_applied_and_says_why():
    report = _team_report(_results(60, sharpness=1.0, seed=5))  # the model is already calibrated
    assert report.ece_reduction.low <= 0 < report.ece_reduction.high
    judged = calibration.verdict(report.calibration, report.ece_reduction)
    assert not judged.applied
    interval = f"[{report.ece_reduction.low:+.3f}, {report.ece_reduction.high:+.3f}]"
    assert "may not help" in judged.reason and interval in judged.reason
    assert calibration.summary_table([report]).loc[0, "note"] == judged.reason  # the note column says it


def test_a_temperature_at_its_bound_is_not_applied_and_the_stored_calibration_leaves_raw_answers(tmp_path):
    report = _team_report(_results(90, sharpness=1000.0, seed=2))  # labels uniform: the fit flattens to 1/k
    assert report.calibration.temperature == pytest.approx(np.exp(calibration.LOG_TEMPERATURE_BOUND), rel=1e-2)
    payload = calibration.calibration_payload([report])
    judged = calibration.verdicts(payload)["team"]
    assert not judged.applied and "20.09 is the largest the fit tries" in judged.reason and "1/k" in judged.reason
    assert calibration.applied_maps(payload) == {}
    assert set(calibration.applied_maps(payload, every_question=True)) == {"team"}

    store, _, (run_a, _) = _store_with_two_runs(tmp_path)
    store.save_calibration("flat", store.get_run(run_a), payload)
    response = {"answers": {"team": {"type": "choice", "choice": "billing", "confidence": 0.8,
                                     "probabilities": {"billing": 0.8, "tech": 0.15, "sales": 0.05}}}}
    _, shown = calibration.calibrated_response(store, "flat", response)
    assert shown == response["answers"]  # not applied unless asked for
    _, forced = calibration.calibrated_response(store, "flat", response, every_question=True)
    assert forced["team"]["confidence"] < 0.4  # asked for: about 1/3


def test_review_thresholds_stay_on_raw_numbers_for_a_map_that_does_not_help(tmp_path):
    from clef_workbench import review

    store, case_ids, (run_a, _) = _store_with_two_runs(tmp_path)
    softer = calibration.QuestionCalibration("urgent", "noul", "platt", a=0.3, b=0.0)
    store.save_calibration("unhelpful", store.get_run(run_a), {
        "questions": {"urgent": calibration.asdict(softer)},
        "report": [{"question_id": "urgent", "ece_reduction": {"value": -0.01, "low": -0.1, "high": 0.05}}]})
    rules = review.ReviewRules(margin_below=None, confidence_below=0.75, calibration="unhelpful")
    items = review.candidates(store, run_a, rules)
    # as raw: 0.7 and 0.6 are under 0.75, and the reason does not claim a calibration that was not applied
    assert {i["case_id"] for i in items} == {case_ids[2], case_ids[3]}
    assert all(i["reason"].startswith("confidence") for i in items)
