"""Long records in chunks (fast/packed.py `forward_chunked`): the same hidden states, layer states and answers as the
whole-record forward, on the CPU in float32 with the tiny release and the chunk forced small."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import clef_engine
from clef_engine.config import EngineConfig
from clef_engine.errors import ReleaseError
from clef_engine.fast import attention
from clef_engine.fast.packed import chunk_bounds, longest_chunk, runs_in_chunks
from clef_engine.fast.segments import make_segments
from tests.support import REPO
from tests.support.engine_paths import (
    TOLERANCE,
    attention_with_lse_torch,
    max_difference,
    run_interpreted,
    words_request,
)

CHUNK = 160  # the engine's chunk here: a request of the tiny tokenizer is ~140 tokens before its state


@pytest.fixture(scope="module")
def chunked_engine(tiny_release):
    """The tiny release loaded with the chunk size from the environment, as a deployment sets it."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CLEF_PREFILL_CHUNK_TOKENS", str(CHUNK))
        engine = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    yield engine
    engine.close()


def test_the_chunk_size_is_a_config_knob_off_on_the_cpu_by_default():
    assert EngineConfig.resolve(device="cpu", env={}).prefill_chunk_tokens == 0
    assert EngineConfig.resolve(device="cpu", env={"CLEF_PREFILL_CHUNK_TOKENS": "16_384"}).prefill_chunk_tokens == 16384
    assert EngineConfig.resolve(device="cpu", env={"CLEF_PREFILL_CHUNK_TOKENS": "9"},
                                prefill_chunk_tokens=128).prefill_chunk_tokens == 128
    with pytest.raises(ReleaseError, match="CLEF_PREFILL_CHUNK_TOKENS='big'"):
        EngineConfig.resolve(device="cpu", env={"CLEF_PREFILL_CHUNK_TOKENS": "big"})


def test_chunks_end_at_multiples_of_the_chunk_size_and_at_each_split():
    assert chunk_bounds(136, 64) == [(0, 64), (64, 128), (128, 136)]
    assert chunk_bounds(128, 64) == [(0, 64), (64, 128)]
    assert chunk_bounds(150, 64, [100]) == [(0, 64), (64, 100), (100, 128), (128, 150)]
    assert chunk_bounds(150, 64, [128]) == [(0, 64), (64, 128), (128, 150)]
    assert chunk_bounds(40, 64, [40]) == [(0, 40)]
    assert chunk_bounds(150, 64, [30, 100]) == [(0, 30), (30, 64), (64, 100), (100, 128), (128, 150)]
    assert chunk_bounds(40, 0) == [(0, 40)] and not runs_in_chunks(40, 0)  # 0: whole records


def test_a_last_chunk_shorter_than_an_eighth_of_one_joins_the_chunk_before_it():
    """A chunk of a few tokens is a forward of every layer whose kernel launches, not the GPU, set its time (a
    Clef-Flash record of 16,414 tokens took ~45 ms more than one of 16,317)."""
    assert chunk_bounds(135, 64) == [(0, 64), (64, 135)]
    assert chunk_bounds(71, 64) == [(0, 71)] and not runs_in_chunks(71, 64) and runs_in_chunks(72, 64)
    assert longest_chunk(64) == 71 and longest_chunk(16_384) == 18_431
    assert chunk_bounds(135, 64, [130]) == [(0, 64), (64, 130), (130, 135)]  # a split still ends a chunk
    for n in range(1, 600):
        bounds = chunk_bounds(n, 64)
        assert bounds[0][0] == 0 and bounds[-1][1] == n and max(end - start for start, end in bounds) <= 71
        assert all(end - start >= 8 for start, end in bounds[1:])


