"""The Review page's view-model on a real queue (the run of tests/workbench/test_review.py: five tickets, a choice
and a yes/no question): what the rules select, the card in normal and blind mode, the buttons, the gold-label
question, the record's rows, the messages, the audit log and the export."""

from __future__ import annotations

import json

import pytest

from clef_workbench import review
from clef_workbench.review import ReviewRules
from tests.support.review_queue import SCHEMA
from tests.support.review_queue import run as run  # noqa: F401 - the fixture: a store with a run of five tickets
from workbench_ui import review_view as view

RULES = ReviewRules(margin_below=0.2, unknown_option=True, disagree_with_expected=True)


@pytest.fixture
def queue(run):  # noqa: F811
    store, run_id, case_ids = run
    review.apply_rules(store, run_id, RULES)
    return store, run_id, case_ids, {(i["case_id"], i["question_id"]): i for i in store.list_review_items(run_id)}


def test_the_rules_form_reads_as_rules_and_says_what_it_selects(run):  # noqa: F811
    store, run_id, _ = run
    questions = SCHEMA["questions"]
    assert view.unknown_options_help(questions) == (
        "Options such as unknown / none of these / other / cannot tell: team: none_of_these")
    assert (view.margin_default(ReviewRules()), view.confidence_default(ReviewRules())) == (0.2, 0.5)
    assert view.confidence_default(ReviewRules(confidence_below=0.7)) == 0.7

    every = view.rules_from_form(questions, use_confidence=False, confidence=0.5, use_margin=True, margin=0.2,
                                 unknown=True, disagree=True, picked_questions=["urgent", "team"])
    assert every == RULES  # every question picked: all of them, also those a later version adds
    team_only = view.rules_from_form(questions, use_confidence=True, confidence=0.6, use_margin=False, margin=0.2,
                                     unknown=False, disagree=False, picked_questions=["team"])
    assert (team_only.confidence_below, team_only.margin_below, team_only.questions) == (0.6, None, ["team"])

    preview = review.preview(store, run_id, every)
    assert view.preview_summary(preview) == "These rules select **4 item(s)** in 4 case(s); **4 new** to the queue."
    assert view.preview_breakdown(preview) == (
        "margin: 2 · unknown option: 1 · disagrees with expected: 1 — per question: team 3, urgent 1")
    nothing = review.preview(store, run_id, ReviewRules(margin_below=None, confidence_below=None, unknown_option=False,
                                                        disagree_with_expected=False))
    assert view.preview_breakdown(nothing) is None


def test_progress_and_the_card_of_an_item_in_normal_and_blind_mode(queue):
    store, run_id, case_ids, items = queue
    progress = store.review_progress(run_id)
    assert view.progress_text(progress) == (
        "0 of 4 reviewed · 4 open · 0 skipped · 0 accepted · 0 corrected · 0 unknown")
    assert view.progress_fraction(progress) == 0.0

    item = items[(case_ids[3], "team")]  # answered billing, the gold label is tech
    shown = view.card(item, SCHEMA["questions"]["team"], "tech", blind=False)
    assert shown.title == f"### Case {case_ids[3]} · `team` (choice)"
    assert shown.question == "**Question:** Team?"
    assert "**Why queued:** answered 'billing', expected 'tech'" in shown.queued
    assert "Model **clef@abc** · schema **tickets v4**" in shown.queued and shown.queued.endswith("status open")
    assert shown.expected == "**Expected answer in the case set (gold label):** tech"
    assert (shown.accept, shown.accept_primary, shown.show_model) == ("Accept “billing”", False, True)

    blind = view.card(item, SCHEMA["questions"]["team"], "tech", blind=True)
    assert "**Why queued:** hidden in blind mode" in blind.queued and "billing" not in blind.queued
    assert (blind.accept, blind.accept_primary, blind.show_model) == (None, False, False)
    assert blind.answer_heading == "**Your answer:**"
    assert shown.keys.startswith("Keys: A accept · U unknown")
    # issue 36 point 5: blind hides the gold label too, and has no Accept button nor its key in the legend
    assert blind.expected is None
    assert "A accept" not in blind.keys and blind.keys.startswith("Keys: U unknown · S skip · Z undo · 1–9 your answer")
    agreeing = view.card(items[(case_ids[1], "team")], SCHEMA["questions"]["team"], None, blind=False)
    assert agreeing.accept_primary and agreeing.expected is None


def test_option_buttons_the_models_answer_is_no_correction_except_when_blind(queue):
    _, _, case_ids, items = queue
    item = items[(case_ids[4], "urgent")]
    buttons = view.option_buttons(item, blind=False, has_reviewer=True)
    assert [(b.text, b.label, b.disabled, b.shortcut) for b in buttons] == [
        ("true", True, True, "1"), ("false", False, False, "2")]
    assert not any(b.disabled for b in view.option_buttons(item, blind=True, has_reviewer=True))
    assert all(b.disabled for b in view.option_buttons(item, blind=True, has_reviewer=False))
    many = dict(item, distribution={f"o{n}": 0.1 for n in range(11)}, predicted="o0")
    assert [b.shortcut for b in view.option_buttons(many, blind=False, has_reviewer=True)][8:] == ["9", None, None]


