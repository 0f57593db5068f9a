"""Schema sweeps (issue 39): variants, case-major execution on the tiny release, the store, the scores, the CLI."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

from clef_workbench import review, sweeps
from clef_workbench.__main__ import main
from clef_workbench.casesets import build_request
from clef_workbench.store import Store, StoreError
from tests.support import REPO, wait_for

CASES = 12  # of the killed sweep
WAIT_S = 30  # only a bound on a hang
TEAMS = ["billing", "tech", "sales"]
SCHEMA = {"name": "tickets", "version": 1, "description": "", "questions": {
    "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
             "criteria": {"billing": "Invoices and payments.", "tech": "Bugs and outages.", "sales": "New purchases."}},
    "urgent": {"type": "noul", "instructions": "Is the ticket urgent?", "criteria": None}}}


def labelled_set(store: Store, count: int, *, name: str = "tickets", unlabelled: int = 0) -> int:
    case_set_id = store.create_case_set(name)
    store.add_cases(case_set_id, [
        {"state": {"subject": f"ticket {i}", "body": "words " * (i % 7) + f"about {TEAMS[i % 3]}"},
         "expected": {"team": TEAMS[(i * 7) % 3], "urgent": i % 2 == 0}} for i in range(count)]
        + [{"state": f"unlabelled {i}"} for i in range(unlabelled)])
    return case_set_id


# ---- variants -------------------------------------------------------------------------------------------------------


def test_auto_variants_change_one_question_each_and_order_variants_number_the_ids():
    variants = {v.name: v for v in sweeps.auto_variants(SCHEMA)}
    assert list(variants) == ["no_descriptions:team", "no_instructions:team", "relabelled:team", "reversed:team",
                              "shuffled:team", "unknown_added:team", "no_instructions:urgent"]
    for variant in variants.values():
        assert sweeps.changed_questions(variant.schema, SCHEMA) == [variant.question]
    assert variants["no_descriptions:team"].schema["questions"]["team"]["criteria"] == dict.fromkeys(TEAMS)
    assert variants["unknown_added:team"].schema["questions"]["team"]["criteria"]["unknown"]
    # the model reads options sorted by id: the numbers set the order it reads them in; the relabel maps back
    orders = {kind: [variants[f"{kind}:team"].relabel["team"][k]
                     for k in sorted(variants[f"{kind}:team"].schema["questions"]["team"]["criteria"])]
              for kind in ("relabelled", "reversed", "shuffled")}
    assert orders["relabelled"] == sorted(TEAMS) and orders["reversed"] == sorted(TEAMS)[::-1]
    assert sorted(orders["shuffled"]) == sorted(TEAMS)
    assert orders["shuffled"] not in (orders["relabelled"], orders["reversed"])
    assert sweeps.auto_variants(SCHEMA, seed=0) == sweeps.auto_variants(SCHEMA, seed=0)  # seeded
    with_way_out = copy.deepcopy(SCHEMA)
    with_way_out["questions"]["team"]["criteria"]["none_of_these"] = "Nothing fits."
    removed = sweeps.auto_variants(with_way_out, ["unknown_removed", "unknown_added"])
    assert [v.name for v in removed] == ["unknown_removed:team"]
    assert list(removed[0].schema["questions"]["team"]["criteria"]) == TEAMS


def test_variants_from_a_file_name_every_problem_by_entry_and_field():
    good = sweeps.variants_from_json(json.dumps([{"name": "terse", "questions": {
        "urgent": {"type": "noul", "instructions": "Urgent?", "criteria": None}}}]), SCHEMA)
    assert [(v.name, v.kind, v.question) for v in good] == [("terse", "custom", "urgent")]
    assert good[0].schema["questions"]["team"] == SCHEMA["questions"]["team"]
    with pytest.raises(sweeps.SweepError) as caught:
        sweeps.variants_from_json(json.dumps([
            {"name": "x", "questions": {"nope": {"type": "noul", "instructions": "?"}}},
            {"name": "y", "questions": {"team": {"type": "noul", "instructions": "?"}}},
            {"questions": {}}]), SCHEMA, source="v.json")
    message = str(caught.value)
    assert "v.json: entry 1 ('x'), field \"questions\": 'nope' not in the base schema" in message
    assert "entry 2 ('y')" in message and "changes the question type" in message
    assert 'entry 3: must be an object with a non-empty "name"' in message
    with pytest.raises(sweeps.SweepError, match="line 1, column"):
        sweeps.variants_from_json("[{", SCHEMA)


def test_a_sweep_refuses_what_it_cannot_score_and_stores_nothing(tmp_path):
    store = Store(tmp_path / "w.db")
    labelled = labelled_set(store, 4)
    unlabelled = store.create_case_set("unlabelled")
    store.add_cases(unlabelled, [{"state": "no answer"}])
    too_many = [sweeps.Variant(f"v{i}", SCHEMA, "custom") for i in range(sweeps.MAX_VARIANTS)]
    for case_set_id, variants, folds, message in [
            (unlabelled, [], 5, "case set 'unlabelled' has no case with an expected answer"),
            (labelled, too_many, 5, f"{sweeps.MAX_VARIANTS + 1} variants .* at most {sweeps.MAX_VARIANTS}"),
            (labelled, [sweeps.Variant("a", SCHEMA, "custom")] * 2, 5, "'a' appear more than once"),
            (labelled, [], 1, "folds must be at least 2")]:
        with pytest.raises(sweeps.SweepError, match=message):
            sweeps.start_sweep(store, case_set_id, SCHEMA, variants, model_id="m", folds=folds)
    assert store.list_sweeps() == []


# ---- scoring, on answers written to the store -----------------------------------------------------------------------


def response(team: str, p_team: float, urgent: float) -> dict:
    others = [t for t in TEAMS if t != team]
    probabilities = {team: p_team, others[0]: (1 - p_team) / 2, others[1]: (1 - p_team) / 2}
    return {"answers": {"team": {"type": "choice", "choice": team, "confidence": p_team,
                                 "probabilities": probabilities},
                        "urgent": {"type": "noul", "noul": urgent}}}


def test_scores_flips_mcnemar_order_sensitivity_and_the_held_out_best(tmp_path, tiny_engine):
    """A base right on half the cases, a variant right on all but two, and a reversed order variant that answers
    the relabelled control's ids differently on 3 of 20 cases: the numbers follow from these counts. The composed
    best is scored only once it has run on the held-out cases (here on the tiny release)."""
    store = Store(tmp_path / "w.db")
    case_set_id = labelled_set(store, 20)
    cases = store.list_cases(case_set_id)
    variants = [v for v in sweeps.auto_variants(SCHEMA, ["reversed", "no_instructions"]) if v.question == "team"]
    sweep_id = sweeps.start_sweep(store, case_set_id, SCHEMA, variants, model_id="m", folds=4)
    names = [v["name"] for v in store.get_sweep(sweep_id)["variants"]]
    assert names == ["base", "no_instructions:team", "relabelled:team", "reversed:team"]
    relabel = {v.kind: {base: new for new, base in v.relabel.get("team", {}).items()} for v in variants}
    reversed_team = {}  # case id: the reversed variant's team, in the base's ids
    for i, case in enumerate(cases):
        gold = case["expected"]["team"]
        wrong = TEAMS[(TEAMS.index(gold) + 1) % 3]
        base = response(gold if i % 2 else wrong, 0.9, 0.2)
        better = response(gold if i >= 2 else wrong, 0.8, 0.2)
        control_team = gold if i % 2 else wrong
        flipped = wrong if i < 3 and i % 2 else (gold if i < 3 else control_team)
        reversed_team[case["id"]] = flipped
        answers = [base, better]
        for kind, team in (("relabelled", control_team), ("reversed", flipped)):
            answer = response(team, 0.9, 0.2)
            answer["answers"]["team"]["choice"] = relabel[kind][team]
            answer["answers"]["team"]["probabilities"] = {relabel[kind][k]: p for k, p in
                                                          answer["answers"]["team"]["probabilities"].items()}
            answers.append(answer)
        store.record_sweep_case(sweep_id, case["id"], [(v, r, None) for v, r in enumerate(answers)],
                                state_prefills=1, compute_ms=1.0)
    with pytest.raises(StoreError, match="not one of its cases left"):  # a case is never written twice
        store.record_sweep_case(sweep_id, cases[0]["id"], [], state_prefills=1, compute_ms=1.0)

    result = sweeps.load_sweep(store, sweep_id, threshold=0.1)
    scores = {s.variant.name: s for s in result.variants}
    base, better = scores["base"].questions["team"], scores["no_instructions:team"].questions["team"]
    assert (base.accuracy.value, better.accuracy.value) == (0.5, 0.9)
    assert base.accuracy.low <= 0.5 <= base.accuracy.high
    # discordant pairs: fixed where the base was wrong (even i ≥ 2: 9 cases), broken where it was right (i = 1)
    assert better.mcnemar_p == pytest.approx(binomtest(9, 10, 0.5).pvalue)
    assert better.accuracy_change.value == pytest.approx(0.4) and better.better and not base.better
    assert better.flips == [c["id"] for i, c in enumerate(cases) if (i % 2 == 1) != (i >= 2)]
    assert better.log_loss.value == pytest.approx(-(18 * np.log(0.8) + 2 * np.log(0.1)) / 20)
    assert better.macro_f1.value is not None and 0 < better.macro_f1.value <= 1
    assert scores["reversed:team"].order_sensitivity == pytest.approx(3 / 20)
    assert result.order_sensitivity == {"team": pytest.approx(0.15)} and result.flagged == ["team"]
    assert result.state_prefills == 20 and result.done == result.cases == 20
    # never an order diagnostic: the better wording wins; held out, nothing is known until the composed schemas run
    assert result.best is not None and result.best.choices == {"team": "no_instructions:team", "urgent": "base"}
    assert result.best.schema["questions"]["team"]["instructions"] == ""
    assert (result.best.heldout_accuracy.value, result.best.cases) == (None, 0)

    # every case is done: running the sweep runs only the held-out check, per fold the schema composed on the
    # other folds (the better wording wins on each) answering that fold's 5 cases, each state prefilled once
    progress = sweeps.run_sweep(store, sweep_id, tiny_engine)
    assert (progress.status, progress.computed, progress.state_prefills) == ("finished", 0, 20)
    sweep = store.get_sweep(sweep_id)
    composed = sweep["variants"][len(names):]
    assert [v["name"] for v in composed] == [f"composed:fold{f}" for f in range(1, 5)]
    assert all(v["schema"]["questions"] == result.best.schema["questions"] for v in composed)
    heldout = [a for a in store.list_sweep_answers(sweep_id) if a["variant"] >= len(names)]
    assert sorted(a["case_id"] for a in heldout) == sorted(c["id"] for c in cases)
    assert sorted(Counter(a["variant"] for a in heldout).values()) == [5] * 4
    scored = sweeps.load_sweep(store, sweep_id).best
    assert (scored.cases, scored.state_prefills, scored.folds) == (20, 20, 4)

    def right(answer: dict) -> int:
        given, gold = answer["response"]["answers"], answer["expected"]
        return (given["team"]["choice"] == gold["team"]) + ((given["urgent"]["noul"] >= 0.5) == gold["urgent"])

    assert scored.heldout_accuracy.value == pytest.approx(sum(map(right, heldout)) / 40)
    assert scored.base_heldout_accuracy.value == pytest.approx(0.5)  # its team and urgent answers right on odd i
    document = json.loads(json.dumps(result.to_json()))
    entry = next(v for v in document["variants"] if v["name"] == "no_instructions:team")
    assert {"name", "accuracy", "accuracy_ci", "flips_vs_base", "order_sensitivity"} <= set(entry)
    assert {"schema", "heldout_accuracy", "heldout_ci"} <= set(document["best"])
    # a variant's answers open in Review as a run's: made once, in the base's option ids, each case's answer queued
    # when a link asks for it
    review_run = sweeps.variant_run(store, sweep_id, "reversed:team")
    assert sweeps.variant_run(store, sweep_id, "reversed:team") == review_run and len(store.list_runs()) == 1
    run = store.get_run(review_run)
    assert run["schema"]["name"] == f"tickets · sweep #{sweep_id} · reversed:team" and run["status"] == "finished"
    assert list(run["schema"]["questions"]["team"]["criteria"]) == sorted(TEAMS)[::-1]  # the order it was asked in
    assert {r["case_id"]: r["response"]["answers"]["team"]["choice"]
            for r in store.list_results(review_run)} == reversed_team
    flipped = scores["reversed:team"].questions["team"].flips[0]
    item = review.item_for_link(store, review_run, flipped, "team")
    assert item is not None and (item["case_id"], item["question_id"]) == (flipped, "team")
    with pytest.raises(sweeps.SweepError, match="has no variant 'nope'"):
        sweeps.variant_run(store, sweep_id, "nope")
    assert sweeps.list_sweeps(store)[0] | {"created_at": None} == {
        "id": sweep_id, "case_set_id": case_set_id, "case_set_name": "tickets", "schema_name": "tickets",
        "model_id": "m", "status": "finished", "error": None, "done": 20, "total": 20, "state_prefills": 20,
        "created_at": None, "variants": 4}


# ---- on the tiny release --------------------------------------------------------------------------------------------


def test_a_sweep_of_8_variants_over_40_cases_prefills_40_states_and_answers_as_each_variant_alone(
        tiny_engine, tmp_path, monkeypatch):
    store = Store(tmp_path / "w.db")
    case_set_id = labelled_set(store, 40)  # eight cases in each of the 5 folds
    variants = sweeps.auto_variants(SCHEMA)
    sweep_id = sweeps.start_sweep(store, case_set_id, SCHEMA, variants, model_id="tiny")
    assert store.get_sweep(sweep_id)["variant_count"] == 8
    tiny_engine.runner.state_cache.clear()
    before = tiny_engine.runner.state_prefills
    seen: list[sweeps.SweepProgress] = []
    calls: list[int] = []
    decide_variants = tiny_engine.decide_variants
    monkeypatch.setattr(tiny_engine, "decide_variants", lambda requests, **options: calls.append(len(requests))
                        or decide_variants(requests, **options))
    progress = sweeps.run_sweep(store, sweep_id, tiny_engine, progress=seen.append)
    assert tiny_engine.runner.state_prefills - before == 40 == progress.state_prefills  # not 8 × 40 = 320
    # a case's variants in one call each; the held-out check's one request per case, 32 cases to a call (on the
    # H200 one call per case took ~90 ms each: 18 s of a 200-case sweep)
    assert calls == [8] * 40 + [32, 8]
    assert progress.status == "finished" and [p.done for p in seen[:-1]] == list(range(1, 41))
    assert seen[-1].eta_s == 0 and store.get_sweep(sweep_id)["state_prefills"] == 40

    # per case, its 8 variants and the held-out check's schema composed for its fold (from the state cache: the 40
    # above are all the sweep prefilled), each decided on its own: 360 records, 360 states
    sweep = store.get_sweep(sweep_id)
    stored = store.list_sweep_answers(sweep_id)
    assert len(stored) == 360 and len(sweep["variants"]) == 8 + sweeps.DEFAULT_FOLDS
    assert set(Counter(a["case_id"] for a in stored).values()) == {9}
    requests = [build_request(store.get_case(a["case_id"]), sweep["variants"][a["variant"]]["schema"]) for a in stored]
    before = tiny_engine.runner.state_prefills
    alone = tiny_engine.probabilities(requests)
    assert tiny_engine.runner.state_prefills - before == 360
    for answer, request, probabilities in zip(stored, requests, alone, strict=True):
        questions = tiny_engine.validate(request).questions
        for question, p in zip(questions, probabilities, strict=True):
            given = answer["response"]["answers"][question.id]
            if question.type == "noul":
                assert given["noul"] == pytest.approx(p[0], abs=5e-5 + 1e-5)
            else:  # rounded to 4 decimals as every response is: within half a last digit plus float noise
                assert given["choice"] == question.option_ids[int(np.argmax(p))]
                for option, value in zip(question.option_ids, p, strict=True):
                    assert given["probabilities"][option] == pytest.approx(value, abs=5e-5 + 1e-5)


def test_a_sweep_encodes_the_next_case_while_the_engine_runs_one(tiny_engine, tmp_path, monkeypatch):
    """One case after the other, the GPU waited on the host (validating and encoding the next case's variants) between
    every two cases: the next case is submitted while one runs."""
    store = Store(tmp_path / "w.db")
    sweep_id = sweeps.start_sweep(store, labelled_set(store, 6), SCHEMA, sweeps.auto_variants(SCHEMA)[:2],
                                  model_id="tiny")
    decide_variants = tiny_engine.decide_variants
    second_case = threading.Event()
    calls: list[int] = []
    overlapped: list[bool] = []

    def held(requests, **options):
        calls.append(len(requests))
        if len(calls) == 1:  # the first case waits for the second case's call to come in
            overlapped.append(second_case.wait(WAIT_S))
        else:
            second_case.set()
        return decide_variants(requests, **options)

    monkeypatch.setattr(tiny_engine, "decide_variants", held)
    assert sweeps.run_sweep(store, sweep_id, tiny_engine).status == "finished"
    assert overlapped[0] and len(store.list_sweep_answers(sweep_id)) == 6 * 3 + 6  # the held-out check's too


def test_cases_decided_together_keep_their_own_errors(tiny_engine):
    """A held-out check decides many cases in one call; one case over the token budget fails the whole call, and
    then each case is decided alone: the others are answered, the one says why it was not."""
    cases = [(case_id, [build_request({"state": state, "expected": None}, SCHEMA)])
             for case_id, state in ((1, "a refund, please"), (2, "too long " * 300), (3, "the app crashes"))]
    outcomes = dict(sweeps._decide_together(tiny_engine, cases, {"max_length": 400}))
    assert outcomes[1][0][0][0]["answers"] and outcomes[3][0][0][0]["answers"]
    [(response, error)], prefills = outcomes[2]
    assert response is None and prefills == 0 and "400" in error


def test_decide_variants_equals_each_request_alone_and_reuses_a_kept_state(tiny_engine):
    """Unrounded, float32: the state continued for every schema answers as the whole record does. A second call
    on the same state takes it from the state cache: no prefill (a re-run after an edit)."""
    state = {"subject": "refund", "body": "I was charged twice for my subscription " * 12}
    schemas = [v.schema for v in sweeps.auto_variants(SCHEMA)]
    requests = [{"state": state, "questions": s["questions"]} for s in schemas]
    tiny_engine.runner.state_cache.clear()
    before = tiny_engine.runner.state_prefills
    shared = tiny_engine.decide_variants(requests, probabilities=True)
    assert tiny_engine.runner.state_prefills - before == 1
    alone = [tiny_engine.probabilities([r])[0] for r in requests]
    assert tiny_engine.runner.state_prefills - before == 1 + len(requests)
    for ours, theirs in zip(shared, alone, strict=True):
        for p, q in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(p, q, atol=1e-5, rtol=0)
    before = tiny_engine.runner.state_prefills
    again = tiny_engine.decide_variants(requests[:2])
    assert tiny_engine.runner.state_prefills == before
    for ours, request in zip(again, requests[:2], strict=True):
        theirs = tiny_engine.decide(request)["answers"]
        assert ours["answers"]["team"]["choice"] == theirs["team"]["choice"]
        assert ours["answers"]["urgent"]["noul"] == pytest.approx(theirs["urgent"]["noul"], abs=1e-4)


# ---- the command line -----------------------------------------------------------------------------------------------


def sweep_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "clef_workbench", "sweep", *args], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def sweep_db(tmp_path):
    db = tmp_path / "w.db"
    store = Store(db)
    labelled_set(store, 6, unlabelled=2)
    store.add_cases(store.create_case_set("unlabelled"), [{"state": "no answer"}])
    (tmp_path / "tickets.json").write_text(json.dumps(SCHEMA))
    return db


@pytest.mark.parametrize("change, message", [
    ({"--case-set": "nope"}, "--case-set: no case set named 'nope' in"),
    ({"--schema": "nope"}, "--schema: 'nope' is neither a schema of the library"),
    ({"--case-set": "unlabelled"}, "case set 'unlabelled' has no case with an expected answer"),
    ({"--variants": "VARIANTS"}, "variants.json: entry 1 ('x'), field \"questions\": 'nope' not in the base schema"),
    ({"--variants": "MISSING"}, "--variants: cannot read"),
    ({"--folds": "1"}, "folds must be at least 2"),
])
def test_sweep_cli_refuses_bad_input_naming_it_and_stores_nothing(sweep_db, capsys, change, message):
    folder = sweep_db.parent
    (folder / "variants.json").write_text(json.dumps([{"name": "x", "questions": {"nope": {}}}]))
    args = {"--db": str(sweep_db), "--case-set": "tickets", "--schema": str(folder / "tickets.json"),
            "--model": "unused"} | change
    args = {k: {"VARIANTS": str(folder / "variants.json"), "MISSING": str(folder / "missing.json")}.get(v, v)
            for k, v in args.items()}
    cases_before = [len(Store(sweep_db).list_cases(s["id"])) for s in Store(sweep_db).list_case_sets()]
    assert main(["sweep", *[x for pair in args.items() for x in pair]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m clef_workbench sweep: error: ") and message in err, err
    store = Store(sweep_db)
    assert store.list_sweeps() == []
    assert [len(store.list_cases(s["id"])) for s in store.list_case_sets()] == cases_before


@pytest.mark.slow  # three command-line processes, each loading the model
def test_sweep_cli_prints_the_leaderboard_writes_the_json_and_fails_on_order_sensitivity(sweep_db, tiny_release):
    """The command as CI runs it: its own process, its exit code, the JSON document it writes."""
    out_file = sweep_db.parent / "out.json"
    variants = sweep_db.parent / "variants.json"
    variants.write_text(json.dumps([{"name": "terse", "questions": {
        "urgent": {"type": "noul", "instructions": "Urgent?", "criteria": None}}}]))
    args = ["--db", str(sweep_db), "--case-set", "tickets", "--schema", str(sweep_db.parent / "tickets.json"),
            "--model", str(tiny_release), "--device", "cpu", "--dtype", "float32", "--folds", "3",
            "--json", str(out_file)]
    out, err = sweep_cli(*args, "--variants", str(variants)).communicate(timeout=600)
    assert "terse" in out and "6 cases, 6 states prefilled" in out, err[-3000:]
    document = json.loads(out_file.read_text())
    assert (document["status"], document["cases"], document["state_prefills"]) == ("finished", 6, 6)
    assert [v["name"] for v in document["variants"]] == ["base", "terse"]
    for variant in document["variants"]:
        low, high = variant["accuracy_ci"]
        assert low <= variant["accuracy"] <= high and isinstance(variant["flips_vs_base"], list)
        assert variant["order_sensitivity"] is None  # no order-only variant
    best = document["best"]
    low, high = best["heldout_ci"]
    assert low <= best["heldout_accuracy"] <= high and best["heldout_cases"] == 6  # each case of its fold, run
    assert best["schema"]["questions"].keys() == SCHEMA["questions"].keys()
    assert document["command"].startswith("python -m clef_workbench sweep --db ")

    # any share exceeds -1: the automatic order variants of "team" give it a sensitivity, so the flag trips
    order = sweep_cli(*args, "--fail-if-order-sensitive", "-1")
    _, err = order.communicate(timeout=600)
    assert order.returncode == 3 and "order sensitive above -1.0: team (" in err, err[-3000:]
    document = json.loads(out_file.read_text())
    assert document["order_sensitive"] == ["team"]
    shares = [v["order_sensitivity"] for v in document["variants"] if v["kind"] in sweeps.ORDER_KINDS]
    assert shares and all(0 <= share <= 1 for share in shares)
    assert document["order_sensitivity"]["team"] == max(shares)
    # above every share: exit 0
    calm = sweep_cli(*args, "--fail-if-order-sensitive", "1", "--resume")
    _, err = calm.communicate(timeout=600)
    assert calm.returncode == 0, err[-3000:]


def finished_cases(db: Path, sweep_id: int) -> set[int]:
    store = Store(db)
    done = {case_id for case_id in (c["id"] for c in store.list_cases(store.get_sweep(sweep_id)["case_set_id"]))}
    return done - set(store.sweep_cases_left(sweep_id))


@pytest.mark.kill
def test_a_sweep_killed_mid_way_resumes_without_computing_a_case_twice_or_losing_one(tmp_path, tiny_release):
    """kill -9 after 3 or more cases are stored; the resumed sweep computes exactly the cases left (the store
    refuses a case written twice, and the engine's prefills count the cases it computed)."""
    db = tmp_path / "w.db"
    store = Store(db)
    case_set_id = labelled_set(store, CASES)
    (tmp_path / "tickets.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "variants.json").write_text(json.dumps([{"name": "terse", "questions": {
        "urgent": {"type": "noul", "instructions": "Urgent?", "criteria": None}}}]))
    args = ["--db", str(db), "--case-set", "tickets", "--schema", str(tmp_path / "tickets.json"),
            "--model", str(tiny_release), "--device", "cpu", "--dtype", "float32",
            "--variants", str(tmp_path / "variants.json")]
    child = sweep_cli(*args)
    try:
        wait_for(lambda: child.poll() is not None or (store.list_sweeps() and store.list_sweeps()[0]["done"] >= 3),
                 600, "3 cases of the sweep stored")
        assert child.poll() is None, child.communicate()[1][-3000:]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
    sweep = store.list_sweeps()[0]
    done_before = finished_cases(db, sweep["id"])
    assert sweep["status"] == "running" and 3 <= len(done_before) < CASES
    assert sweep["state_prefills"] == len(done_before)  # one state per finished case, answers of every variant

    refused = sweep_cli(*args)  # without --resume: names the stopped sweep, computes nothing
    _, err = refused.communicate(timeout=600)
    assert refused.returncode == 2 and f"sweep {sweep['id']} of this case set" in err and "--resume" in err

    out_file = tmp_path / "out.json"
    resumed = sweep_cli(*args, "--resume", "--json", str(out_file))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    document = json.loads(out_file.read_text())
    left = CASES - len(done_before)
    # the held-out check then continues the states of the cases computed here from the state cache; those the
    # killed process computed are prefilled again, once each
    assert document["computed_now"] == {"cases": left, "state_prefills": left + len(done_before)}
    assert (document["sweep"], document["done"], document["best"]["state_prefills"]) == (sweep["id"], CASES,
                                                                                        len(done_before))
    assert document["state_prefills"] == CASES + len(done_before)
    answers = store.list_sweep_answers(sweep["id"])
    assert sorted(Counter((a["case_id"], a["variant"] < 2) for a in answers).values()) == [1] * CASES + [2] * CASES
    assert finished_cases(db, sweep["id"]) == {c["id"] for c in store.list_cases(case_set_id)}


