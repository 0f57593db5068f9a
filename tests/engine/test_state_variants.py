"""A sweep's variants of one state (Engine.decide_variants), and a re-run's records over their cached states, continue
from them as packs: one backbone forward per pack of up to `bulk_batch_tokens` new tokens, each record answering as
it does alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

QUESTIONS = [
    {"team": {"type": "choice", "instructions": "Which team should handle the ticket?",
              "criteria": {"billing": "Invoices and payments.", "tech": "Bugs and outages.", "sales": "Purchases."}}},
    {"team": {"type": "choice", "instructions": "Route the ticket.",
              "criteria": {"tech": "Bugs and outages.", "billing": "Invoices and payments."}}},
    {"urgent": {"type": "noul", "instructions": "Is the ticket urgent?"}},
    {"urgent": {"type": "noul", "instructions": "Must someone answer within the hour?"},
     "mood": {"type": "score", "instructions": "How upset is the customer?",
              "criteria": ["calm", "annoyed", "furious"]}},
    {"team": {"type": "choice", "instructions": "Which team?",
              "criteria": {"sales": "New purchases.", "billing": "Invoices.", "tech": "Outages.", "unknown": "None."}}},
]
STATE = {"subject": "charged twice", "body": "I was charged twice for my subscription and the app crashes. " * 6}


@pytest.fixture
def forwards_after_a_state(tiny_engine, monkeypatch):
    """The new-token counts of every backbone forward that continues after a cached state."""
    seen: list[int] = []
    backbone = tiny_engine.runner.backbone
    forward = backbone.forward

    def counting(input_ids, segments, **kwargs):
        if kwargs.get("prefixes") is not None:
            seen.append(int(input_ids.shape[0]))
        return forward(input_ids, segments, **kwargs)

    monkeypatch.setattr(backbone, "forward", counting)
    return seen


@pytest.fixture
def head_calls(tiny_engine, monkeypatch):
    """How many times the head ran (each call ends in one host sync)."""
    calls: list[int] = []
    head = tiny_engine.runner.head
    decide = head.decide_from_memory

    def counting(*args, **kwargs):
        calls.append(1)
        return decide(*args, **kwargs)

    monkeypatch.setattr(head, "decide_from_memory", counting)
    return calls


def requests() -> list[dict]:
    return [{"state": STATE, "questions": questions} for questions in QUESTIONS]


@pytest.mark.parametrize("pack_tokens", [None, 250])
def test_the_variants_of_a_state_run_as_packs_and_answer_as_each_alone(tiny_engine, forwards_after_a_state,
                                                                       head_calls, monkeypatch, pack_tokens):
    runner = tiny_engine.runner
    if pack_tokens is not None:  # small packs: the variants split over several forwards
        monkeypatch.setattr(runner, "config", dataclasses.replace(runner.config, bulk_batch_tokens=pack_tokens))
    runner.state_cache.clear()
    shared = tiny_engine.decide_variants(requests(), probabilities=True)
    records = [tiny_engine.encode(r) for r in requests()]
    state_length = records[0].state_end
    new_tokens = [len(r) - state_length for r in records[1:]]  # the first record computes the state
    if pack_tokens is None:
        assert forwards_after_a_state == [sum(new_tokens)]  # one forward for every variant, not one each
        assert len(head_calls) == 2  # the state's record, then every variant at once: not a host sync each
    else:
        assert len(forwards_after_a_state) > 1 and sum(forwards_after_a_state) == sum(new_tokens)
        assert len(head_calls) == 1 + len(forwards_after_a_state)
        assert all(n <= pack_tokens or n == max(new_tokens) for n in forwards_after_a_state)
    alone = [tiny_engine.probabilities([r])[0] for r in requests()]
    for ours, theirs in zip(shared, alone, strict=True):
        for p, q in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(p, q, atol=1e-5, rtol=0)


def test_a_state_captures_its_continuation_graph_on_its_second_reuse_alone_not_its_first(tiny_engine, monkeypatch):
    """A capture costs about three eager runs: a plain run over cached states (a sweep's re-run) reuses each state
    once, and must not capture a graph per state (on the H200 that made the re-run 3x slower)."""
    captures_or_replays: list[int] = []

    class Graphs:
        def run_after_prefix(self, ids, state):
            captures_or_replays.append(state.reuses_alone)
            return None  # then the eager path answers

    monkeypatch.setattr(tiny_engine.runner.prefix, "graphs", Graphs())
    monkeypatch.setattr(tiny_engine.runner.state_cache, "min_prefix_tokens", 64)  # the tiny state is kept
    tiny_engine.runner.state_cache.clear(reset_stats=True)
    for questions in QUESTIONS[:4]:  # the first stores the state, the next three continue from it alone
        tiny_engine.decide({"state": STATE, "questions": questions})
    assert tiny_engine.runner.state_cache.stats()["hits"] == 3
    assert captures_or_replays == [2, 3]


def test_a_rerun_continues_every_cached_state_in_one_pack_and_answers_as_each_alone(tiny_engine,
                                                                                  forwards_after_a_state,
                                                                                  monkeypatch):
    """A run of a case set after one question was edited: each case's state is cached (by the first run), and the
    cases continue from their own states together, in one backbone forward, not one forward per case (on the H200
    one at a time the host launching kernels set the pace: 165 ms per ~440-token continuation)."""
    monkeypatch.setattr(tiny_engine.runner.state_cache, "min_prefix_tokens", 64)  # the tiny states are kept
    tiny_engine.runner.state_cache.clear(reset_stats=True)
    states = [{**STATE, "body": f"Case {n}: " + STATE["body"] + " extra words" * n} for n in range(3)]
    for state in states:  # the first run, one case at a time: each stores its state
        tiny_engine.decide({"state": state, "questions": QUESTIONS[0]})
    edited = [{"state": state, "questions": QUESTIONS[1]} for state in states]
    forwards_after_a_state.clear()
    rerun = tiny_engine.probabilities(edited)
    records = [tiny_engine.encode(r) for r in edited]
    assert tiny_engine.runner.state_cache.stats()["hits"] == 3
    assert forwards_after_a_state == [sum(len(r) - r.state_end for r in records)]
    tiny_engine.runner.state_cache.clear()
    for request, ours in zip(edited, rerun, strict=True):
        for p, q in zip(ours, tiny_engine.probabilities([request])[0], strict=True):
            np.testing.assert_allclose(p, q, atol=1e-5, rtol=0)