@pytest.mark.parametrize(("length", "chunk", "split_at"), [
    (9, 2, None),  # chunks shorter than the conv's history: its last inputs come from two chunks back
    (136, 64, None),  # not a multiple of the chunk
    (133, 64, None),  # a last piece of 5 tokens: it joins the chunk before it
    (128, 64, None),  # a multiple
    (150, 64, 100),  # the state cache's split inside a chunk
    (67, 64, 2),  # a split two tokens in
    (150, 64, 128),  # a split at a chunk's end
])
def test_a_record_in_chunks_has_the_whole_forwards_hidden_states_and_layer_states(tiny_engine, length, chunk,
                                                                                    split_at):
    backbone = tiny_engine.runner.backbone
    ids = torch.randint(0, backbone.embed.shape[0], (length,), generator=torch.Generator().manual_seed(length))
    whole, want_states = backbone.forward(ids, make_segments([length], tiny_engine.device), split_at=split_at)
    pieces: list[tuple[int, torch.Tensor]] = []
    states = backbone.forward_chunked(ids, chunk, lambda start, hidden: pieces.append((start, hidden)),
                                      split_at=split_at)
    # the state's split does not cut a chunk: a chunk of a few tokens would be a forward of its own
    assert [start for start, _ in pieces] == [start for start, _ in chunk_bounds(length, chunk)]
    assert max(hidden.shape[0] for _, hidden in pieces) <= longest_chunk(chunk)
    chunked = torch.cat([hidden for _, hidden in pieces])
    assert (chunked - whole).abs().max().item() <= TOLERANCE
    if split_at is None:
        assert states is None
        return
    assert len(states) == len(want_states)
    for got, want in zip(states, want_states):
        assert [t.shape for t in got.tensors()] == [t.shape for t in want.tensors()]
        for a, b in zip(got.tensors(), want.tensors()):
            assert (a.float() - b.float()).abs().max().item() <= TOLERANCE


def test_a_long_record_is_answered_in_chunks_as_it_is_whole(tiny_engine, chunked_engine, monkeypatch):
    """Through the engine's own path with the state cache off: every layer sees at most a chunk of tokens."""
    monkeypatch.setattr(chunked_engine.runner.state_cache, "enabled", False)
    rows: list[int] = []
    run_chunk = chunked_engine.runner.backbone._forward_chunk
    monkeypatch.setattr(chunked_engine.runner.backbone, "_forward_chunk",
                        lambda ids, *rest: rows.append(ids.shape[0]) or run_chunk(ids, *rest))
    short = {"state": "a short ticket", "questions": {"paid": {"type": "noul", "instructions": "Is it paid?"}}}
    records = [tiny_engine.encode(body) for body in (short, words_request(20, 1), words_request(150, 2))]
    lengths = [len(r) for r in records]
    assert min(lengths) < CHUNK < max(lengths) and any(n % CHUNK for n in lengths if n > CHUNK)
    for record in records:
        whole = tiny_engine.runner.forward([record])
        chunked = chunked_engine.runner.forward([record])
        assert max_difference(chunked, whole) <= TOLERANCE
    assert max(rows) <= longest_chunk(CHUNK)
    assert len(rows) == sum(len(chunk_bounds(n, CHUNK)) for n in lengths if runs_in_chunks(n, CHUNK))


