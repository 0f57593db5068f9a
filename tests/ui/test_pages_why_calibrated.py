"""Why and How sure beyond Decide (AppTest, the real demo model, a real SQLite file): Review routes by calibrated
confidence and shows the item's calibrated distribution labelled as such, raw one choice away, and the Why
highlighting of the item under review; a run's case view computes Why on demand; Compare reads calibrated
probabilities behind a labelled switch."""

from __future__ import annotations

import re
from dataclasses import asdict

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from clef_workbench import calibration
from clef_workbench.store import RunSettings, Store
from tests.support.apptest import APP, TIMEOUT, button, no_exceptions, open_page, start, texts, wait_for_run
from workbench_ui import shell
from workbench_ui import why_view as why

pytestmark = pytest.mark.slow  # batch runs of the demo model

# a temperature of 4 flattens the team question's distribution: every calibrated confidence falls
FLATTEN_TEAM = calibration.QuestionCalibration("team", "choice", "temperature", temperature=4.0)


def finished_run(store: Store, set_id: int) -> int:
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo", settings=RunSettings(chunk_size=8))
    shell.get_job_runner().start(run_id, shell.get_engine(show_errors=False))
    wait_for_run(run_id)
    return run_id


def tickets(store: Store, n: int = 6) -> int:
    set_id = store.create_case_set("tickets")
    store.add_cases(set_id, [{"state": f"My parcel {900 + i} arrived crushed. I was charged twice for it! "
                                       f"Please refund {i + 10} euros today.", "expected": {"team": "billing"}}
                             for i in range(n)])
    return set_id


def keep_flattening(store: Store, run_id: int, name: str = "flat team") -> str:
    store.save_calibration(name, store.get_run(run_id),
                           {"questions": {"team": calibration.asdict(FLATTEN_TEAM)}, "report": []})
    return name


def engine_records() -> int:
    return shell.get_engine(show_errors=False).info()["scheduler"]["records"]


def highlighted(at: AppTest) -> list[str]:
    """The effect of each highlighted sentence of the Why view on screen, in reading order."""
    text = next((m.value for m in at.markdown if "why-text" in m.value), "")
    return re.findall(r'<span class="why-(\w+)"', text)


