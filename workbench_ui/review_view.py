"""What the Review page shows and says, without Streamlit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from clef_workbench import calibration, casesets, review
from clef_workbench.review import ReviewRules
from clef_workbench.store import ReviewConflictError, ReviewItem, Run, StoreError
from workbench_ui.answers import distribution_table
from workbench_ui.cases_view import when

MAX_SHORTCUT_OPTIONS = 9
MAX_OPTION_COLUMNS = 5
DEFAULT_MARGIN_BELOW = 0.2
DEFAULT_CONFIDENCE_BELOW = 0.5
OPEN = ("open", "skipped")  # statuses of an item still to review
REVIEWED = ("accepted", "corrected", "unknown")
NAME_FIRST = "Enter your name first: every action is recorded with it."
NAME_FIRST_FOR_UNDO = "Enter your name first: you can undo only your own actions."


def run_label(run: Run) -> str:
    return f"#{run['id']} {run['case_set_name']} · {run['schema_name']} v{run['schema_version']} · {run['model_id']}"


def reviewable_runs(runs: list[Run]) -> list[Run]:
    """The runs with at least one answer."""
    return [r for r in runs if r["done"] > r["errors"]]


def nothing_to_review(runs: list[Run]) -> str:
    """Why no run can be reviewed: none, every case failed, or no results yet."""
    if not runs:
        return "No run yet: start one on the Runs page; its answers are reviewed here."
    failed = [f"#{r['id']}" for r in runs if r["done"] and r["done"] == r["errors"]]
    waiting = [f"#{r['id']}" for r in runs if not r["done"]]
    reasons = ([f"every case failed in run {', '.join(failed)} (the Runs page says why)"] if failed else []) + \
        ([f"run {', '.join(waiting)} has no results yet"] if waiting else [])
    return f"No run has answers to review: {'; '.join(reasons)}."


def margin_default(saved: ReviewRules) -> float:
    return saved.margin_below if saved.margin_below is not None else DEFAULT_MARGIN_BELOW


def confidence_default(saved: ReviewRules) -> float:
    return saved.confidence_below if saved.confidence_below is not None else DEFAULT_CONFIDENCE_BELOW


def unknown_options_help(questions: dict[str, dict]) -> str:
    return ("Options such as unknown / none of these / other / cannot tell: "
            + "; ".join(f"{q}: {', '.join(sorted(ids))}" for q, spec in questions.items()
                        if (ids := review.unknown_options(spec))))


def rules_from_form(questions: dict[str, dict], *, use_confidence: bool, confidence: float, use_margin: bool,
                    margin: float, unknown: bool, disagree: bool, picked_questions: list[str],
                    calibration: str | None = None) -> ReviewRules:
    """The rules the form says; every question picked means every question."""
    return ReviewRules(confidence_below=confidence if use_confidence else None,
                       margin_below=margin if use_margin else None, unknown_option=unknown,
                       disagree_with_expected=disagree,
                       questions=None if set(picked_questions) == set(questions) else picked_questions,
                       calibration=calibration)


def preview_summary(preview: dict) -> str:
    return (f"These rules select **{preview['items']} item(s)** in {preview['cases']} case(s); "
            f"**{preview['new']} new** to the queue.")


def preview_breakdown(preview: dict) -> str | None:
    """How many items each rule and each question selects; None when the rules select nothing."""
    if not preview["items"]:
        return None
    return (" · ".join(f"{k}: {v}" for k, v in preview["by_rule"].items() if v) + " — per question: "
            + ", ".join(f"{k} {v}" for k, v in preview["by_question"].items()))


def progress_text(progress: dict) -> str:
    return (f"{progress['reviewed']} of {progress['total']} reviewed · {progress['open']} open · "
            f"{progress['skipped']} skipped · {progress['accepted']} accepted · {progress['corrected']} "
            f"corrected · {progress['unknown']} unknown")


def progress_fraction(progress: dict) -> float:
    return progress["reviewed"] / progress["total"] if progress["total"] else 0.0


def option_label(option: str) -> Any:
    """A distribution's option as the label an action records: yes/no answers as booleans."""
    return True if option == "true" else False if option == "false" else option


