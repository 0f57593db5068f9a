"""Calibrating on the Runs page (AppTest, the real demo model, a real SQLite file): a run of labelled cases is fitted
with one click, the before/after table and the reliability curves on held-out cases are shown, and the calibration
is kept for the schema and model; a run with too few labels is refused with the reason, next to the button."""

from __future__ import annotations

import numpy as np
from streamlit.testing.v1 import AppTest

from clef_workbench.store import RunSettings, Store
from tests.support.apptest import APP, TIMEOUT, button, no_exceptions, open_page, texts, wait_for_run
from workbench_ui import shell


def labelled_run(store: Store, cases: int) -> tuple[int, str]:
    schema = shell.get_library().load("support-ticket-routing").to_dict()
    schema.pop("examples")
    rng = np.random.default_rng(5)
    teams, levels = list(schema["questions"]["team"]["criteria"]), len(schema["questions"]["priority"]["criteria"])
    set_id = store.create_case_set(f"labelled {cases}")
    store.add_cases(set_id, [{"state": f"Ticket {i}: parcel {900 + i} lost, refund {i} euros",
                              "expected": {"team": teams[int(rng.integers(len(teams)))],
                                           "priority": int(rng.integers(levels))}} for i in range(cases)])
    run_id = store.create_run(set_id, schema=schema, model_id="clef-demo", settings=RunSettings(chunk_size=16))
    shell.get_job_runner().start(run_id, shell.get_engine(show_errors=False))
    wait_for_run(run_id)
    return run_id, schema["name"]


def test_fit_a_calibration_on_the_runs_page_shows_before_and_after_and_keeps_it(workbench):
    AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # loads the demo model in this process
    store = Store(workbench / "workbench.sqlite3")
    few, _ = labelled_run(store, 12)
    at = open_page("pages/runs.py", run=str(few))
    button(at, "Fit a calibration on these labelled cases").click()
    at.run()
    no_exceptions(at)
    assert "Not calibrated: team: 12 labelled case(s)" in texts(at) and "at least 30" in texts(at)
    assert store.list_calibrations() == []

    enough, schema_name = labelled_run(store, 40)
    at = open_page("pages/runs.py", run=str(enough))
    charts_before = len(at.get("vega_lite_chart"))
    button(at, "Fit a calibration on these labelled cases").click()
    at.run()
    no_exceptions(at)
    [kept] = store.list_calibrations(schema_name=schema_name, model_id="clef-demo")
    assert f"Kept as calibration “{kept['name']}”" in texts(at)
    table = next(df.value for df in at.dataframe if "ECE after (held out)" in df.value.columns)
    assert set(table["question"]) >= {"team", "priority"} and (table.set_index("question").loc["team", "n"] == 40)
    fitted = [r for r in kept["payload"]["report"] if r["refused"] is None]
    assert len(at.get("vega_lite_chart")) == charts_before + len(fitted)  # one before/after curve per fitted one
