"""Review queue rules: which answers of a run need a human, why (frozen at queue time), and the golden-set export.

An answer is queued when any enabled rule fires: its confidence (top-1 probability) is below a threshold, its
margin (top-1 − top-2) is below a threshold, the model chose an "unknown"-type option, it disagrees with the
case's expected answer, or it disagrees with another run of the same cases (another model or schema version). With a
calibration named, the confidence and margin rules read the calibrated distribution (the queued item keeps it). The
queue is ordered worst first: smallest margin (Store.list_review_items).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from clef_workbench import calibration
from clef_workbench.schemas import way_out_options
from clef_workbench.stats import answer_frame, predict
from clef_workbench.store import NewCase, NewReviewItem, ReviewItem, Run, Store
from clef_workbench.store.review import label_key


@dataclass
class ReviewRules:
    """Per-schema rules. A threshold of None disables that rule; `questions` None means every question."""

    confidence_below: float | None = None
    margin_below: float | None = 0.2
    unknown_option: bool = True
    disagree_with_expected: bool = True
    questions: list[str] | None = None
    calibration: str | None = None  # a stored calibration's name: thresholds apply to calibrated confidence
    disagree_with_run: int | None = None  # another run of the same case set: queue answers that differ


def load_rules(store: Store, schema_name: str) -> ReviewRules:
    """The saved rules for a schema, or the defaults; keys this workbench does not know are left out."""
    saved = store.get_review_rules(schema_name) or {}
    return ReviewRules(**{key: value for key, value in saved.items() if key in ReviewRules.__dataclass_fields__})


def save_rules(store: Store, schema_name: str, rules: ReviewRules) -> None:
    store.save_review_rules(schema_name, asdict(rules))


def unknown_options(question: dict) -> set[str]:
    """Ids of a choice question's unknown-type options (empty for noul and score questions): the options the schema
    lint accepts as a way out are exactly the ones this rule watches."""
    return set(way_out_options(question.get("criteria") or {})) if question.get("type") == "choice" else set()


def _reasons(row: Any, rules: ReviewRules, unknown_ids: set[str], other_answer: str | None) -> list[str]:
    reasons = []
    calibrated = "calibrated " if getattr(row, "calibrated", False) else ""
    if rules.margin_below is not None and row.margin < rules.margin_below:
        reasons.append(f"{calibrated}margin {row.margin:.3f} < {rules.margin_below:g}")
    if rules.confidence_below is not None and row.confidence < rules.confidence_below:
        reasons.append(f"{calibrated}confidence {row.confidence:.3f} < {rules.confidence_below:g}")
    if rules.unknown_option and row.predicted in unknown_ids:
        reasons.append(f"chose unknown-type option {row.predicted!r}")
    if rules.disagree_with_expected and isinstance(row.expected, str) and row.predicted != row.expected:
        reasons.append(f"answered {row.predicted!r}, expected {row.expected!r}")
    if other_answer is not None and row.predicted != other_answer:
        reasons.append(f"run {rules.disagree_with_run} answered {other_answer!r}")
    return reasons


def _calibrated(store: Store, frame: pd.DataFrame, calibration_name: str) -> pd.DataFrame:
    """The frame with each answer's distribution, prediction, confidence and margin read from the calibration."""
    maps = calibration.applied_maps(store.get_calibration(name=calibration_name)["payload"])
    distributions = [maps[q].apply(d) if q in maps else d
                     for q, d in zip(frame["question_id"], frame["distribution"], strict=True)]
    out = calibration.with_distributions(frame, distributions)
    out["calibrated"] = [q in maps for q in frame["question_id"]]  # a map not applied leaves the question raw
    return out


def _case_answers(store: Store, run: Run, case_id: int) -> pd.DataFrame:
    return answer_frame([r for r in store.list_results(run["id"]) if r["case_id"] == case_id], run["schema"])


def _other_run_answers(store: Store, run_id: int) -> dict[tuple[int, str], str]:
    other = store.get_run(run_id)
    frame = answer_frame(store.list_results(run_id), other["schema"])
    return {(int(c), q): p for c, q, p in zip(frame["case_id"], frame["question_id"], frame["predicted"],
                                              strict=True)}