def resolved_action(item: ReviewItem, action: str, label: Any, *, blind: bool) -> tuple[str, Any]:
    """The action to record: in blind mode, choosing the model's own answer is accepting it."""
    if blind and action == "correct" and review.label_key(label) == item["predicted"]:
        return "accept", None
    return action, label


def saved_message(item: ReviewItem, action: str, *, blind: bool) -> str:
    seen = f" The model had answered “{item['predicted']}”." if blind else ""
    return f"{action.capitalize()} saved for case {item['case_id']} · {item['question_id']}.{seen}"


def undone_message(item: ReviewItem) -> str:
    return f"Undone: case {item['case_id']} · {item['question_id']} is {item['status']} again."


@dataclass(frozen=True)
class GoldQuestion:
    """The question asked before an answer against the case set's expected one (the gold label) is recorded."""

    warning: str
    yes: str  # records the reviewer's answer
    keep: str  # records the gold label instead
    keep_action: str
    keep_label: Any


def gold_question(item: ReviewItem, action: str, label: Any, gold: str) -> GoldQuestion:
    new = item["predicted"] if action == "accept" else review.label_key(label)
    keep_action = "accept" if gold == item["predicted"] else "correct"
    return GoldQuestion(
        f"The case set's expected answer is “{gold}”. Labelling case {item['case_id']} · {item['question_id']} "
        f"“{new}” overrides that gold label in the reviewed labels and the golden set.",
        f"Yes, label it “{new}”", f"Keep “{gold}”", keep_action, None if keep_action == "accept" else gold)


def outcome(item: ReviewItem) -> str:
    return (item["status"] + (f" as “{review.label_key(item['label'])}”" if item["label"] is not None else "")
            + (f" by {item['reviewer']}" if item["reviewer"] else ""))


def reviewed_note(item: ReviewItem) -> str | None:
    """Said above an item a link opened that was reviewed already; None for an item still open."""
    return None if item["status"] in OPEN else f"This item was already reviewed: {outcome(item)}."


@dataclass(frozen=True)
class Card:
    title: str
    question: str
    queued: str
    show_model: bool  # the distribution, the model's answer and the link to Decide (hidden in blind mode)
    expected: str | None  # the gold label line, when the case set has one and the review is not blind
    accept: str | None  # the Accept button; none in blind mode (choosing the model's answer there is accepting)
    accept_primary: bool
    answer_heading: str
    keys: str  # the legend of the keyboard shortcuts: only keys of buttons on screen


def card(item: ReviewItem, question: dict, expected: Any, *, blind: bool) -> Card:
    """One queue item as the reviewer sees it; blind hides the gold label and the model's answer."""
    reason = "hidden in blind mode" if blind else item["reason"]
    agrees = review.gold_conflict(item, expected, "accept") is None
    return Card(
        title=f"### Case {item['case_id']} · `{item['question_id']}` ({item['question_type']})",
        question=f"**Question:** {question.get('instructions') or item['question_id']}",
        queued=(f"**Why queued:** {reason}  \n"
                f"Model **{item['model_id']}** · schema **{item['schema_name']} v{item['schema_version']}**"
                f"  \nQueued {when(item['created_at'])} UTC · status {item['status']}"),
        show_model=not blind,
        expected=(None if expected is None or blind
                  else f"**Expected answer in the case set (gold label):** {review.label_key(expected)}"),
        accept=None if blind else f"Accept “{item['predicted']}”",
        accept_primary=agrees and not blind,
        answer_heading="**Your answer:**" if blind else "**Correct to:**",
        keys=("Keys: " + ("" if blind else "A accept · ") + "U unknown · S skip · Z undo · 1–9 "
              + ("your answer" if blind else "correct to that option") + ". Each action moves to this record's "
              "next open question, then to the next record (smallest margin first). An answer against the gold "
              "label asks first."),
    )


def answer_caption(answer: dict) -> str:
    """The answer under the distribution shown (review.shown_answer's): calibrated ones say so."""
    calibrated = answer["calibration"] is not None
    return (f"Answer **{answer['predicted']}** · {'calibrated ' if calibrated else ''}"
            f"confidence {answer['confidence']:.3f} · margin {answer['margin']:.3f}"
            + ("; choose raw above for the model's own" if calibrated else ""))


@dataclass(frozen=True)
class OptionButton:
    text: str
    label: Any  # what a correction to it records
    disabled: bool
    shortcut: str | None


