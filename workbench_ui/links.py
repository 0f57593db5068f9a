"""Links from one page to another that a person can also send: a case of a run opened in Decide or in Review."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.store import StoreError
from workbench_ui import decide_model, schema_rows, state_input

# Decide's max_length choices, 512 to 262,144: a list cannot be mistyped to a value that refuses every request
DECIDE_MAX_LENGTHS = [2 ** power for power in range(9, 19)]
MISSING_LINKS_SHOWN = 20


@dataclass(frozen=True)
class Missing:
    """A link to something that is not there: the message, links to what exists (the first few) and the first one."""

    message: str
    param: str
    links: list[tuple[str, str]] = field(default_factory=list)
    more: int = 0
    first_id: int | None = None
    first_label: str = ""


def missing(what: str, asked: Any, ids: list[int], label: Any, *, param: str) -> Missing:
    """The "not found" of a link whose `param` names `asked`, a `what` not among `ids`."""
    there = ("There is 1: pick it below." if len(ids) == 1 else f"There are {len(ids):,}: pick one below." if ids
             else f"There is no {what} yet.")
    shown = [(str(label(i)), "?" + urlencode({param: i})) for i in ids[:MISSING_LINKS_SHOWN]]
    return Missing(f"Not found: the link asks for {what} {asked!s}, which does not exist here (deleted, mistyped, or "
                   f"in another workbench). {there}", param, shown, max(0, len(ids) - MISSING_LINKS_SHOWN),
                   ids[0] if ids else None, str(label(ids[0])) if ids else "")


def missing_review_item(run_id: int, case_id: Any, question_id: str | None, items: list[dict]) -> Missing:
    """The "not found" of a Review link whose run has no answer for that case and question."""
    asked = f"case {case_id}" + (f" · question {question_id}" if question_id else "") + f" of run #{run_id}"
    there = f"Its review queue has {len(items)} item(s):" if items else "Its review queue is empty."
    shown = [(f"case {i['case_id']} · {i['question_id']} ({i['status']})",
              review_url(run_id, i["case_id"], i["question_id"])) for i in items[:MISSING_LINKS_SHOWN]]
    return Missing(f"Not found: the link asks for {asked}, which has no answer in that run (no such case or "
                   f"question, or the case failed). {there}", "case", shown,
                   max(0, len(items) - MISSING_LINKS_SHOWN))


def missing_schema(asked: str, slugs: list[str], picker: str) -> str:
    """The "not found" of a link to a library schema (?schema=) that is not in the library; `picker` names where the
    page lets a person open another."""
    there = ("The library has: " + ", ".join(f"“{s}”" for s in slugs) + f" (open one with {picker})."
             if slugs else "The library is empty.")
    return f"Not found: the link asks for the schema “{asked}”, which is not in the library. {there}"


def decide_url(run_id: int, case_id: int) -> str:
    """Decide (the default page, at the root) with this case of this run on screen."""
    return "/?" + urlencode({"run": run_id, "case": case_id})


def review_url(run_id: int, case_id: int, question_id: str) -> str:
    return "/review?" + urlencode({"run": run_id, "case": case_id, "question": question_id})


def linked_ids(params: Any) -> tuple[int, int] | None:
    """(run id, case id) from query parameters, or None when the link names no case (or not as numbers)."""
    run_id, case_id = str(params.get("run")), str(params.get("case"))  # "None" when missing: no digits
    return (int(run_id), int(case_id)) if run_id.isdigit() and case_id.isdigit() else None


def _draft(library: SchemaLibrary, case: dict[str, Any], schema: dict[str, Any], slug: str | None) -> dict[str, Any]:
    """A Decide draft of `case` with `schema`'s questions, the library schema `slug` its identity if unchanged."""
    library_schema = library.load(slug) if slug and library.exists(slug) else None
    same = library_schema is not None and library_schema.to_dict()["questions"] == schema["questions"]
    return {
        "state_text": state_input.state_to_text(case["state"]),
        "state_mode": "text" if isinstance(case["state"], str) else "json",
        "schema_name": schema.get("name", ""),
        "schema_description": schema.get("description", ""),
        "rows": schema_rows.questions_to_rows(schema["questions"]),
        "loaded_slug": slug if same else None,
        "loaded_questions": library_schema.questions if same else None,
        "examples": library_schema.examples if same else None,
    }