def _review_item(run: Run, row: Any, reason: str) -> NewReviewItem:
    """The item to queue for one row of the run's answer frame, its reason, model and schema version frozen now."""
    return NewReviewItem(
        run_id=run["id"], case_id=int(row.case_id), question_id=row.question_id, question_type=row.question_type,
        distribution=row.distribution, predicted=row.predicted, confidence=float(row.confidence),
        margin=float(row.margin), reason=reason,
        model_id=run["model_id"] + (f"@{run['model_revision']}" if run["model_revision"] else ""),
        schema_name=run["schema_name"], schema_version=run["schema_version"])


def candidates(store: Store, run_id: int, rules: ReviewRules) -> list[NewReviewItem]:
    """The review items these rules would queue for a run (not yet written), worst first."""
    run = store.get_run(run_id)
    schema = run["schema"]
    frame = answer_frame(store.list_results(run_id), schema)
    if rules.calibration and not frame.empty:
        frame = _calibrated(store, frame, rules.calibration)
    other_answers = _other_run_answers(store, rules.disagree_with_run) if rules.disagree_with_run else {}
    items = []
    for row in frame.itertuples(index=False):
        if rules.questions is not None and row.question_id not in rules.questions:
            continue
        reasons = _reasons(row, rules, unknown_options(schema["questions"][row.question_id]),
                           other_answers.get((int(row.case_id), row.question_id)))
        if reasons:
            items.append(_review_item(run, row, "; ".join(reasons)))
    items.sort(key=lambda i: (i["margin"], i["confidence"]))
    return items


# the rule each part of a reason (`_reasons`) comes from, by how the part starts
RULE_OF_REASON = {"margin": "margin", "confidence": "confidence", "chose": "unknown option",
                  "answered": "disagrees with expected", "run ": "disagrees with another run"}


def preview(store: Store, run_id: int, rules: ReviewRules) -> dict[str, Any]:
    """How many items these rules would queue: total, new (not queued before), distinct cases, and counts per
    question and per rule."""
    items = candidates(store, run_id, rules)
    queued = {(i["case_id"], i["question_id"]) for i in store.list_review_items(run_id)}
    by_rule = dict.fromkeys(RULE_OF_REASON.values(), 0)
    for item in items:
        for part in item["reason"].split("; "):
            by_rule[next(rule for start, rule in RULE_OF_REASON.items()
                         if part.removeprefix("calibrated ").startswith(start))] += 1
    return {
        "items": len(items),
        "new": sum((i["case_id"], i["question_id"]) not in queued for i in items),
        "cases": len({i["case_id"] for i in items}),
        "by_question": pd.Series([i["question_id"] for i in items], dtype=object).value_counts().to_dict(),
        "by_rule": by_rule,
    }


def apply_rules(store: Store, run_id: int, rules: ReviewRules) -> int:
    """Queue the items the rules select, freezing each one's reason, distribution, model and schema version now.
    Items already queued are kept as they are. Returns how many were added."""
    return store.queue_review_items(candidates(store, run_id, rules))


def gold_conflict(item: ReviewItem, expected: Any, action: str, label: Any = None) -> str | None:
    """The case set's expected answer (the gold label) that this action would contradict, or None. accept labels
    the item with the model's answer, correct with `label`; unknown and skip give no label."""
    if expected is None or action not in ("accept", "correct"):
        return None
    new = item["predicted"] if action == "accept" else label
    return None if label_key(new) == label_key(expected) else label_key(expected)


OPENED_FROM_LINK = "opened from a link"


def item_for_link(store: Store, run_id: int, case_id: int, question_id: str | None) -> ReviewItem | None:
    """The review item a link names: the queued item of this case and question (without one, the case's first),
    else a new item for that answer, queued with the reason "opened from a link". None when the run has no answer
    for it (no such case or question, or its case failed): nothing else is opened in its place."""
    queued = [i for i in record_items(store, run_id, case_id) if question_id is None or i["question_id"] == question_id]
    if queued:
        return queued[0]
    run = store.get_run(run_id)
    frame = _case_answers(store, run, case_id)
    rows = frame if question_id is None else frame[frame["question_id"] == question_id]
    if rows.empty:
        return None
    row = next(rows.itertuples(index=False))
    store.queue_review_items([_review_item(run, row, OPENED_FROM_LINK)])
    return next(i for i in record_items(store, run_id, case_id) if i["question_id"] == row.question_id)