def option_buttons(item: ReviewItem, *, blind: bool, has_reviewer: bool) -> list[OptionButton]:
    """A button per option to correct to; the model's own answer is no correction (except blind), keys 1–9."""
    return [OptionButton(option, option_label(option),
                         not has_reviewer or (option == item["predicted"] and not blind),
                         str(index + 1) if index < MAX_SHORTCUT_OPTIONS else None)
            for index, option in enumerate(item["distribution"])]


def record_heading(record: list[ReviewItem], case_id: int) -> str:
    return (f"**All {len(record)} queued question(s) of case {case_id}** — answer them here without reading the "
            "record again")


def record_row(other: ReviewItem, *, current: bool, blind: bool) -> tuple[str, str, str]:
    """One queued question of the record: which, the model's answer (hidden in blind mode), what became of it."""
    return (("▶ " if current else "") + f"`{other['question_id']}` ({other['question_type']})",
            "model: hidden" if blind else f"model: **{other['predicted']}** ({other['confidence']:.2f})",
            outcome(other))


def audit_rows(actions: list[dict]) -> list[dict[str, Any]]:
    return [{"#": a["id"], "when": when(a["at"], digits=23), "who": a["reviewer"], "action": a["action"],
             "case": a["case_id"], "question": a["question_id"], "comment": a.get("comment") or "",
             "before": json.dumps(a["before"]), "after": json.dumps(a["after"])} for a in actions]


def label_rows(items: list[dict]) -> list[dict[str, Any]]:
    """The reviewed labels export: one row per reviewed item (open and skipped ones are left out)."""
    return [{"case_id": i["case_id"], "question_id": i["question_id"], "status": i["status"],
             "label": review.label_key(i["label"]) if i["label"] is not None else "", "model_answer": i["predicted"],
             "reviewer": i["reviewer"], "reason": i["reason"]} for i in items if i["status"] in REVIEWED]


def labels_csv(items: list[dict]) -> str:
    """The reviewed labels as a CSV file Excel opens as UTF-8, with the columns of `label_rows` even when empty."""
    columns = ["case_id", "question_id", "status", "label", "model_answer", "reviewer", "reason"]
    return casesets.excel_csv(pd.DataFrame(label_rows(items), columns=columns))


def golden_name(run: dict) -> str:
    return f"Golden: {run['case_set_name']} (run {run['id']})"


def golden_message(golden_id: int, name: str, case_count: int) -> str:
    return f"Created case set #{golden_id} “{name}” with {case_count} cases. Open it on the Case sets page."


def apply_action(store: Any, item: ReviewItem, action: str, label: Any, *, reviewer: str, comment: str | None,
                 blind: bool) -> tuple[str, str]:
    """Record an action as of the version on screen: the message's kind and text."""
    try:
        store.apply_review_action(item["id"], reviewer=reviewer, action=action, label=label,
                                  expected_version=item["version"], comment=comment)
    except ReviewConflictError as exc:
        return "warning", str(exc)
    except (ValueError, StoreError) as exc:
        return "error", str(exc)
    return "success", saved_message(item, action, blind=blind)


@dataclass(frozen=True)
class Distribution:
    heading: str
    verdict: str | None  # how the calibration chosen did for this question, when it has a map for it
    table: pd.DataFrame  # answers.distribution_table's rows, for answers.probability_chart
    caption: str


def distribution(store: Any, item: ReviewItem, question: dict, chosen: str | None) -> Distribution:
    """The item's distribution as the run recorded it, or as the calibration `chosen` (a name) maps it."""
    answer = review.shown_answer(store, item, chosen)
    judged = calibration.verdicts(store.get_calibration(name=chosen)["payload"]).get(item["question_id"]) \
        if chosen else None
    fitted_on = answer["calibration"]
    if fitted_on is not None:
        heading = (f"**Calibrated distribution** · “{chosen}” (fitted on {fitted_on['model_id']}'s answers in run "
                   f"{fitted_on['run_id']})")
    else:
        heading = ("**Model's distribution** (raw, as the run recorded it)"
                   + (f" · “{chosen}” has no map for this question" if chosen and not judged else ""))
    return Distribution(heading, f"“{chosen}” for {item['question_id']}: {judged.reason}" if judged else None,
                        distribution_table(question, answer["distribution"], answer["predicted"]),
                        answer_caption(answer))