def case_draft(store: Any, library: SchemaLibrary, run_id: int, case_id: int, *,
               random_weights: Callable[[str], bool] = lambda model: False) -> tuple[dict[str, Any] | None, str]:
    """A Decide draft of a run's case as the run asked it, with its answer, and what is on screen (or why not)."""
    try:
        run = store.get_run(run_id)
        case = store.get_case(case_id, with_media=False)
    except StoreError as exc:
        return None, f"The link names case #{case_id} of run #{run_id}, which is not in this workbench: {exc}."
    if case["case_set_id"] != run["case_set_id"]:
        return None, f"The link names case #{case_id}, which is not in run #{run_id}'s case set."
    frozen = run["schema"]
    settings = run["settings"]
    slug = run["schema_slug"] or settings.schema_slug
    draft = _draft(library, case, frozen, slug)
    same = draft["loaded_slug"] is not None
    draft["overflow"] = settings.overflow
    draft["model"] = run["model_id"]  # Decide runs it again on the run's model while that is loaded
    if settings.max_length in DECIDE_MAX_LENGTHS:
        draft["max_length"] = settings.max_length
    answered = next((r["response"] for r in store.list_results(run_id) if r["case_id"] == case_id
                     and r.get("response")), None)
    if answered is not None and not case["image_count"] + case["video_count"]:
        draft["result"] = decide_model.result_entry(decide_model.DecideResult(  # the run's answer, as Decide keeps one
            request={"questions": frozen["questions"], "model": run["model_id"]}, response=answered,
            questions=frozen["questions"], state=case["state"], images=(), videos=(),
            schema_name=frozen.get("name", ""), model_label=run["model_id"], device=settings.device or "",
            schema_slug=slug if same else None, random_weights=random_weights(run["model_id"]),
            max_length=settings.max_length, overflow=settings.overflow))
    where = (f"the schema “{slug}”" if same else
             f"the questions run #{run_id} used ({frozen.get('name', '?')} v{frozen.get('version', '?')}, "
             "not saved in the library as they are)")
    note = f"Case #{case_id} of run #{run_id} ({run['case_set_name']}) with {where}" + (
        "; the answers below are the run's." if "result" in draft else ".")
    if media := [f"{case[kind + '_count']} {kind}(s)" for kind in ("image", "video") if case[kind + "_count"]]:
        note += (f" Its {' and '.join(media)} are not attached here (Decide takes media from uploads): open the "
                 "case in Review to see them.")
    return draft, note


def sweep_url(sweep_id: int) -> str:
    return "/sweeps?" + urlencode({"sweep": sweep_id})


def sweep_decide_url(sweep_id: int, variant: str, case_id: int) -> str:
    """Decide with this case of a sweep asked with one variant's questions."""
    return "/?" + urlencode({"sweep": sweep_id, "variant": variant, "case": case_id})


def linked_sweep_case(params: Any) -> tuple[int, str, int] | None:
    """(sweep id, variant, case id) from query parameters, or None when the link names no case of a sweep."""
    sweep_id, variant, case_id = str(params.get("sweep")), params.get("variant"), str(params.get("case"))
    return (int(sweep_id), str(variant), int(case_id)) if variant and sweep_id.isdigit() and case_id.isdigit() else None


def sweep_case_draft(store: Any, library: SchemaLibrary, sweep_id: int, variant: str,
                     case_id: int) -> tuple[dict[str, Any] | None, str]:
    """A Decide draft of a sweep's case asked with one variant's questions, and what is on screen (or why nothing)."""
    from clef_workbench import sweeps

    try:
        sweep = sweeps.load_sweep(store, sweep_id)
        case = store.get_case(case_id, with_media=False)
    except (StoreError, sweeps.SweepError) as exc:
        return None, f"The link names case #{case_id} of sweep #{sweep_id}, which is not in this workbench: {exc}."
    schema = next((s.variant.schema for s in sweep.variants if s.variant.name == variant), None)
    if schema is None:
        return None, f"Sweep #{sweep_id} has no variant “{variant}”."
    if case["case_set_id"] != sweep.case_set_id:
        return None, f"The link names case #{case_id}, which is not in sweep #{sweep_id}'s case set."
    draft = _draft(library, case, schema, sweep.settings.get("schema_slug"))
    return draft, (f"Case #{case_id} of sweep #{sweep_id} ({sweep.case_set_name}) with the questions of its variant "
                   f"“{variant}”: Run asks them again.")