def shown_answer(store: Store, item: ReviewItem, calibration_name: str | None = None) -> dict:
    """What the card of `item` shows: the answer's distribution as the run recorded it (the item's frozen copy if
    the run no longer has it), or that calibration's map of it when it has one for the question; `calibration` is
    the stored calibration, None when the numbers are raw."""
    frame = _case_answers(store, store.get_run(item["run_id"]), item["case_id"])
    rows = frame[frame["question_id"] == item["question_id"]]
    raw = rows["distribution"].iloc[0] if not rows.empty else item["distribution"]
    stored, distribution = None, raw
    if calibration_name:
        stored = store.get_calibration(name=calibration_name)
        question = calibration.applied_maps(stored["payload"]).get(item["question_id"])
        if question is None or question.question_type != item["question_type"]:
            stored = None  # the calibration has no map for this question: raw, and said so by `calibration` None
        else:
            distribution = question.apply(raw)
    predicted, confidence, margin = predict(item["question_type"], distribution)
    return {"distribution": distribution, "predicted": predicted, "confidence": float(confidence), "margin": margin,
            "calibration": stored}


def record_items(store: Store, run_id: int, case_id: int) -> list[ReviewItem]:
    """Every queued item of one record (case) of a run, in the schema's question order, so a reviewer reads the
    record once and answers all its questions on one screen."""
    order = {q: i for i, q in enumerate(store.get_run(run_id)["schema"]["questions"])}
    items = [i for i in store.list_review_items(run_id) if i["case_id"] == case_id]
    return sorted(items, key=lambda i: order.get(i["question_id"], len(order)))


def next_item(store: Store, run_id: int, *, after_item_id: int | None = None,
              case_id: int | None = None) -> ReviewItem | None:
    """The next item to review. With `case_id`, first the record's own open items (the reviewer has just read
    that record); then the worst open item; if none, the worst skipped one (skipping `after_item_id`, so skip
    moves on)."""
    if case_id is not None:
        for item in record_items(store, run_id, case_id):
            if item["status"] == "open" and item["id"] != after_item_id:
                return item
    for statuses in (("open",), ("skipped",)):
        for item in store.list_review_items(run_id, statuses=statuses):
            if item["id"] != after_item_id:
                return item
    return None


def export_golden_set(store: Store, run_id: int, name: str) -> int:
    """A new case set of every case with at least one accepted or corrected item, whose expected answers are the
    reviewed labels (the case's own for questions nobody reviewed). Items marked unknown give no label but a tag
    `unknown:<question>`. Media are copied."""
    run = store.get_run(run_id)
    items = [i for i in store.list_review_items(run_id) if i["status"] in ("accepted", "corrected", "unknown")]
    if not any(i["status"] in ("accepted", "corrected") for i in items):
        raise ValueError(f"run {run_id} has no accepted or corrected review items to export")
    by_case: dict[int, list[ReviewItem]] = {}
    for item in items:
        by_case.setdefault(item["case_id"], []).append(item)
    cases: list[NewCase] = []
    for case_id, case_items in by_case.items():
        labels = {i["question_id"]: label for i in case_items
                  if i["status"] in ("accepted", "corrected") and (label := i["label"]) is not None}
        if not labels:
            continue
        case = store.get_case(case_id)
        expected = dict(case["expected"])
        for unknown in (i["question_id"] for i in case_items if i["status"] == "unknown"):
            expected.pop(unknown, None)
        expected.update(labels)
        tags = list(dict.fromkeys(case["tags"] + ["golden"] + [f"unknown:{i['question_id']}" for i in case_items
                                                               if i["status"] == "unknown"]))
        cases.append(NewCase(state=case["state"], expected=expected, tags=tags,
                             images=[m["data"] for m in case["images"]], videos=[m["data"] for m in case["videos"]]))
    # the library slug the run was started with, so the golden set maps its expected answers on re-import
    case_set_id = store.create_case_set(
        name, schema_name=run["settings"].schema_slug or run["schema_name"],
        description=f"Golden set reviewed from run {run_id} ({run['case_set_name']}, schema {run['schema_name']} "
                    f"v{run['schema_version']}, model {run['model_id']})")
    try:
        store.add_cases(case_set_id, cases)
    except Exception:
        store.delete_case_set(case_set_id)  # no half-made golden set left behind
        raise
    return case_set_id
