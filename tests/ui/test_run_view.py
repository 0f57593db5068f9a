"""The Runs page's view-model on a real store: a run of four support tickets in two batches of two (one case failed),
read as the page shows it: speed, quality, the table to browse and the export, and the buttons that run on a model
while one loads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from clef_workbench.model_loader import ModelManager
from clef_workbench.store import RunSettings, Store
from workbench_ui import run_view as view

SCHEMA = {"name": "tickets", "version": "4", "questions": {
    "team": {"type": "choice", "instructions": "Team?", "criteria": {"billing": "Money", "tech": "Bugs"}},
    "urgent": {"type": "noul", "instructions": "Urgent?"},
}}
FIRST_BATCH = {"started_at": "2026-12-01T10:00:00+00:00", "finished_at": "2026-12-01T10:00:02+00:00"}
SECOND_BATCH = {"started_at": "2026-12-01T10:00:02+00:00", "finished_at": "2026-12-01T10:00:04+00:00"}


def answer(billing: float, p_urgent: float, queue_ms: float) -> dict:
    team = {"billing": billing, "tech": round(1 - billing, 2)}
    return {"x_queue_ms": queue_ms, "answers": {
        "team": {"type": "choice", "choice": max(team, key=team.get), "confidence": max(team.values()),
                 "probabilities": team},
        "urgent": {"type": "noul", "noul": p_urgent}}}


@pytest.fixture
def run(tmp_path) -> tuple[Store, dict]:
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("Tickets (March)")
    case_ids = store.add_cases(set_id, [
        {"state": "I was charged twice, please refund.", "expected": {"team": "billing", "urgent": True},
         "tags": ["vip"]},
        {"state": "The app closes when I open settings.", "expected": {"team": "tech"}, "tags": ["urgent"]},
        {"state": "Where is my invoice?", "expected": {}},
        {"state": "x" * 10, "expected": {}},
    ])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="clef", model_revision="abc",
                              settings=RunSettings(chunk_size=2, max_length=4096))
    store.record_results(run_id, [
        {"case_id": case_ids[0], "response": answer(0.9, 0.9, 10), "latency_ms": 100, "input_tokens": 100,
         **FIRST_BATCH},
        {"case_id": case_ids[1], "response": answer(0.7, 0.2, 20), "latency_ms": 200, "input_tokens": 200,
         **FIRST_BATCH},
        {"case_id": case_ids[2], "response": answer(0.4, 0.6, 30), "latency_ms": 300, "input_tokens": 300,
         **SECOND_BATCH},
        {"case_id": case_ids[3], "error": "state too long: 9,000 tokens > max_length 4,096", **SECOND_BATCH},
    ])
    return store, store.get_run(run_id)


def test_speed_reads_per_record_compute_queue_wait_and_throughput_over_busy_time(run):
    store, this = run
    speed = view.speed(store.list_results(this["id"]), 2)
    latency = {m.label: (m.value, m.help) for m in speed.latency}
    assert latency["p50 compute per record"][0] == "200.0 ms"
    assert latency["max compute per record"][0] == "300.0 ms"
    assert latency["p50 queue wait"][0] == "20.0 ms"
    assert latency["samples"] == ("3", "1 error results excluded")
    assert speed.latency_notes[0].startswith("n = 3 records in 2 batch(es); 1 failed cases left out.")
    assert "queue wait (max 30.0 ms)" in speed.latency_notes[0]
    assert speed.latency_notes[1].startswith("Window 2026-12-01T10:00:00 → 2026-12-01T10:00:04 UTC (4.0 s)")
    # 3 records, 2 questions each, 600 input tokens in 4 s of busy time
    assert [(m.label, m.value) for m in speed.throughput] == [
        ("records/s", "0.75 rec/s"), ("decisions/s", "1.5 dec/s"), ("tokens/s", "150 tok/s"),
        ("tokens per record", "200 (median 200)")]
    assert speed.throughput_note.startswith("Throughput over 4.0 s of busy time")


def test_quality_counts_only_answers_with_expected_ones(run):
    store, this = run
    frame, covered = view.answers(store.list_results(this["id"]), this["schema"])
    assert covered["answered"] == 3 and covered["with_expected"] == 2
    quality = view.quality(frame, SCHEMA["questions"])
    accuracy = quality.accuracy.set_index("question_id")
    assert accuracy.loc["team", "n_expected"] == 2 and accuracy.loc["team", "accuracy"] == 0.5  # tech read as billing
    assert accuracy.loc["urgent", "n_expected"] == 1 and accuracy.loc["urgent", "accuracy"] == 1.0
    assert quality.accuracy_rows == 2 and quality.choice_questions == 1 and quality.score_mae.empty
    [(question_id, matrix)] = quality.confusions
    assert question_id == "team"
    assert matrix.loc["billing", "billing"] == 1 and matrix.loc["tech", "billing"] == 1
    assert matrix.loc["tech", "tech"] == 0
    assert list(quality.calibration["question_id"]) == ["team", "urgent"]
    assert [q for q, _ in quality.reliability] == ["team", "urgent"]
    slowest, least_confident = view.extremes(store.list_results(this["id"]), frame)
    assert list(slowest["latency_ms"]) == [300, 200, 100]
    assert least_confident.iloc[0][["question_id", "margin"]].tolist() == ["team", pytest.approx(0.2)]


def test_browse_filters_the_answers_and_links_each_to_decide_and_review(run):
    store, this = run
    browse = view.browse(this["id"], store.list_results(this["id"]), this["schema"])
    assert browse.tags == ["urgent", "vip"]
    shown, caption, digest = view.browsed(browse.table, wrong_only=True)
    assert caption.startswith("1 of 6 answers.")
    [row] = shown.to_dict("records")
    assert (row["question"], row["predicted"], row["expected"]) == ("team", "billing", "tech")
    assert row["decide"] == f"/?run={this['id']}&case={row['case']}"
    assert row["review"] == f"/review?run={this['id']}&case={row['case']}&question=team"
    searched, caption, other_digest = view.browsed(browse.table, search="invoice")
    assert caption.startswith("2 of 6 answers.") and set(searched["question"]) == {"team", "urgent"}
    assert other_digest != digest  # other rows, another table: no selection outlives its rows


def test_the_caption_errors_and_export_say_what_the_run_was_and_holds(run):
    store, this = run
    assert view.settings_caption(this) == ("Schema **tickets v4** · model **clef** @ abc · batch 2 · max_length 4096 "
                                           "(refuse) · started –")
    failed = store.list_results(this["id"])[3]["case_id"]
    assert view.error_rows(store.list_results(this["id"])) == [
        {"case": failed, "error": "state too long: 9,000 tokens > max_length 4,096"}]
    files = view.export(store, this, 4, live=True)
    assert files.stem == f"run-{this['id']}-tickets-march"
    assert files.caption.endswith("The run is still going: the files hold the 4 case(s) answered so far.")
    assert "state too long" in files.csv and len(files.jsonl.splitlines()) == 3 * 2 + 1  # a failed case: one row
    assert "still going" not in view.export(store, this, 4, live=False).caption


def test_a_run_is_recorded_without_the_schemas_examples_and_with_the_engines_build(run):
    store, this = run
    run_id = view.create_run(store, this["case_set_id"], {**SCHEMA, "examples": [{"state": "x"}]}, "tickets",
                             "clef", {"revision": "r1", "device": "cpu", "dtype": "float32", "precision": "bf16"},
                             chunk_size=8, max_length=2048, overflow="truncate_state")
    made = store.get_run(run_id)
    assert "examples" not in made["schema"] and made["model_revision"] == "r1"
    assert made["settings"] == RunSettings(chunk_size=8, max_length=2048, overflow="truncate_state",
                                           schema_slug="tickets", device="cpu", dtype="float32", precision="bf16")


def test_too_few_labelled_cases_refuse_a_calibration_with_the_reason(run):
    store, this = run
    refused, fitted = view.fit_calibration(store, this["id"])
    assert refused.startswith("Not calibrated: ") and fitted is None


class Engine:
    def close(self):
        pass


def test_while_a_model_loads_the_buttons_that_run_on_it_wait_and_then_offer_it(tmp_path: Path):
    release = threading.Event()

    def load(source):
        release.wait(60)
        return Engine()

    models = ModelManager(loader=load, demo_path=lambda: tmp_path)
    models.request(str(tmp_path / "clef"))
    assert models.state().busy
    assert view.model_button("Resume (3 cases left)", models.state().busy) == ("Model loading…", True)
    engine, missing = view.run_engine(models, "clef")
    assert engine is None and missing.startswith("This run was started on the model 'clef', which is not loaded")
    release.set()
    state = models.wait(60)
    assert view.model_button("Resume (3 cases left)", state.busy) == ("Resume (3 cases left)", False)
    engine, missing = view.run_engine(models, "clef")
    assert isinstance(engine, Engine) and missing is None
