"""The Decide page's view-model without Streamlit: the builder's state machine and identity, problem routing, the
token-budget cache, the result record, save as case, and the draft."""

from __future__ import annotations

import json

from clef_engine.errors import Problem
from clef_workbench import schemas
from clef_workbench.store import Store
from workbench_ui import answers, schema_rows, state_input
from workbench_ui import decide_model as vm


def ids(state: dict) -> list[str]:
    return [row["id"] for row in vm.Builder(state).rows()]


def test_builder_adds_moves_and_removes_questions_with_stable_widget_keys():
    state: dict = {}
    builder = vm.Builder(state)
    for qtype in ("noul", "choice", "score"):
        builder.add_question(qtype)
    assert ids(state) == ["q1", "q2", "q3"]
    assert state["decide.q1.type"] == "choice" and "unknown: None of these fits." in state["decide.q1.options"]
    assert state["_keep.decide.q2.levels"] == "Low\nMedium\nHigh"  # kept for a visit to another page
    state["decide.q0.id"] = "q4"
    builder.add_question("noul")  # q4 is taken: the next free number
    assert ids(state) == ["q4", "q2", "q3", "q5"]
    builder.move(2, -1)
    builder.move(0, -1)  # already first: stays
    assert ids(state) == ["q4", "q3", "q2", "q5"]
    builder.remove(0)
    assert ids(state) == ["q3", "q2", "q5"]
    rows = builder.rows()
    assert rows[1]["options"][0] == {"id": "option_a", "description": ""} and rows[0]["levels"] == ["Low", "Medium",
                                                                                                    "High"]


def test_identity_follows_the_schema_on_screen(library):
    state: dict = {}
    builder = vm.Builder(state)
    schema = library.load("support-ticket-routing")
    builder.load("support-ticket-routing", schema)
    assert builder.loaded_slug == "support-ticket-routing" and state["decide.library_pick"] == "support-ticket-routing"
    assert state["decide.state_text"] == schema.examples[0]["state"]
    assert not builder.unsaved_changes()
    state[vm.row_keys(builder.uids[0])["instructions"]] = "Something else"
    assert builder.unsaved_changes()

    builder.new_schema()
    assert builder.loaded_slug is None and builder.examples == [] and builder.uids == []
    assert state["decide.schema_name"] == "" and state["decide.library_pick"] is None
    assert state["decide.state_text"] == schema.examples[0]["state"], "the state stays"
    builder.add_question("noul")
    questions, _ = schema_rows.rows_to_questions(builder.rows())
    new = builder.schema_to_save(questions, "Mine", "", update=False)
    assert new.examples == [], "a new schema does not inherit the old schema's example states"
    assert builder.unsaved_changes(), "questions built from nothing are unsaved"


def test_load_keeps_the_typed_state_and_what_load_or_an_example_replaces_can_be_undone(library):
    """Issue 36 point 1: a record is written first, then the schema to ask about it is loaded: the state stays; the
    schema's example is a separate action; both replacements have an Undo."""
    state: dict = {}
    builder = vm.Builder(state)
    tickets = library.load("support-ticket-routing")
    builder.load("support-ticket-routing", tickets)
    assert builder.replaced("schema") is None, "nothing was on screen to replace"
    vm.set_kept(state, "decide.state_text", "My own record: the invoice is wrong.")
    state[vm.row_keys(builder.uids[0])["instructions"]] = "My own wording"
    routing_ids = ids(state)

    invoice = library.load("invoice-triage")
    builder.load("invoice-triage", invoice)
    assert state["decide.state_text"] == "My own record: the invoice is wrong."
    assert ids(state) == list(invoice.questions)
    assert builder.replaced("schema") == "Loaded “invoice-triage” in place of the questions that were here."
    builder.undo_replace()
    assert ids(state) == routing_ids and builder.loaded_slug == "support-ticket-routing"
    assert builder.rows()[0]["instructions"] == "My own wording"
    assert state["decide.schema_name"] == tickets.name and state["decide.library_pick"] == "support-ticket-routing"
    assert builder.unsaved_changes(), "the edited wording is back, still unsaved"
    assert state["decide.state_text"] == "My own record: the invoice is wrong."

    builder.use_example(0)
    example = state_input.state_to_text(tickets.examples[0]["state"])
    assert state["decide.state_text"] == example
    assert builder.replaced("state") == f"Replaced the state with the example “{tickets.examples[0]['name']}”."
    builder.undo_replace()
    assert state["decide.state_text"] == "My own record: the invoice is wrong." and builder.replaced("state") is None