def test_a_record_a_little_over_two_chunks_ends_in_a_longer_chunk_not_a_short_one(tiny_engine, chunked_engine,
                                                                                 monkeypatch):
    """Through `decide`, as a user sends it: the few tokens past a multiple of the chunk are not a chunk of their
    own; an eighth of a chunk or more are."""
    rows: list[int] = []
    run_chunk = chunked_engine.runner.backbone._forward_chunk
    monkeypatch.setattr(chunked_engine.runner.backbone, "_forward_chunk",
                        lambda ids, *rest: rows.append(ids.shape[0]) or run_chunk(ids, *rest))
    words_at = {len(chunked_engine.encode(words_request(words, 3))): words for words in range(1, 90)}
    little = min(n for n in words_at if 2 * CHUNK < n < 2 * CHUNK + CHUNK // 8)
    more = min(n for n in words_at if n > 2 * CHUNK + CHUNK // 8)
    cases = ((little, [CHUNK, little - CHUNK]), (more, [CHUNK, CHUNK, more - 2 * CHUNK]))
    for n, want_rows in cases:
        rows.clear()
        body = words_request(words_at[n], 3)
        answers = chunked_engine.decide(body)["answers"]
        assert rows == want_rows, n
        want = tiny_engine.decide(body)["answers"]
        assert abs(answers["paid"]["noul"] - want["paid"]["noul"]) <= TOLERANCE
        for question in ("priority", "severity"):
            for option, probability in want[question]["probabilities"].items():
                assert abs(answers[question]["probabilities"][option] - probability) <= TOLERANCE


def test_a_long_state_stored_in_chunks_answers_a_new_schema_as_the_whole_record_does(tiny_engine, chunked_engine,
                                                                                     monkeypatch):
    """The state cache takes the chunked forward's state at the state's end (inside a chunk, not a chunk of its
    own), and the continuation from it answers a new schema as the whole record does; the state is stored after the
    answer."""
    cache = chunked_engine.runner.state_cache
    cache.clear()
    monkeypatch.setattr(cache, "min_prefix_tokens", 64)
    events: list[str] = []
    head_one, put = chunked_engine.runner.head_one, cache.put
    monkeypatch.setattr(chunked_engine.runner, "head_one", lambda *a: events.append("answer") or head_one(*a))
    monkeypatch.setattr(cache, "put", lambda *a: events.append("store") or put(*a))
    first = words_request(600, 7)
    second = dict(first, questions={"kind": {"type": "choice", "instructions": "Which kind of ticket",
                                             "criteria": {"billing": None, "technical": "a fault", "other": None}}})
    try:
        for body in (first, second):
            record = chunked_engine.encode(body)
            assert record.state_end > 2 * CHUNK and record.state_end % CHUNK  # the split inside a chunk
            got = chunked_engine.runner.forward([record])
            assert max_difference(got, tiny_engine.runner.forward([record])) <= TOLERANCE
        assert events == ["answer", "store", "answer"]  # stored after the first answer; the second is a hit
        assert cache.stats()["hits"] == 1 and cache.stats()["stored"] == 1
    finally:
        cache.clear()


def test_only_a_record_longer_than_the_token_budget_first_moves_earlier_states_out_of_the_device_tier(
        tiny_engine, chunked_engine, monkeypatch):
    """Issue 25's memory bound (weights + the record's keys/values + a bounded working set, whatever came before)
    for a record longer than the token budget: while its chunks run, no earlier state is on the device. A record run
    in chunks within the budget (memory.py sets its activations aside next to the device tier) leaves the stored
    states where they are: moving them to the host stalled the H200's 16k Clef-Flash records (issue 38). Either
    long record's own state is stored after its answer, and it answers as the whole-record forward does."""
    runner = chunked_engine.runner
    cache = runner.state_cache
    cache.clear(reset_stats=True)
    monkeypatch.setattr(cache, "min_prefix_tokens", 40)
    held_during_chunks: list[int] = []
    run_chunk = runner.backbone._forward_chunk
    monkeypatch.setattr(runner.backbone, "_forward_chunk",
                        lambda *args: held_during_chunks.append(cache.stats()["device_bytes"]) or run_chunk(*args))
    words = "the invoice ticket customer payment refund amount total due date vendor alert".split()
    short, other_short = ({"state": " ".join(words[(i * 7 + seed) % 12] for i in range(n)),
                           "questions": {"paid": {"type": "noul", "instructions": "Is it paid?"}}}
                          for n, seed in ((10, 1), (12, 3)))
    try:
        for body in (short, other_short):
            record = chunked_engine.encode(body)
            assert record.state_end >= 40 and len(record) < CHUNK
            runner.forward([record])
        assert cache.stats()["entries"] == 2 and not held_during_chunks  # two states kept; nothing ran in chunks

        within = chunked_engine.encode(words_request(600, 8))
        assert 2 * CHUNK < len(within) <= runner.config.token_budget
        assert max_difference(runner.forward([within]), tiny_engine.runner.forward([within])) <= TOLERANCE
        assert held_during_chunks and min(held_during_chunks) > 0  # the short states stayed on the device
        runner.forward([chunked_engine.encode(short)])
        assert cache.stats()["hits"] == 1 and cache.stats()["evicted"] == 0  # and answer from there

        held_during_chunks.clear()
        beyond = chunked_engine.encode(words_request(600, 9))
        monkeypatch.setattr(runner, "config", dataclasses.replace(runner.config, token_budget=len(beyond) - 1))
        assert max_difference(runner.forward([beyond]), tiny_engine.runner.forward([beyond])) <= TOLERANCE
        assert held_during_chunks and set(held_during_chunks) == {0}
        stats = cache.stats()
        assert stats["entries"] == 1 and stats["stored"] == 4 and stats["evicted"] == 3  # the long one's own state
        runner.forward([chunked_engine.encode(short)])
        assert cache.stats()["misses"] == 5  # the short state was moved out: computed again
    finally:
        cache.clear()


@pytest.mark.slow  # Triton's interpreter on the CPU: minutes
def test_a_chunked_record_with_the_triton_kernels_matches_the_whole_pytorch_forward():
    """Chunks after the first continue the conv with the fused kernel (`causal_conv_after_triton`): run in Triton's
    interpreter against the plain whole-record forward."""
    out = run_interpreted("""
        import torch
        import clef_engine
        from clef_engine.fast import kernels
        from clef_engine.fast.segments import make_segments
        engine = clef_engine.load(clef_engine.demo_release(), device="cpu")
        backbone = engine.runner.backbone
        ids = torch.randint(0, backbone.embed.shape[0], (75,), generator=torch.Generator().manual_seed(0))
        plain, _ = backbone.forward(ids, make_segments([75], torch.device("cpu")))
        backbone.kernels = kernels.Kernels(causal_conv=kernels.causal_conv_triton,
                                           causal_conv_after=kernels.causal_conv_after_triton)
        pieces = []
        backbone.forward_chunked(ids, 16, lambda start, hidden: pieces.append(hidden))
        error = (torch.cat(pieces) - plain).abs().max().item()
        print("max abs difference", error)
        assert len(pieces) == 5 and error <= 1e-4, error
    """)
    assert "max abs difference" in out


@pytest.mark.slow  # the benchmark's CPU smoke run: minutes
def test_the_long_records_benchmark_writes_issue_25s_layout_in_its_cpu_smoke_mode(tmp_path):
    """bench/long_records.py on a scaled-down model (its ~136k record is ~4k tokens here: chunked, state stored)."""
    out = tmp_path / "long.json"
    env = dict(os.environ, BENCH_CPU_SMOKE="1", BENCH_LENGTHS="131072", BENCH_SAMPLES="1", BENCH_16K_SAMPLES="2",
               BENCH_SKIP="cache_off,longest", BENCH_TINY_DIR=str(tmp_path / "tiny"), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "bench/long_records.py", str(out)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    entry = results["long"]["131072"]
    assert entry["release_ms"] == 22042.9 and entry["ours_ms"] > 0 and "ours_gpu_ms" in entry
    assert results["p95_over_p50_16k"] >= 1.0
    detail = results["detail"]
    assert set(detail["errors"]) == {"cache_off", "longest"}
    assert detail["config"]["prefill_chunk_tokens"] == "64"
    assert detail["long_131072"]["tokens"] > 2048 and detail["long_131072"]["state_cache"]["stored"] >= 1


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("prefix", "n"), [(700, 300), (512, 256), (100, 37), (0, 50), (256, 1)])
def test_the_cudnn_chunk_attention_merges_to_the_causal_attention_after_the_earlier_tokens(prefix, n, grouped):
    """Its two calls (the earlier keys up to a multiple of the step, unmasked; the rest causally, the queries
    shifted) merged by log-sum-exp, with cuDNN's call swapped for a plain one of the same contract (CPU)."""
    generator = torch.Generator().manual_seed(prefix + n)
    q = torch.randn(n, 6, 32, generator=generator)
    k, v = (torch.randn(prefix + n, 2, 32, generator=generator) for _ in range(2))
    got = attention.attention_chunk_cudnn(q, k, v, prefix, attend=attention_with_lse_torch, grouped=grouped)
    assert got.shape == q.shape
    assert (got - attention.attention_after_prefix(q, k, v, prefix)).abs().max().item() <= TOLERANCE


def test_a_record_in_chunks_on_the_cudnn_chunk_attention_has_the_whole_forwards_hidden_states(tiny_engine,
                                                                                              monkeypatch):
    backbone = tiny_engine.runner.backbone
    chunk_attention = functools.partial(attention.attention_chunk_cudnn, attend=attention_with_lse_torch,
                                        grouped=True)
    ids = torch.randint(0, backbone.embed.shape[0], (450,), generator=torch.Generator().manual_seed(1))
    whole, _ = backbone.forward(ids, make_segments([450], tiny_engine.device))
    monkeypatch.setattr(backbone.kernels, "attention_chunk", chunk_attention)
    pieces: list[torch.Tensor] = []
    backbone.forward_chunked(ids, 200, lambda start, hidden: pieces.append(hidden))  # the third after 144 + 256
    assert len(pieces) == 3
    assert (torch.cat(pieces) - whole).abs().max().item() <= TOLERANCE