@pytest.mark.ray
def test_a_sweep_on_ray_splits_the_cases_across_replicas_each_doing_all_variants_of_its_cases(tmp_path, tiny_release,
                                                                                             tiny_engine):
    """`sweep --ray`: two replicas of a real local cluster, one state per case (its variants on one replica), the
    held-out check there too, and the answers a sweep in process gives."""
    from tests.support.ray_cluster import TOLERANCE, local_cluster

    address = local_cluster()
    db = tmp_path / "w.db"
    store = Store(db)
    case_set_id = labelled_set(store, 6)
    (tmp_path / "tickets.json").write_text(json.dumps(SCHEMA))
    out_file = tmp_path / "out.json"
    child = sweep_cli("--db", str(db), "--case-set", "tickets", "--schema", str(tmp_path / "tickets.json"),
                      "--model", str(tiny_release), "--dtype", "float32", "--folds", "3", "--ray", address,
                      "--replicas", "2", "--json", str(out_file))
    out, err = child.communicate(timeout=1800)  # two replicas load the release on a busy two-core machine
    assert child.returncode == 0, err[-3000:]
    assert "(Ray, 2 replicas)" in out
    document = json.loads(out_file.read_text())
    on_ray = store.get_sweep(document["sweep"])
    assert (document["done"], on_ray["state_prefills"], on_ray["settings"]["replicas"]) == (6, 6, 2)
    assert document["best"]["heldout_cases"] == 6

    own = [sweeps.Variant(v["name"], v["schema"], v["kind"], v["question"], v["relabel"])
           for v in on_ray["variants"] if v["kind"] != "composed"]
    here = sweeps.start_sweep(store, case_set_id, SCHEMA, own, model_id=on_ray["model_id"], folds=3)
    sweeps.run_sweep(store, here, tiny_engine)
    local_answers = [a for a in store.list_sweep_answers(here) if a["variant"] < len(own)]
    remote_answers = [a for a in store.list_sweep_answers(on_ray["id"]) if a["variant"] < len(own)]
    assert len(remote_answers) == 6 * len(own)
    for remote, local in zip(remote_answers, local_answers, strict=True):
        assert (remote["case_id"], remote["variant"]) == (local["case_id"], local["variant"])
        for question, answer in local["response"]["answers"].items():
            got = remote["response"]["answers"][question]
            assert got.get("noul", 0) == pytest.approx(answer.get("noul", 0), abs=TOLERANCE)
            for option, p in answer.get("probabilities", {}).items():
                assert got["probabilities"][option] == pytest.approx(p, abs=TOLERANCE)