def test_a_loaded_schema_keeps_its_examples_on_update_only(library):
    state: dict = {}
    builder = vm.Builder(state)
    schema = library.load("invoice-triage")
    builder.load("invoice-triage", schema)
    questions, _ = schema_rows.rows_to_questions(builder.rows())
    assert builder.schema_to_save(questions, "x", "", update=True).examples == schema.examples
    assert builder.schema_to_save(questions, "x", "", update=False).examples == []


def test_problems_go_next_to_their_question_by_position_or_id():
    rows = [{"id": "urgent"}, {"id": "team"}, {"id": "team "}]
    messages = vm.Messages()
    vm.route_schema_problems([
        schemas.SchemaProblem(loc=("questions", "team", "criteria"), msg="bad options"),
        schemas.SchemaProblem(loc=("questions", 0, "id"), msg="bad id"),
        schemas.SchemaProblem(loc=("questions", "urgent"), msg="vague", severity="warning"),
        schemas.SchemaProblem(loc=("questions",), msg="no questions"),
    ], rows, messages)
    assert messages.errors == {1: ["bad options"], 2: ["bad options"], 0: ["bad id"], "schema": ["no questions"]}
    assert messages.warnings == {0: ["vague"]}

    engine = vm.Messages()
    vm.route_engine_problems([Problem(("state",), "empty"), Problem(("images", 0), "too big"),
                              Problem(("questions", "urgent", "criteria"), "x"), Problem(("questions", "gone"), "y"),
                              Problem(("questions",), "too many"), Problem(("model",), "z")], rows, engine)
    assert engine.errors == {"state": ["state: empty"], "media": ["images.0: too big"],
                             0: ["questions.urgent.criteria: x"],
                             "schema": ["questions.gone: y", "questions: too many"], "budget": ["model: z"]}


def test_engine_wording_becomes_the_controls_labels():
    text = "allow truncation (overflow='truncate_state')"
    assert vm.in_control_words(text) == ("allow truncation (“If the state does not fit: truncate the end of the "
                                         "state”)")


class CountingEngine:
    def __init__(self):
        self.calls = 0

    def count_tokens(self, request, *, max_length):
        self.calls += 1
        return {"total": len(request["state"]) + max_length}


def test_budget_cache_counts_once_per_request_budget_and_engine():
    cache = vm.BudgetCache()
    first, second = CountingEngine(), CountingEngine()
    request = {"state": "abc", "questions": {}}
    assert cache.counts(first, request, 100) == {"total": 103}
    assert cache.counts(first, dict(request), 100) == {"total": 103} and first.calls == 1
    cache.counts(first, request, 200)
    cache.counts(first, {"state": "abcd", "questions": {}}, 200)
    assert first.calls == 3
    cache.counts(second, {"state": "abcd", "questions": {}}, 200)  # another model: counted by it
    assert second.calls == 1


