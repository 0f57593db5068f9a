"""Review rules, preview counts, worst-first queue, frozen reasons and the golden-set export."""

from __future__ import annotations

import pytest

from clef_workbench import review
from clef_workbench.review import ReviewRules
from tests.support.review_queue import SCHEMA
from tests.support.review_queue import run as run  # noqa: F401 - the fixture: a store with a run of five tickets


def test_unknown_type_options_are_detected():
    assert review.unknown_options(SCHEMA["questions"]["team"]) == {"none_of_these"}
    other = {"type": "choice", "criteria": {"cat": "A cat", "dog": "A dog", "x": "Cannot tell from the photo"}}
    assert review.unknown_options(other) == {"x"}
    assert review.unknown_options(SCHEMA["questions"]["urgent"]) == set()


def test_preview_counts_before_applying_and_apply_freezes_reasons(run):
    store, run_id, case_ids = run
    rules = ReviewRules(margin_below=0.2, unknown_option=True, disagree_with_expected=True)
    counts = review.preview(store, run_id, rules)
    # team margin 0.05 (case 1), unknown (case 2), disagreement (case 3), urgent margin 0.1 (case 4)
    assert counts["items"] == 4 and counts["new"] == 4 and counts["cases"] == 4
    assert counts["by_question"] == {"team": 3, "urgent": 1}
    assert counts["by_rule"] == {"margin": 2, "confidence": 0, "unknown option": 1, "disagrees with expected": 1,
                                  "disagrees with another run": 0}
    assert store.list_review_items(run_id) == []  # preview wrote nothing

    # margin < 0.4 alone: team 0.05 (case 1) and 0.3 (case 4), urgent 0.1 (case 4)
    assert review.preview(store, run_id, ReviewRules(margin_below=0.4, unknown_option=False,
                                                     disagree_with_expected=False))["items"] == 3

    assert review.apply_rules(store, run_id, rules) == 4
    queue = store.list_review_items(run_id)
    assert [(i["case_id"], i["question_id"]) for i in queue] == [
        (case_ids[1], "team"), (case_ids[4], "urgent"), (case_ids[2], "team"), (case_ids[3], "team")]
    assert queue[0]["reason"] == "margin 0.050 < 0.2"
    assert queue[2]["reason"] == "chose unknown-type option 'none_of_these'"
    assert queue[3]["reason"] == "answered 'billing', expected 'tech'"
    assert queue[0]["model_id"] == "clef@abc" and queue[0]["schema_version"] == "4"
    assert queue[1]["distribution"] == {"true": 0.55, "false": pytest.approx(0.45)}

    # a stricter rule later adds new items but leaves the frozen reasons of queued ones alone
    assert review.apply_rules(store, run_id, ReviewRules(confidence_below=0.99)) > 0
    again = {(i["case_id"], i["question_id"]): i["reason"] for i in store.list_review_items(run_id)}
    assert again[(case_ids[1], "team")] == "margin 0.050 < 0.2"


def test_rules_are_saved_per_schema(run):
    store, _, _ = run
    assert review.load_rules(store, "tickets") == ReviewRules()
    review.save_rules(store, "tickets", ReviewRules(confidence_below=0.6, margin_below=None, questions=["team"]))
    assert review.load_rules(store, "tickets").confidence_below == 0.6
    assert review.load_rules(store, "other") == ReviewRules()


def test_next_item_skips_and_golden_set_export(run):
    store, run_id, case_ids = run
    review.apply_rules(store, run_id, ReviewRules(margin_below=0.2))
    first = review.next_item(store, run_id)
    assert first["case_id"] == case_ids[1]
    store.apply_review_action(first["id"], reviewer="ana", action="skip", expected_version=first["version"])
    second = review.next_item(store, run_id)
    assert second["id"] != first["id"] and second["status"] == "open"
    store.apply_review_action(second["id"], reviewer="ana", action="correct", label=True,
                              expected_version=second["version"])
    third = review.next_item(store, run_id)
    store.apply_review_action(third["id"], reviewer="ana", action="unknown", expected_version=third["version"])
    # skipped items come back after the open ones are done
    fourth = review.next_item(store, run_id)
    store.apply_review_action(fourth["id"], reviewer="ben", action="accept", expected_version=fourth["version"])
    assert review.next_item(store, run_id)["id"] == first["id"]
    assert store.review_progress(run_id) == {"open": 0, "accepted": 1, "corrected": 1, "unknown": 1, "skipped": 1,
                                             "total": 4, "reviewed": 3}

    golden_id = review.export_golden_set(store, run_id, "tickets golden")
    golden = store.list_cases(golden_id)
    by_state = {c["state"]["n"]: c for c in golden}
    assert set(by_state) == {3, 4}  # the unknown-only and skipped cases carry no label
    assert by_state[4]["expected"] == {"urgent": True}
    assert by_state[3]["expected"] == {"team": "billing"}  # accepted the model's answer over the old expectation
    assert "golden" in by_state[3]["tags"]
    assert store.get_case_set(golden_id)["schema_name"] == "tickets"
    with pytest.raises(Exception, match="already exists"):
        review.export_golden_set(store, run_id, "tickets golden")


def test_gold_conflict_names_the_expected_answer_an_action_would_contradict():
    item = {"predicted": "billing"}
    assert review.gold_conflict(item, "tech", "accept") == "tech"
    assert review.gold_conflict(item, "billing", "accept") is None
    assert review.gold_conflict(item, "billing", "correct", "tech") == "billing"
    assert review.gold_conflict(item, None, "accept") is None, "no gold label: nothing to overwrite"
    assert review.gold_conflict(item, "tech", "skip") is None and review.gold_conflict(item, "tech", "unknown") is None
    assert review.gold_conflict({"predicted": "true"}, True, "accept") is None
    assert review.gold_conflict({"predicted": "2"}, 2, "accept") is None
    assert review.gold_conflict({"predicted": "false"}, True, "correct", False) == "true"


def test_golden_set_keeps_the_library_schema_the_run_used(run):
    store, run_id = run[0], run[1]
    with store._write() as conn:  # a run started from the library records the schema's slug in its settings
        conn.execute("UPDATE runs SET settings_json = ? WHERE id = ?", ('{"schema_slug": "ticket-routing"}', run_id))
    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0))
    item = store.list_review_items(run_id)[0]
    store.apply_review_action(item["id"], reviewer="ana", action="accept", expected_version=item["version"])
    golden_id = review.export_golden_set(store, run_id, "golden")
    assert store.get_case_set(golden_id)["schema_name"] == "ticket-routing"


def test_a_record_is_reviewed_whole_before_the_next_one(run):
    store, run_id, case_ids = run
    review.apply_rules(store, run_id, ReviewRules(margin_below=1.0, unknown_option=False,
                                                  disagree_with_expected=False))
    record = review.record_items(store, run_id, case_ids[4])
    assert [i["question_id"] for i in record] == ["team", "urgent"], "the schema's question order"
    worst = review.next_item(store, run_id)
    assert worst["case_id"] != case_ids[4], "the record is not the worst one: staying on it is a choice"
    done = record[1]
    store.apply_review_action(done["id"], reviewer="ana", action="unknown", expected_version=done["version"])
    following = review.next_item(store, run_id, after_item_id=done["id"], case_id=case_ids[4])
    assert following["id"] == record[0]["id"], "the same record's open question comes next"
    store.apply_review_action(following["id"], reviewer="ana", action="unknown",
                              expected_version=following["version"])
    assert review.next_item(store, run_id, case_id=case_ids[4])["id"] == worst["id"], "then the worst elsewhere"