def test_review_routes_by_calibrated_confidence_shows_it_labelled_and_explains_the_item(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    store = Store(workbench / "workbench.sqlite3")
    run_id = finished_run(store, tickets(store))
    name = keep_flattening(store, run_id)
    at = open_page("pages/review.py", run=str(run_id))
    for rule in ("unknown", "disagree", "use_margin"):
        at.checkbox(key=f"review.rules.{rule}.{run_id}").uncheck()
    at.checkbox(key=f"review.rules.use_conf.{run_id}").check()
    at.multiselect(key=f"review.rules.questions.{run_id}").set_value(["team"])
    at.run()  # the confidence slider is enabled by its checkbox
    raw_confidence = min(r["response"]["answers"]["team"]["confidence"] for r in store.list_results(run_id))
    threshold = round(raw_confidence - 0.01, 2)  # below every raw confidence: the raw rule queues nothing
    at.slider(key=f"review.rules.conf.{run_id}").set_value(threshold)
    at.run()
    no_exceptions(at)
    assert "These rules select **0 item(s)**" in texts(at)
    at.selectbox(key=f"review.rules.calibration.{run_id}").set_value(name).run()
    no_exceptions(at)
    assert "These rules select **6 item(s)** in 6 case(s)" in texts(at)  # flattened: all fall under it
    assert "- **team** — applied: no held-out figures were kept with it" in texts(at)  # next to the choice
    button(at, "Add 6 item(s) to the queue").click()
    at.run()
    no_exceptions(at)
    item = store.list_review_items(run_id)[0]
    assert item["reason"].startswith("calibrated confidence")
    assert f"**Why queued:** {item['reason']}" in texts(at)
    # the card shows the calibration the rules read, labelled, and the raw distribution one choice away
    assert at.selectbox(key=f"review.probabilities.{run_id}").value == name
    assert f"**Calibrated distribution** · “{name}” (fitted on clef-demo's answers in run {run_id})" in texts(at)
    assert "calibrated confidence" in texts(at) and "choose raw above" in texts(at)
    raw_answer = next(r for r in store.list_results(run_id) if r["case_id"] == item["case_id"])["response"]
    at.selectbox(key=f"review.probabilities.{run_id}").set_value("raw (as the model answered)").run()
    no_exceptions(at)
    assert "**Model's distribution** (raw, as the run recorded it)" in texts(at)
    assert f"confidence {raw_answer['answers']['team']['confidence']:.3f}" in texts(at)

    # Why for the item under review: computed once, in one batched run, its sentences highlighted
    assert highlighted(at) == []
    before = engine_records()
    at.toggle(key=f"review.why.{item['id']}").set_value(True).run()
    no_exceptions(at)
    explained = at.session_state[f"review.why_result.{run_id}.{item['case_id']}"][1]
    segments = sorted(explained["x_explanations"]["team"], key=lambda s: s["start"])
    assert highlighted(at) == [why.effect(s["delta"]) for s in segments] and len(segments) == 3
    assert engine_records() == before + 1 + len(segments)
    # blind mode hides Why with the answer (which way a sentence pushed would give the answer away)
    at.toggle(key="review.blind").set_value(True).run()
    no_exceptions(at)
    assert highlighted(at) == [] and not [t for t in at.toggle if t.key == f"review.why.{item['id']}"]


def test_a_runs_case_view_computes_why_on_demand(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    run_id = finished_run(store, tickets(store, 2))
    at = open_page("pages/runs.py", run=str(run_id))
    case_id = store.list_results(run_id)[1]["case_id"]
    at.selectbox(key=f"runs.inspect.{run_id}").set_value(case_id).run()
    no_exceptions(at)
    assert highlighted(at) == [], "nothing is explained until asked"
    before = engine_records()
    button(at, "Why: compute which parts of this case moved its answers").click()
    at.run()
    no_exceptions(at)
    explained = at.session_state[f"runs.why.{run_id}.{case_id}"][1]
    question = at.selectbox(key=f"runs.why.{run_id}.{case_id}.question").value
    segments = sorted(explained["x_explanations"][question], key=lambda s: s["start"])
    assert highlighted(at) == [why.effect(s["delta"]) for s in segments]
    assert engine_records() == before + 1 + len(segments)
    # the explanation's answers are the run's own (same model, same case)
    recorded = next(r for r in store.list_results(run_id) if r["case_id"] == case_id)["response"]["answers"]
    assert explained["answers"]["team"]["choice"] == recorded["team"]["choice"]
    # it stays on screen across reruns without being computed again
    at.run()
    assert highlighted(at) and engine_records() == before + 1 + len(segments)


def test_compare_reads_calibrated_probabilities_behind_a_labelled_switch(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    store = Store(workbench / "workbench.sqlite3")
    set_id = tickets(store, 3)
    first, second = finished_run(store, set_id), finished_run(store, set_id)
    name = keep_flattening(store, first)
    at = open_page("pages/compare.py", set=str(set_id), runs=f"{first},{second}")

    def team_cells() -> list[str]:
        matrix = next(df.value for df in at.dataframe if "state" in df.value.columns)
        return [cell for column in matrix.columns if column.startswith("team · #") for cell in matrix[column]]

    raw = team_cells()
    assert not [i for i in at.info if "Calibrated probabilities" in i.value]
    at.toggle(key="compare.calibrated").set_value(True).run()
    no_exceptions(at)
    [label] = [i.value for i in at.info if "Calibrated probabilities" in i.value]
    assert f"“{name}”" in label and "Turn the switch off" in label
    calibrated = team_cells()
    confidence = re.compile(r"\((0\.\d+)\)")
    # the same answers (a temperature keeps the ranking), every confidence lower
    assert [confidence.sub("", c) for c in calibrated] == [confidence.sub("", c) for c in raw]
    assert all(float(confidence.search(c)[1]) < float(confidence.search(r)[1])
               for c, r in zip(calibrated, raw, strict=True))
    at.toggle(key="compare.calibrated").set_value(False).run()
    assert team_cells() == raw


def test_decide_says_whether_each_calibration_helps_and_applies_only_those_that_do(workbench):
    """A map whose held-out ECE reduction interval reaches zero, or whose temperature stopped at the fit's bound,
    is not applied unless asked for; each question's verdict with its held-out interval is next to the choice."""
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    store = Store(workbench / "workbench.sqlite3")
    set_id = store.create_case_set("labelled")
    store.add_cases(set_id, [{"state": "a ticket"}])
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo")
    maps = {"churn_threat": calibration.QuestionCalibration("churn_threat", "noul", "platt", a=0.0, b=0.0),
            "team": calibration.QuestionCalibration("team", "choice", "temperature",
                                                    temperature=float(np.exp(calibration.LOG_TEMPERATURE_BOUND))),
            "priority": calibration.QuestionCalibration("priority", "score", "temperature", temperature=2.0)}
    reductions = {"churn_threat": (0.05, 0.01, 0.09), "team": (0.03, 0.01, 0.05), "priority": (-0.017, -0.12, 0.07)}
    store.save_calibration("mixed", store.get_run(run_id), {
        "questions": {q: asdict(m) for q, m in maps.items()},
        "report": [{"question_id": q, "ece_reduction": dict(zip(("value", "low", "high"), r, strict=True))}
                   for q, r in reductions.items()]})

    at = start()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    at.selectbox(key="decide.calibration").select("mixed").run()
    no_exceptions(at)
    verdicts = next(m.value for m in at.markdown if m.value.startswith("- **"))
    assert verdicts.splitlines() == [
        "- **churn_threat** — applied: held-out ECE reduction +0.050 [+0.010, +0.090], 95% interval",
        "- **team** — not applied: the temperature 20.09 is the largest the fit tries: it flattens every answer to "
        "about 1/k (all options nearly equally likely) (held-out ECE reduction +0.030 [+0.010, +0.050], 95% "
        "interval)",
        "- **priority** — not applied: it may not help — held-out ECE reduction -0.017 [-0.120, +0.070], 95% "
        "interval includes no improvement"]

    def calibrated_cards() -> list[str]:
        return sorted(m.value.split("**")[1] for m in at.markdown if "· **calibrated**" in m.value)

    assert calibrated_cards() == ["churn_threat"]  # only the map that helps
    at.checkbox(key="decide.calibration_all").check().run()
    no_exceptions(at)
    assert calibrated_cards() == ["churn_threat", "priority", "team"]  # asked for: every map