def test_result_record_and_save_as_case(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
    image = state_input.Media("image", "a.png", "image/png", png, 32, 32)
    questions = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
    result = vm.DecideResult(
        request={"state": "s", "questions": questions, "images": ["data:image/png;base64,AAAA"]},
        response={"answers": {"urgent": {"type": "noul", "noul": 0.8}}},
        questions=questions, state="s", images=(image,), videos=(), schema_name="", model_label="clef-demo",
        device="cpu")
    assert result.default_case_set() == "Decide cases"
    store = Store(tmp_path / "w.db")
    case_id = vm.save_as_case(store, result, result.default_case_set(), with_labels=True, tags_text=" a, ,b ")
    case = store.get_case(case_id)
    assert case["expected"] == {"urgent": True} and case["tags"] == ["a", "b"]
    assert case["images"] == [{"content_type": "image/png", "data": png}]
    unlabelled = vm.save_as_case(store, result, "Decide cases", with_labels=False, tags_text="")
    assert store.get_case(unlabelled)["expected"] == {}
    assert len(store.list_case_sets()) == 1


def test_draft_round_trip_and_save_only_on_change(library):
    state: dict = {}
    builder = vm.Builder(state)
    builder.load("support-ticket-routing", library.load("support-ticket-routing"))
    vm.set_kept(state, "decide.max_length", 2048)
    state[vm.row_keys(builder.uids[1])["id"]] = "renamed"
    saved: list[dict] = []
    assert vm.save_draft_if_changed(state, saved.append)
    assert not vm.save_draft_if_changed(state, saved.append), "nothing changed: nothing written"
    draft = saved[-1]

    fresh: dict = {}
    vm.restore_draft(fresh, draft)
    assert vm.draft_of(fresh) == draft
    assert ids(fresh)[1] == "renamed" and fresh["decide.max_length"] == 2048
    assert vm.Builder(fresh).loaded_slug == "support-ticket-routing"
    assert vm.Builder(fresh).unsaved_changes(), "the renamed question is still an unsaved change after a reload"


def test_a_small_video_frame_is_enlarged_by_whole_pixels_and_a_large_one_kept():
    import numpy as np

    small = np.arange(32 * 24 * 3, dtype=np.uint8).reshape(24, 32, 3)
    thumb = vm.frame_thumbnail(small)
    assert thumb.size == (160, 120), "at least the thumbnail width, aspect kept"
    assert np.array_equal(np.asarray(thumb)[::5, ::5], small), "nearest neighbour: exactly the frame's pixels"
    large = np.zeros((200, 400, 3), dtype=np.uint8)
    assert vm.frame_thumbnail(large).size == (400, 200)


def test_stale_causes_name_what_changed_since_run():
    png = state_input.Media("image", "a.png", "image/png", b"\x89PNG" + b"\x00" * 8, 1, 1)
    questions = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
    result = vm.DecideResult(request={}, response={"answers": {}}, questions=questions, state="s", images=(png,),
                             videos=(), schema_name="", model_label="clef-demo", device="cpu")
    same = dict(questions=questions, state="s", images=[png], videos=[], model="clef-demo")
    assert result.stale_causes(**same) == []
    assert result.stale_causes(**{**same, "model": "clef-flash"}) == ["the model"]
    assert result.stale_causes(**{**same, "images": []}) == ["the media"]
    assert result.stale_causes(**{**same, "state": "t", "questions": {}}) == ["the schema", "the state"]
    assert vm.stale_message(["the model"]).startswith(
        "**Outdated:** the model has changed since these answers were computed")
    assert "the schema, the state and the model have changed" in vm.stale_message(
        ["the schema", "the state", "the model"])


def test_model_for_run_follows_a_new_default_but_keeps_a_pick_meanwhile():
    state: dict = {}
    assert vm.model_for_run(state, ["clef-demo", "small"], "clef-demo") == ("clef-demo", None)
    vm.set_kept(state, vm.key("model"), "small")  # picked on the page
    assert vm.model_for_run(state, ["clef-demo", "small"], "clef-demo") == ("small", None)
    assert vm.model_for_run(state, ["flash", "clef-demo", "small"], "flash") == ("flash", None), "Make default"
    assert vm.model_for_run(state, ["flash", "clef-demo"], "flash") == ("flash", None)
    vm.set_kept(state, vm.key("model"), "clef-demo")
    chosen, note = vm.model_for_run(state, ["flash"], "flash")  # a picked model unloaded since
    assert chosen == "flash" and note == ("clef-demo is not loaded, so this page's runs use flash: add clef-demo in "
                                          "the sidebar to use it.")
    assert vm.model_for_run(state, ["flash"], "flash") == ("flash", None), "said once"


def test_a_changed_max_length_or_overflow_marks_the_answers_outdated_only_when_it_changes_the_cut():
    """The budget settings changed after Run: the same record is cut otherwise (or refused), so the answers on
    screen no longer answer what Run would send; a change that cuts the same tokens changes nothing."""
    result = vm.DecideResult(request={}, response={"answers": {}, "x_truncated_state_tokens": 0}, questions={},
                             state="s", images=(), videos=(), schema_name="", model_label="m", device="cpu",
                             max_length=16_384, overflow="refuse")
    same = {"questions": {}, "state": "s", "images": [], "videos": [], "model": "m"}
    fits = answers.BudgetStatus(849, 8192, 0, 0, "refuse")
    cut = answers.BudgetStatus(849, 800, 49, 0, "truncate_state")
    refused = answers.BudgetStatus(849, 800, 49, 0, "refuse")
    assert result.stale_causes(**same, budget=fits) == []
    assert result.stale_causes(**same, budget=cut) == ["the token budget"]
    assert result.stale_causes(**same, budget=refused) == ["the token budget"]
    assert result.stale_causes(**same, budget=None) == [], "not counted (a remote endpoint)"
    assert result.stale_causes(**{**same, "state": "t"}, budget=cut) == ["the state"]
    assert vm.stale_message(["the token budget"]).startswith("**Outdated:** the token budget has changed")


def test_a_reload_keeps_the_model_picked_before_it():
    """The draft a reload restores (F5, or a link to a run's case) names the model; a new session keeps it while it
    is loaded, where it used to fall back to the default and mark the restored answers outdated."""
    state: dict = {}
    assert vm.model_for_run(state, ["clef-demo", "small"], "clef-demo") == ("clef-demo", None)
    vm.set_kept(state, vm.key("model"), "small")
    assert vm.draft_of(state)["model"] == "small"
    reloaded: dict = {}
    vm.restore_draft(reloaded, vm.draft_of(state))
    assert vm.model_for_run(reloaded, ["clef-demo", "small"], "clef-demo") == ("small", None)


def test_a_removed_question_comes_back_where_it_was_with_what_it_held(library):
    state: dict = {}
    builder = vm.Builder(state)
    builder.load("support-ticket-routing", library.load("support-ticket-routing"))
    before = builder.rows()
    assert not builder.unsaved_changes()
    builder.remove(builder.uids[1])
    assert builder.last_removed == before[1]["id"] and builder.unsaved_changes()
    builder.undo_remove()
    assert builder.rows() == before and builder.last_removed is None and not builder.unsaved_changes()
    builder.remove(builder.uids[0])
    builder.add_question("noul")
    assert builder.last_removed is None, "undo is offered only until the questions change otherwise"


def test_a_duplicate_id_is_reported_on_the_question_that_repeats_it():
    rows = [{"id": "a", "type": "noul", "instructions": "x"}, {"id": "b", "type": "noul", "instructions": "y"},
            {"id": "a", "type": "noul", "instructions": "z"}]
    _, problems = schema_rows.rows_to_questions(rows)
    messages = vm.Messages()
    vm.route_schema_problems(problems, rows, messages)
    assert list(messages.errors) == [2], "on the third card, not on the first that holds the id rightly"
    assert "questions 1 and 3" in messages.errors[2][0]


def test_media_travel_with_the_draft_and_come_back_on_restore():
    png = state_input.Media("image", "a.png", "image/png", b"\x89PNG" + bytes(range(40)), 4, 4)
    state: dict = {}
    vm.set_media(state, [png])
    saved: list[dict] = []
    assert vm.save_draft_if_changed(state, saved.append)
    assert saved[-1]["media"][0]["name"] == "a.png" and saved[-1]["media"][0]["base64"]
    assert not vm.save_draft_if_changed(state, saved.append), "the same media: nothing written again"
    fresh: dict = {}
    vm.restore_draft(fresh, json.loads(json.dumps(saved[-1])))  # as the store keeps it
    assert vm.restored_media(fresh) == [png]
    again = state_input.Media("image", "a.png", "image/png", png.data, 4, 4)
    assert vm.with_restored(vm.restored_media(fresh), [again]) == [png], "uploaded again: not twice"
    vm.remove_restored_media(fresh, 0)
    assert vm.restored_media(fresh) == []


def test_the_last_answers_travel_with_the_draft_with_what_produced_them():
    """Point 10: a reload brings back the last run's answers with their request, media and model, so they show again
    and are marked stale by what differs from the editors since."""
    png = state_input.Media("image", "a.png", "image/png", b"\x89PNG" + bytes(range(40)), 4, 4)
    questions = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
    request = state_input.build_request("s", questions, images=[png], model="clef-demo")
    result = vm.DecideResult(request=request, response={"answers": {"urgent": {"type": "noul", "noul": 0.8}}},
                             questions=questions, state="s", images=(png,), videos=(), schema_name="Triage",
                             model_label="clef-demo", device="cpu", schema_slug="triage", random_weights=True)
    state: dict = {}
    vm.set_media(state, [png])
    vm.keep_result(state, result)
    saved: list[dict] = []
    assert vm.save_draft_if_changed(state, saved.append)
    stored = saved[-1]
    assert "images" not in stored["result"]["request"], "the request's data URLs are not stored a second time"
    assert "base64" not in stored["result"]["media"][0], "a file still on screen is stored once, with the editors"
    fresh: dict = {}
    vm.restore_draft(fresh, json.loads(json.dumps(stored)))  # as the store keeps it
    assert fresh["decide.result"] == result
    assert fresh["decide.result"].stale_causes(questions=questions, state="s", images=[png], videos=[],
                                               model="clef-demo") == []

    vm.set_media(state, [])  # the image removed after the run: the answers still carry what they were run with
    assert vm.save_draft_if_changed(state, saved.append)
    assert saved[-1]["media"] == [] and saved[-1]["result"]["media"][0]["base64"]
    fresh = {}
    vm.restore_draft(fresh, json.loads(json.dumps(saved[-1])))
    restored = fresh["decide.result"]
    assert restored == result and vm.restored_media(fresh) == []
    assert restored.stale_causes(questions=questions, state="s", images=[], videos=[], model="other") == \
        ["the media", "the model"]


def test_durations_switch_to_seconds_above_ten_thousand_ms_and_rates_stay_short():
    from workbench_ui import units

    assert units.duration(None) == "–"
    assert units.duration(850.24) == "850.2 ms" and units.duration(10_000) == "10,000 ms"
    assert units.duration(10_001) == "10.0 s" and units.duration(150_762.4) == "2 min 31 s"
    assert units.rate(12_016.2, "tok") == "12,016 tok/s" and units.rate(3.4167, "rec") == "3.42 rec/s"


def test_a_score_answer_reads_with_its_levels_label():
    """Issue 36 point 10: "level 1 · Medium", not "level 1" alone."""
    question = {"type": "score", "instructions": "How urgent?", "levels": ["Low", "Medium", "High"]}
    answer = {"type": "score", "score": 1.1, "confidence": 0.7, "probabilities": {"0": 0.1, "1": 0.7, "2": 0.2},
              "legend": {"0": "Low", "1": "Medium", "2": "High"}}
    assert vm.answer_text(answers.summarize("urgency", question, answer), answer) == "level 1 · Medium"
    noul = {"type": "noul", "noul": 0.8}
    assert vm.answer_text(answers.summarize("urgent", {"type": "noul"}, noul), noul) == "true"


def test_an_attached_image_is_drawn_at_a_preview_size_never_enlarged():
    assert vm.image_preview_width(4000) == vm.IMAGE_PREVIEW_PX
    assert vm.image_preview_width(64) == 64
