"""Runs to compare, recorded as the store returns them (no model run).

Runs A and B answer the same four cases (ids 101–104, case-set positions 0–3) under one schema; run C uses a newer
schema version without the `tone` question and failed on case 104.

    case  expected      A: P(spam)  A: tone (a/b)  B: P(spam)  B: tone   C: P(spam)
    101   true,  a      0.9 → T     .7/.3 → a      0.8 → T     .6/.4 a   0.9 → T
    102   false, a      0.2 → F     .4/.6 → b      0.3 → F     .9/.1 a   0.1 → F
    103   false, b      0.6 → T     .8/.2 → a      0.3 → F     .55/.45 a 0.9 → T
    104   true,  b      0.4 → F     .1/.9 → b      0.7 → T     .2/.8 b   error
    latency (ms)        10 20 30 40                100 × 4                5 × 3

And the grid the browser tests draw: three cases, two runs (`GRID_…`, answers built by `grid_response`).
"""

from __future__ import annotations

from clef_workbench import compare

SCHEMA = {"name": "triage", "version": "1", "questions": {
    "spam": {"type": "noul", "instructions": "Is it spam?"},
    "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"a": None, "b": None}},
}}
SCHEMA_V2 = {"name": "triage", "version": "2", "questions": {"spam": SCHEMA["questions"]["spam"]}}
CASES = [101, 102, 103, 104]
EXPECTED = [{"spam": True, "tone": "a"}, {"spam": False, "tone": "a"}, {"spam": False, "tone": "b"},
            {"spam": True, "tone": "b"}]


def response(p_spam: float, p_a: float | None = None) -> dict:
    answers = {"spam": {"type": "noul", "noul": p_spam}}
    if p_a is not None:
        choice = "a" if p_a >= 0.5 else "b"
        answers["tone"] = {"type": "choice", "choice": choice, "confidence": max(p_a, 1 - p_a),
                           "probabilities": {"a": p_a, "b": round(1 - p_a, 4)}}
    return {"model": "m", "answers": answers, "usage": {"input_tokens": 10, "output_tokens": 0}}


def make_run(run_id: int, schema: dict, spam: list, tone: list | None, latency: list, errors: dict | None = None,
             case_set_id: int = 7) -> compare.RunData:
    results = []
    for position, case_id in enumerate(CASES):
        result = {"case_id": case_id, "position": position, "expected": EXPECTED[position], "state": f"case {case_id}",
                  "latency_ms": latency[position], "error": None, "response": None,
                  "started_at": "2026-12-01T00:00:00.000+00:00", "finished_at": "2026-12-01T00:00:01.000+00:00"}
        if errors and case_id in errors:
            result.update(error=errors[case_id], latency_ms=None)
        else:
            result["response"] = response(spam[position], tone[position] if tone else None)
        results.append(result)
    run = {"id": run_id, "case_set_id": case_set_id, "schema": schema, "schema_name": schema["name"],
           "schema_version": schema["version"], "model_id": f"/models/model-{run_id}"}
    return compare.RunData(run, results)


RUN_A = make_run(1, SCHEMA, [0.9, 0.2, 0.6, 0.4], [0.7, 0.4, 0.8, 0.1], [10, 20, 30, 40])
RUN_B = make_run(2, SCHEMA, [0.8, 0.3, 0.3, 0.7], [0.6, 0.9, 0.55, 0.2], [100, 100, 100, 100])
RUN_C = make_run(3, SCHEMA_V2, [0.9, 0.1, 0.9, None], None, [5, 5, 5, None],
                 errors={104: "TokenBudgetError: too long"})


GRID_SCHEMA = {"name": "triage", "version": "1", "questions": {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "options": {"billing": "Money", "tech": "Broken"}}}}
GRID_CASES = [("Refund now\nMy card was charged twice.", {"urgent": True, "team": "billing"}),
              ("App crashes", {"urgent": False, "team": "tech"}),
              ("Hello", {"urgent": True, "team": "tech"})]
# Per run, per case: (P(urgent), P(billing)). Against the expected answers above each run's cells read, row by row
# and left to right (urgent #1, urgent #2, team #1, team #2): pass pass pass fail / pass fail pass pass /
# fail pass fail pass.
GRID_ANSWERS = {"model-a": [(0.9, 0.8), (0.2, 0.3), (0.3, 0.7)], "model-b": [(0.6, 0.4), (0.7, 0.1), (0.8, 0.2)]}


def grid_response(p_urgent: float, p_billing: float) -> dict:
    team = "billing" if p_billing >= 0.5 else "tech"
    return {"model": "m", "usage": {"input_tokens": 10, "output_tokens": 0}, "answers": {
        "urgent": {"type": "noul", "noul": p_urgent},
        "team": {"type": "choice", "choice": team, "confidence": max(p_billing, 1 - p_billing),
                 "probabilities": {"billing": p_billing, "tech": round(1 - p_billing, 4)}}}}
