"""The Sweeps page through Streamlit's AppTest, on the real demo model, a real SQLite store and a copy of the shipped
schemas and example cases: start a sweep, see it end and its leaderboard, adopt (asked first) and undo. (Selecting a
table row is not drivable in AppTest: tests/browser/test_browser_sweeps.py clicks one to open a flipped case.)"""

from __future__ import annotations

from clef_workbench import sweeps
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import Store
from tests.support.apptest import button, no_exceptions, open_page, texts
from tests.support.sweeps import one_question_schema
from workbench_ui import shell
from workbench_ui import sweeps_view as sv

SLUG = "ticket-team"
TICKETS = [("I was charged twice for March.", "billing"),
           ("The app crashes when I open settings.", "technical_support"),
           ("Someone logged into my account from Brazil.", "account_security"),
           ("Please quote 250 seats.", "sales")]


def test_start_a_sweep_read_its_leaderboard_adopt_and_undo(workbench):
    store = Store(workbench / "workbench.sqlite3")
    library = SchemaLibrary(workbench / "schemas", history=store)
    one_question_schema(library)
    set_id = store.create_case_set("Tickets", schema_name=SLUG)
    store.add_cases(set_id, [{"state": text, "expected": {"team": team}} for text, team in TICKETS])

    at = open_page("pages/sweeps.py")
    assert [t.value for t in at.title] == ["Schema sweeps"]
    at.selectbox(key="sweeps.start.set").set_value(set_id).run()
    assert at.selectbox(key=f"sweeps.start.schema.{set_id}").value == SLUG  # the schema the set was made for
    at.checkbox(key="sweeps.start.kind.no_instructions").check().run()
    at.checkbox(key="sweeps.start.kind.no_descriptions").check().run()
    kinds = ["no_instructions", "no_descriptions"]
    variants = sv.planned_variants(sv.library_schema(library, SLUG)[0], kinds, [])[0]
    assert [v.name for v in variants] == ["base", "no_descriptions:team", "no_instructions:team"]
    assert f"{len(variants)} variants, the base included, on every labelled case." in texts(at)
    button(at, "Start the sweep").click().run()
    no_exceptions(at)
    assert f"Started sweep #1: {len(variants)} variants." in [s.value for s in at.success]
    assert shell.get_sweep_runner().wait(1, timeout=900)

    at.run()  # the page after the sweep ended: its leaderboard
    no_exceptions(at)
    result = sweeps.load_sweep(store, 1, threshold=0.1)
    board = next(t.value for t in at.dataframe if "against the base" in t.value.columns)
    assert sorted(board["variant"]) == sorted(v.name for v in variants)  # every variant, the most accurate first
    assert list(board["variant"]) == list(sweeps.leaderboard(result)["variant"])
    assert result.status == "finished" and sv.leaderboard_caption(result) in texts(at)
    adopted = next(value for value in sv.adoption_choices(result) if value != sv.BEST)
    at.selectbox(key="sweeps.adopt.1").set_value(adopted).run()
    before = [v["number"] for v in store.list_schema_versions(SLUG)]
    button(at, "Adopt…").click().run()
    assert [v["number"] for v in store.list_schema_versions(SLUG)] == before  # asked first: nothing written yet
    assert any("becomes version 2 of ticket-team.json" in w.value for w in at.warning)
    button(at, "Yes, adopt it").click().run()
    no_exceptions(at)
    assert [s.value for s in at.success] == [f"Adopted as version 2 of {SLUG}.json (Schemas page → History)."]
    assert store.list_schema_versions(SLUG)[0]["action"] == "adopt"
    assert store.list_schema_versions(SLUG)[0]["note"] == sv.adoption_note(result, adopted)

    button(at, "Undo").click().run()
    no_exceptions(at)
    assert f"Undone: version 1 of {SLUG}.json is current again (as version 3)." in [i.value for i in at.info]
    assert library.load(SLUG).questions == store.get_schema_version_number(SLUG, 1)["schema"]["questions"]

    runs = open_page("pages/runs.py")  # a sweep is listed with the runs, its link opening it on Sweeps
    no_exceptions(runs)
    assert [e.label for e in runs.expander if e.label.startswith("Schema sweeps")] == ["Schema sweeps (1)"]
    listed = next(t.value for t in runs.dataframe if "variants" in t.value.columns)
    assert listed.to_dict("records") == [
        {"sweep": 1, "status": "finished", "case set": "Tickets", "schema": "Ticket team", "variants": len(variants),
         "done": len(TICKETS), "total": len(TICKETS), "model": store.get_sweep(1)["model_id"],
         "created": listed["created"][0], "open": "/sweeps?sweep=1"}]
