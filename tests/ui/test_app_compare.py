"""The Compare page and the Schemas page's history through Streamlit's AppTest, on the real demo model, a real
SQLite store and a copy of the shipped schemas and example cases. (Clicking a table cell is not drivable in
AppTest: the browser test tests/browser/test_browser_compare.py clicks one; here the case opens from its link.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from clef_workbench import casesets
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import Store
from tests.support.apptest import TIMEOUT, button, no_exceptions, open_page, texts
from workbench_ui import shell

SLUG = "support-ticket-routing"


def frame(at: AppTest, columns: set[str]):
    """The first table on the page with these columns."""
    for table in at.dataframe:
        if columns <= set(table.value.columns):
            return table.value
    raise AssertionError(f"no table with columns {columns}: {[list(t.value.columns) for t in at.dataframe]}")


def two_versions_run(workbench: Path) -> tuple[Store, int, list[int]]:
    """The example ticket cases, the ticket schema edited twice (versions 1–3), and the Compare page's one action
    run at versions 2 and 3 on the demo model. Returns the store, the case set and the two runs."""
    store = Store(workbench / "workbench.sqlite3")
    library = SchemaLibrary(workbench / "schemas", history=store)
    set_id = casesets.load_example_case_sets(store, workbench / "schemas")[SLUG]
    for instructions in ("Which team should own this ticket?", "Which single team should own this ticket?"):
        schema = library.load(SLUG)
        schema.questions["team"]["instructions"] = instructions
        library.update(SLUG, schema)
    assert [v["number"] for v in store.list_schema_versions(SLUG)] == [3, 2, 1]

    at = open_page("pages/compare.py")
    assert "Comparing needs two runs of one case set" in texts(at)
    at.selectbox(key="compare.start.set").select(set_id).run()
    # the set's own schema is proposed, not the library's first (issue 36 point 9)
    assert at.selectbox(key=f"compare.start.schema.{set_id}").value == SLUG != SchemaLibrary(
        workbench / "schemas").slugs()[0]
    runs = []
    for number in (2, 3):
        at.selectbox(key=f"compare.start.version.{SLUG}").select(number).run()
        assert at.multiselect(key="compare.start.models").value == ["clef-demo"]
        button(at, "Run this schema on this case set with these models").click().run()
        no_exceptions(at)
        runs.append(store.list_runs()[0]["id"])
        assert shell.get_job_runner().wait(runs[-1], TIMEOUT), f"run {runs[-1]} did not end"
    return store, set_id, runs


@pytest.mark.slow  # two batch runs through the Runs page
def test_compare_runs_one_schema_at_two_versions_and_shows_agreement_flips_and_intervals(workbench):
    store, set_id, (run_v2, run_v3) = two_versions_run(workbench)
    assert [(store.get_run(r)["schema_version"], store.get_run(r)["schema_slug"]) for r in (run_v2, run_v3)] == [
        ("2", SLUG), ("3", SLUG)]

    at = open_page("pages/compare.py", runs=f"{run_v2},{run_v3}")
    assert at.multiselect(key=f"compare.runs.{set_id}").value == [run_v2, run_v3]
    page = texts(at)
    assert "Demo model." in page  # its answers mean nothing, and the page says so
    assert ('~ question "team", instructions: Which {+single+} team should own this ticket?' in page)

    agreement = frame(at, {"question_id", "agreement", "interval", "flips"})
    questions = json.loads((workbench / "schemas" / f"{SLUG}.json").read_text())["questions"]
    assert list(agreement["question_id"]) == list(questions)
    assert set(agreement["n"]) == {12}
    assert all(0 <= a <= 1 for a in agreement["agreement"])
    assert all(i.startswith("[") and i.endswith("]") for i in agreement["interval"])

    metrics = frame(at, {"question", "metric"})
    assert set(metrics["metric"]) == {"accuracy", "ece", "brier", "latency_p50_ms", "latency_mean_ms"}
    accuracy = metrics[(metrics["question"] == "team") & (metrics["metric"] == "accuracy")]
    assert accuracy.shape == (1, 4) and all("n=12" in cell and "[" in cell for cell in accuracy.iloc[0, 2:])

    matrix = frame(at, {"case", "open"})
    assert len(matrix) == 12
    case_id = int(matrix["case"].iloc[3])
    assert matrix["open"].iloc[3] == f"/compare?runs={run_v2},{run_v3}&case={case_id}"
    assert {"state", "team · expected", f"team · #{run_v2}", f"team · #{run_v3}"} <= set(matrix.columns)

    # the link of a case opens it, beside every run's answers
    linked = open_page("pages/compare.py", runs=f"{run_v2},{run_v3}", case=str(case_id))
    assert f"Case {case_id}" in [h.value for h in linked.subheader]
    assert sum("`team`:" in m.value for m in linked.markdown) == 2
    # each run's distribution of each question, as a chart
    assert len(linked.get("vega_lite_chart")) - len(at.get("vega_lite_chart")) == 2 * len(questions)

    # only the cases where the runs disagree
    at.toggle(key="compare.disagree").set_value(True).run()
    no_exceptions(at)
    flipped = {case for cases in agreement["flipped"] for case in cases.split(", ") if case}
    assert len(frame(at, {"case", "open"})) == len({int(c[1:]) for c in flipped})


@pytest.mark.slow  # the slowest AppTest left in the quick tier (the service is tested in test_schema_history)
def test_schemas_page_history_diff_restore_and_undo_delete(workbench):
    at = open_page("pages/schemas.py")
    at.selectbox(key="schemas.selected").select(SLUG).run()
    for wording in ("Which team should own this ticket?", "Which single team should own this ticket?"):
        data = json.loads(at.text_area(key=f"schemas.json.{SLUG}").value)
        data["questions"]["team"]["instructions"] = wording
        at.text_area(key=f"schemas.json.{SLUG}").input(json.dumps(data)).run()
        button(at, "Save changes").click().run()
        no_exceptions(at)
    assert any("(version 3)" in s.value for s in at.success)

    history = frame(at, {"version", "how", "runs"})
    assert list(history["version"]) == [3, 2, 1] and list(history["how"]) == ["update", "update", "on disk"]
    assert ('~ question "team", instructions: Which {+single+} team should own this ticket?'
            in [c.value for c in at.code])  # from version 2 to version 3, the default pair
    at.selectbox(key=f"schemas.diff_from.{SLUG}.3").select(1).run()
    diff = next(c.value for c in at.code if c.value.startswith("~ question"))
    assert diff == '~ question "team", instructions: Which {+single+} team should [-handle-]{+own+} this ticket?'

    button(at, "Restore version 1").click().run()
    no_exceptions(at)
    assert "Restored version 1 as version 4." in texts(at)
    library = SchemaLibrary(workbench / "schemas")
    assert library.load(SLUG).version == 4
    assert library.load(SLUG).questions["team"]["instructions"] == "Which team should handle this ticket?"

    at.checkbox(key=f"schemas.confirm_delete.{SLUG}").check().run()
    button(at, "Delete").click().run()
    assert not library.exists(SLUG)
    button(at, "Undo").click().run()
    no_exceptions(at)
    assert library.load(SLUG).version == 4 and f"Restored {SLUG}.json." in texts(at)
