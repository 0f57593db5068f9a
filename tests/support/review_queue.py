"""A store holding one run of five tickets to review (the `run` fixture), each chosen to trip one review rule, under a
schema of a choice and a yes/no question (`SCHEMA`)."""

from __future__ import annotations

import pytest

from clef_workbench.store import Store

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
SCHEMA = {"name": "tickets", "version": "4", "questions": {
    "team": {"type": "choice", "instructions": "Team?",
             "criteria": {"billing": "Money", "tech": "Bugs", "none_of_these": "Spam or anything else"}},
    "urgent": {"type": "noul", "instructions": "Urgent?"},
}}


def response(team: dict[str, float], p_urgent: float) -> dict:
    best = max(team, key=team.get)
    return {"answers": {"team": {"type": "choice", "choice": best, "confidence": team[best], "probabilities": team},
                        "urgent": {"type": "noul", "noul": p_urgent}}}


@pytest.fixture
def run(tmp_path):
    store = Store(tmp_path / "w.db")
    set_id = store.create_case_set("tickets")
    cases = [
        # team distribution, P(urgent), expected
        ({"billing": 0.9, "tech": 0.05, "none_of_these": 0.05}, 0.95, {"team": "billing", "urgent": True}),  # fine
        ({"billing": 0.45, "tech": 0.40, "none_of_these": 0.15}, 0.9, {}),  # team margin 0.05
        ({"billing": 0.1, "tech": 0.2, "none_of_these": 0.7}, 0.1, {}),  # chose the unknown-type option
        ({"billing": 0.8, "tech": 0.15, "none_of_these": 0.05}, 0.85, {"team": "tech"}),  # disagrees
        ({"billing": 0.6, "tech": 0.3, "none_of_these": 0.1}, 0.55, {}),  # urgent margin 0.1
    ]
    case_ids = store.add_cases(set_id, [{"state": {"n": i}, "expected": exp, "images": [PNG] if i == 1 else None}
                                        for i, (_, _, exp) in enumerate(cases)])
    run_id = store.create_run(set_id, schema=SCHEMA, model_id="clef", model_revision="abc")
    store.record_results(run_id, [{"case_id": cid, "response": response(team, p), "latency_ms": 5}
                                  for cid, (team, p, _) in zip(case_ids, cases, strict=True)])
    return store, run_id, case_ids