def test_actions_gold_label_and_undo_say_what_happened(queue):
    store, run_id, case_ids, items = queue
    item = items[(case_ids[3], "team")]
    assert view.resolved_action(item, "correct", "billing", blind=True) == ("accept", None)
    assert view.resolved_action(item, "correct", "billing", blind=False) == ("correct", "billing")
    assert view.resolved_action(item, "correct", "tech", blind=True) == ("correct", "tech")

    gold = review.gold_conflict(item, "tech", "accept")
    asked = view.gold_question(item, "accept", None, gold)
    assert asked.warning == (f"The case set's expected answer is “tech”. Labelling case {case_ids[3]} · team "
                             "“billing” overrides that gold label in the reviewed labels and the golden set.")
    assert (asked.yes, asked.keep, asked.keep_action, asked.keep_label) == (
        "Yes, label it “billing”", "Keep “tech”", "correct", "tech")

    store.apply_review_action(item["id"], reviewer="ana", action="correct", label="tech",
                              expected_version=item["version"], comment="a refund is billing's, but not this one")
    assert view.saved_message(item, "correct", blind=True) == (
        f"Correct saved for case {case_ids[3]} · team. The model had answered “billing”.")
    done = store.get_review_item(item["id"])
    assert view.reviewed_note(done) == "This item was already reviewed: corrected as “tech” by ana."
    assert view.reviewed_note(items[(case_ids[1], "team")]) is None
    assert view.record_row(done, current=True, blind=False) == (
        "▶ `team` (choice)", "model: **billing** (0.80)", "corrected as “tech” by ana")
    assert view.record_row(done, current=False, blind=True)[:2] == ("`team` (choice)", "model: hidden")
    assert view.record_heading([done], case_ids[3]).startswith(f"**All 1 queued question(s) of case {case_ids[3]}**")

    log = view.audit_rows(store.list_review_actions(run_id=run_id))
    assert [(r["who"], r["action"], r["question"], r["comment"]) for r in log] == [
        ("ana", "correct", "team", "a refund is billing's, but not this one")]
    assert json.loads(log[0]["after"])["status"] == "corrected" and len(log[0]["when"]) == 23
    labels = view.label_rows(store.list_review_items(run_id))
    assert labels == [{"case_id": case_ids[3], "question_id": "team", "status": "corrected", "label": "tech",
                       "model_answer": "billing", "reviewer": "ana", "reason": "answered 'billing', expected 'tech'"}]
    exported = view.labels_csv(store.list_review_items(run_id))  # opens in Excel as UTF-8: a byte order mark first
    assert exported.startswith("\ufeffcase_id,question_id,status,label,model_answer,reviewer,reason\n")
    assert f"{case_ids[3]},team,corrected,tech,billing,ana" in exported

    undone = store.undo_last_action("ana", run_id=run_id)
    assert view.undone_message(undone) == f"Undone: case {case_ids[3]} · team is open again."
    assert view.label_rows(store.list_review_items(run_id)) == []


def test_runs_and_the_golden_set_are_named_for_people():
    run = {"id": 7, "case_set_name": "Tickets", "schema_name": "tickets", "schema_version": "4", "model_id": "clef",
           "done": 5, "errors": 1}
    assert view.run_label(run) == "#7 Tickets · tickets v4 · clef"
    all_failed, pending = dict(run, id=9, errors=5), dict(run, id=8, done=0, errors=0)
    # issue 36 point 8: a run whose every case failed is not offered (the rules could never select anything there)
    assert view.reviewable_runs([all_failed, pending, run]) == [run]
    assert view.nothing_to_review([all_failed, pending]) == (
        "No run has answers to review: every case failed in run #9 (the Runs page says why); run #8 has no results "
        "yet.")
    assert view.nothing_to_review([]) == "No run yet: start one on the Runs page; its answers are reviewed here."
    assert view.golden_name(run) == "Golden: Tickets (run 7)"
    assert view.golden_message(12, "Golden: Tickets (run 7)", 4) == (
        "Created case set #12 “Golden: Tickets (run 7)” with 4 cases. Open it on the Case sets page.")


def test_an_action_on_an_item_changed_since_it_was_shown_warns_and_a_bad_one_is_an_error(queue):
    store, run_id, case_ids, items = queue
    item = items[(case_ids[3], "team")]
    assert view.apply_action(store, item, "correct", "tech", reviewer="ana", comment=None, blind=False) == (
        "success", f"Correct saved for case {case_ids[3]} · team.")
    kind, message = view.apply_action(store, item, "accept", None, reviewer="bo", comment=None, blind=False)
    assert kind == "warning" and "changed" in message  # bo saw the version before ana's correction
    assert view.apply_action(store, store.get_review_item(item["id"]), "shrug", None, reviewer="bo", comment=None,
                             blind=False)[0] == "error"
    assert store.get_review_item(item["id"])["label"] == "tech"


def test_the_distribution_reads_raw_until_a_calibration_is_chosen(queue):
    store, run_id, case_ids, items = queue
    item = items[(case_ids[1], "team")]
    shown = view.distribution(store, item, SCHEMA["questions"]["team"], None)
    assert shown.heading == "**Model's distribution** (raw, as the run recorded it)" and shown.verdict is None
    assert shown.caption == "Answer **billing** · confidence 0.450 · margin 0.050"
    assert dict(zip(shown.table["option"], shown.table["probability"], strict=True)) == {
        "billing": 0.45, "tech": 0.40, "none_of_these": 0.15}
