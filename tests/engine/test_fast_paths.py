"""The fast paths (packed prefill, state cache) give the plain path's answers: CPU, tiny release, float32."""

from __future__ import annotations

import gc

import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from clef_engine.config import EngineConfig
from clef_engine.engine import check_fast_kernels
from clef_engine.errors import ReleaseError
from clef_engine.fast import attention, kernels
from clef_engine.fast.cache import PrefixState, StateCache, prefix_key
from clef_engine.fast.graphs import PrefillGraphs, bucket, buckets
from clef_engine.fast.packed import LayerState
from clef_engine.fast.segments import make_segments
from clef_engine.model.reference import reference_decide
from tests.support.engine_paths import TOLERANCE, distances, max_difference, partial_attention_torch, words_request


@pytest.fixture(scope="module")
def records(tiny_engine):
    # very different lengths in one pack: a few tokens of state up to ~1,700 tokens
    return [tiny_engine.encode(words_request(n, seed)) for seed, n in enumerate((1, 300, 7, 2400, 40))]


def test_engine_uses_the_packed_path_and_says_so(tiny_engine):
    info = tiny_engine.info()["kernels"]
    assert info["path"] == "forward_packed"
    assert info["packed"]["gated_delta"] == "kernels.gated_delta_torch"
    assert info["packed"]["causal_conv"] == "kernels.causal_conv_torch"


def test_packed_matches_padded_and_reference(tiny_engine, records):
    lengths = sorted(len(r) for r in records)
    assert lengths[-1] > 5 * lengths[0]
    packed = tiny_engine.runner.forward(records)
    padded = tiny_engine.runner.forward_padded(records)
    reference = reference_decide(tiny_engine.runner, records)
    assert max_difference(packed, padded) <= TOLERANCE
    assert max_difference(packed, reference) <= TOLERANCE


def test_no_leakage_between_records_of_a_pack(tiny_engine, records):
    together = tiny_engine.runner.forward(records)
    for record, answer in zip(records, together):
        alone = tiny_engine.runner.forward([record])
        assert max_difference(alone, [answer]) <= TOLERANCE


def test_records_that_differ_only_in_an_earlier_record_of_the_pack_get_the_same_answer(tiny_engine, records):
    target = records[1]
    first = tiny_engine.runner.forward([records[0], target])[1]
    second = tiny_engine.runner.forward([records[3], target])[1]
    assert max_difference([first], [second]) <= TOLERANCE


def test_state_cache_hit_and_miss_give_the_uncached_answer(tiny_engine):
    cache = tiny_engine.runner.state_cache
    cache.clear()
    old_threshold = cache.min_prefix_tokens
    cache.min_prefix_tokens = 64
    try:
        state_request = words_request(600, 3)
        first = tiny_engine.encode(state_request)
        other_schema = dict(state_request, questions={
            "kind": {"type": "choice", "instructions": "Which kind of ticket",
                     "criteria": {"billing": None, "technical": "a fault", "other": None, "shipping": None}}})
        second = tiny_engine.encode(other_schema)
        assert first.input_ids[: first.state_end] == second.input_ids[: second.state_end]
        plain = reference_decide(tiny_engine.runner, [first, second])
        before = cache.stats()
        miss = tiny_engine.runner.forward([first])  # alone: computes and stores the prefix
        after_miss = cache.stats()
        assert after_miss["stored"] == before["stored"] + 1 and after_miss["misses"] == before["misses"] + 1
        hit = tiny_engine.runner.forward([second])  # a new schema on the cached state
        assert cache.stats()["hits"] == after_miss["hits"] + 1
        assert max_difference(miss, plain[:1]) <= TOLERANCE
        assert max_difference(hit, plain[1:]) <= TOLERANCE
        response = tiny_engine.decide(other_schema)  # the public path answers the same
        probabilities = response["answers"]["kind"]["probabilities"]
        ids = sorted(probabilities)
        assert max(abs(probabilities[i] - p) for i, p in zip(ids, plain[1][0])) <= 1e-4
    finally:
        cache.min_prefix_tokens = old_threshold
        cache.clear()


def test_short_prefixes_and_batches_do_not_fill_the_cache(tiny_engine, records):
    cache = tiny_engine.runner.state_cache
    cache.clear()
    tiny_engine.runner.forward(records)  # a batch: nothing stored
    tiny_engine.runner.forward(records[:1])  # alone, but a prefix far under min_prefix_tokens
    assert cache.stats()["entries"] == 0


def test_cache_is_bounded_in_bytes_least_recently_used_out():
    cache = StateCache(torch.device("cpu"), device_bytes=2500, host_bytes=0)

    def state() -> PrefixState:  # 500 + 500 bytes
        return PrefixState(10, [LayerState(recurrent=torch.ones(125))], torch.ones(125))

    assert state().nbytes == 1000
    for name in "abc":
        cache.put(name, state())
        if name == "b":
            assert cache.get("a") is not None  # touch a: b is now the least recently used
    assert cache.stats()["entries"] == 2
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None
    assert cache.stats()["device_bytes"] <= 2500
    cache.put("huge", PrefixState(1, [], torch.ones(1000)))  # larger than the whole cache: not kept
    assert cache.get("huge") is None


def test_a_large_state_leaving_the_device_tier_is_dropped_not_copied_to_the_host(monkeypatch):
    """Copying gigabytes to the host stalls the answering thread's kernel launches (bench/results, long records):
    on CUDA only entries up to SPILL_MAX_BYTES move to host memory; larger ones are dropped when evicted."""
    from clef_engine.fast import cache as cache_module

    monkeypatch.setattr(cache_module, "SPILL_MAX_BYTES", 600)
    cache = StateCache(torch.device("cuda"), device_bytes=1500, host_bytes=10_000)
    spilled: list[str] = []
    monkeypatch.setattr(cache, "_spill_to_host", lambda key, state: spilled.append(key))

    def state(n: int) -> PrefixState:
        return PrefixState(10, [], torch.ones(n))

    cache.put("small", state(125))  # 500 bytes
    cache.put("large", state(250))  # 1,000 bytes: evicts "small", which is copied to the host
    cache.put("next", state(250))  # evicts "large", over SPILL_MAX_BYTES: dropped
    assert spilled == ["small"] and cache.stats()["evicted"] == 1
    cache.put("whole", state(500))  # larger than the device tier: not kept at all, nothing evicted for it
    assert cache.get("whole") is None and cache.get("next") is not None


def test_continuation_graphs_live_and_die_with_their_cache_entry():
    """Graphs read an entry's tensors by address: the graph owner keys them by the entry object, so an entry dropped
    by the cache takes its graphs with it, and an entry moved to another tier is a new object without any."""
    owner = PrefillGraphs(backbone=None)
    entry = PrefixState(10, [LayerState(recurrent=torch.ones(125))], torch.ones(125))
    owner.continuations[entry] = {448: "graph"}
    assert entry.nbytes == 1000 and not hasattr(entry, "graphs")
    moved = entry.to("cpu")
    assert moved not in owner.continuations and entry in owner.continuations
    cache = StateCache(torch.device("cpu"), device_bytes=1500, host_bytes=0)
    cache.put("a", entry)
    del entry, moved
    gc.collect()
    assert len(owner.continuations) == 1  # still cached
    cache.put("b", PrefixState(10, [LayerState(recurrent=torch.ones(125))], torch.ones(125)))  # evicts "a"
    gc.collect()
    assert cache.get("a") is None and len(owner.continuations) == 0


def test_every_length_up_to_the_graph_limit_has_a_captured_bucket():
    every = buckets(4096)
    assert every == sorted(set(every)) and every[-1] == 4096
    for n in range(1, 4097):
        assert bucket(n) in every and n <= bucket(n) < n + 256


def test_a_long_state_is_stored_by_the_one_forward_that_answers(tiny_engine, monkeypatch):
    """A cold record whose state the cache keeps runs the backbone once (not a prefix pass then a continuation)."""
    cache = tiny_engine.runner.state_cache
    cache.clear()
    monkeypatch.setattr(cache, "min_prefix_tokens", 64)
    calls = []
    forward = tiny_engine.runner.backbone.forward
    monkeypatch.setattr(tiny_engine.runner.backbone, "forward", lambda *a, **k: calls.append(k) or forward(*a, **k))
    try:
        tiny_engine.decide(words_request(500, 5))
        assert cache.stats()["stored"] >= 1 and cache.stats()["entries"] == 1
        assert len(calls) == 1 and calls[0].get("split_at") is not None
    finally:
        cache.clear()


def test_prefix_key_depends_on_model_tokens_and_media():
    base = prefix_key("clef", [1, 2, 3])
    assert base == prefix_key("clef", [1, 2, 3])
    assert base != prefix_key("clef-flash", [1, 2, 3])
    assert base != prefix_key("clef", [1, 2, 4])
    assert base != prefix_key("clef", [1, 2, 3], "digest")


def test_cuda_refuses_slow_kernels_unless_allowed(monkeypatch):
    monkeypatch.setattr(kernels, "fla_importable", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve a CUDA config on any machine

    def config(env: dict, **given) -> EngineConfig:
        return EngineConfig.resolve(device="cuda", env=env, **given)

    with pytest.raises(ReleaseError, match="allow_slow_kernels"):
        check_fast_kernels(config({}))
    check_fast_kernels(config({}, allow_slow_kernels=True))
    check_fast_kernels(config({"CLEF_ALLOW_SLOW_KERNELS": "1"}))
    with pytest.raises(ReleaseError, match="allow_slow_kernels"):  # the keyword wins over the environment
        check_fast_kernels(config({"CLEF_ALLOW_SLOW_KERNELS": "1"}, allow_slow_kernels=False))
    check_fast_kernels(EngineConfig.resolve(device="cpu", env={}))  # the CPU always runs the torch kernels


def test_segments_restart_positions_per_record():
    segments = make_segments([3, 1, 2], torch.device("cpu"))
    assert segments.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert segments.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert segments.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0]]
    continued = make_segments([2], torch.device("cpu"), first_position=5)
    assert continued.positions.tolist() == [5, 6] and continued.cu_seqlens is None


def test_conv_does_not_read_across_records():
    torch.manual_seed(0)
    x = torch.randn(9, 6)
    weight = torch.randn(6, 4)
    segments = make_segments([4, 5], torch.device("cpu"))

    def conv(inputs, segments):
        return torch.cat(kernels.causal_conv_torch(inputs, weight, segments, 2), dim=1)  # q, k, v back together

    together = conv(x, segments)
    alone = conv(x[4:], make_segments([5], torch.device("cpu")))
    assert torch.allclose(together[4:], alone, atol=1e-6)
    changed = x.clone()
    changed[:4] += 10.0  # the first record changes; the second's outputs must not
    assert torch.allclose(conv(changed, segments)[4:], together[4:], atol=1e-6)


def sdpa_as_varlen(aligned_to_last_key: bool):
    """A stand-in for torch's flash varlen_attn (CUDA only), causal mask aligned to each sequence's last key
    (flash-attention's convention) or, wrongly, to its first."""

    def one(q, k, v):
        n, total = q.shape[0], k.shape[0]
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        offset = total - n if aligned_to_last_key else 0
        allowed = torch.arange(total)[None, :] <= (offset + torch.arange(n))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=allowed)
        return out.transpose(0, 1)

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
        bounds = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])
        return torch.cat([one(q[qs:qe], k[ks:ke], v[ks:ke]) for qs, qe, ks, ke in bounds])

    return varlen_attn


@pytest.mark.parametrize("aligned", [True, False])
def test_prefix_varlen_check_accepts_only_a_mask_aligned_to_the_last_key(monkeypatch, aligned):
    monkeypatch.setattr(attention, "_varlen_function", lambda: sdpa_as_varlen(aligned))
    attention._varlen_parameters.cache_clear()  # read the stand-in's keywords, not torch's
    problem = attention.prefix_varlen_matches_sdpa(torch.device("cpu"), torch.float32, 4, 2, 16)
    attention._varlen_parameters.cache_clear()
    assert (problem is None) == aligned, problem


@pytest.mark.parametrize("copy_rows", [1 << 17, 200])
def test_records_after_cached_states_attend_as_each_alone_in_one_call_or_in_groups(monkeypatch, copy_rows):
    """Records continuing after cached states (a sweep's variants share one, a re-run's have their own): the packed
    varlen call (each record's cached keys copied before its own, in groups when they would exceed the copy bound)
    answers what each record after its prefix answers alone."""
    monkeypatch.setattr(attention, "_varlen_function", lambda: sdpa_as_varlen(True))
    monkeypatch.setattr(attention, "PREFIX_COPY_ROWS", copy_rows)
    attention._varlen_parameters.cache_clear()
    generator = torch.Generator().manual_seed(4)
    segments = make_segments([9, 31, 4], torch.device("cpu"), first_position=[150, 150, 70])
    q, k, v = (torch.randn(segments.total, heads, 16, generator=generator) for heads in (4, 2, 2))
    shared_k, shared_v, own_k, own_v = torch.randn(4, 150, 2, 16, generator=generator)
    keys, values = [shared_k, shared_k, own_k[:70]], [shared_v, shared_v, own_v[:70]]
    got = attention.attention_after_prefixes_varlen(q, k, v, keys, values, segments)
    attention._varlen_parameters.cache_clear()
    want = attention.attention_after_prefixes(q, k, v, keys, values, segments)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (5, 7), (2, 300)])
def test_the_head_graphs_padding_to_a_shape_bucket_changes_no_answer(tiny_engine, shape):
    """The head's CUDA graphs run a record padded to a bucket of memory length, questions, options and span grids
    (padding masked or empty). Run eagerly on the CPU, that padded call must answer what the head answers."""
    from clef_engine.fast.graphs import HeadGraphs

    questions, options = shape
    schema = {f"q{j}": {"type": "choice", "instructions": "word " * (1 + 9 * (j == 1)),
                        "criteria": {f"o{k}": ("long " * 40 if k == 0 else None) for k in range(options)}}
              for j in range(questions)}
    schema["last"] = {"type": "noul", "instructions": "Is it?"}
    record = tiny_engine.encode({"state": "the invoice is late " * 5, "questions": schema}, max_length=2**31 - 1)
    hidden = torch.randn(len(record), tiny_engine.runner.model.config.text_config.hidden_size,
                         generator=torch.Generator().manual_seed(options))
    with torch.inference_mode():
        normed, memory = tiny_engine.runner.head.token_memory(hidden)
        padded = HeadGraphs(tiny_engine.runner.head, tiny_engine.runner.output_embeddings, capture=False).probabilities(
            normed, memory, record)
        plain = tiny_engine.runner.head_probabilities(hidden, [record], [0], [len(record)])[0]
    assert [len(q) for q in padded] == [len(q) for q in plain] == [options] * questions + [2]
    assert max_difference([padded], [plain]) <= TOLERANCE


def test_the_head_graphs_bf16_call_stays_close_to_the_eager_head(tiny_engine):
    """In bf16 the graph's call pools spans by GEMMs into float32 and pads to a bucket: its probabilities stay
    within bf16 rounding of the eager head's on the same normed states and memory (the H200 bench reports the same
    comparison as `graph_vs_eager_max_dp`)."""
    import copy

    from clef_engine.fast.graphs import HeadGraphs
    from clef_engine.model.head import layout, option_probabilities

    head = copy.deepcopy(tiny_engine.runner.head).to(torch.bfloat16)
    embeddings = tiny_engine.runner.output_embeddings.to(torch.bfloat16)
    schema = {f"q{j}": {"type": "choice", "instructions": f"which {j}?",
                        "criteria": {f"o{k}": f"option {k} of {j}" for k in range(6)}} for j in range(12)}
    record = tiny_engine.encode({"state": "the invoice is late " * 40, "questions": schema}, max_length=2**31 - 1)
    hidden = torch.randn(len(record), head.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        normed, memory = head.token_memory(hidden.to(torch.bfloat16))
        graphed = HeadGraphs(head, embeddings, capture=False).probabilities(normed, memory, record)
        batch = layout([record], [0], [len(record)])
        flat = option_probabilities(head.decide_from_memory(normed, memory, embeddings, batch), batch).tolist()
    eager = [flat[6 * j: 6 * j + 6] for j in range(12)]
    assert max_difference([graphed], [eager]) <= 2e-3


def test_the_heads_attention_reads_each_records_real_keys_by_count_in_batches_and_graphs(tiny_engine, monkeypatch):
    """The head's attention is told each row's real key count, not given a mask: on CUDA that is flash attention's
    `seqused_k`, which builds no per-shape plan (cuDNN built one, 43-73 ms on the H200, for every new head shape).
    In a batch each record reads only its own memory and questions; in a head graph only the record's tokens of a
    memory padded to its bucket. On this CPU the masked kernel runs from the same counts, so the fidelity tests check
    them."""
    from clef_engine.fast.graphs import HeadGraphs
    from clef_engine.fast.head_kernels import head_attention_kernel
    from clef_engine.model import head as head_module

    assert head_attention_kernel(torch.device("cpu"), torch.float32, 64) is head_module.attention_masked
    assert tiny_engine.runner.head.attention is head_module.attention_masked
    seen = []

    def watched(q, k, v, counts):
        seen.append((q.shape[1], k.shape[1], None if counts is None else counts.tolist()))
        return head_module.attention_masked(q, k, v, counts)

    monkeypatch.setattr(tiny_engine.runner.head, "attention", watched)
    short = {"state": "the invoice is paid", "questions": {"q": {"type": "noul", "instructions": "Paid?"}}}
    long = {"state": "the invoice is late " * 30, "questions": {
        f"q{j}": {"type": "choice", "instructions": f"which {j}?", "criteria": {"a": "one", "b": "two"}}
        for j in range(3)}}
    records = [tiny_engine.encode(request) for request in (short, long)]
    lengths = [len(r) for r in records]
    hidden = torch.randn(sum(lengths), tiny_engine.runner.head.config.hidden_size,
                         generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        tiny_engine.runner.head_probabilities(hidden, records, [0, lengths[0]], lengths)
    config = tiny_engine.runner.head.config
    route = (6, max(lengths), lengths)  # options padded to the most of one record (3 x 2), over its own memory
    assert seen == [route] * config.routing_layers + [(3, 3, [1, 3]), (3, max(lengths), lengths)] * config.layers

    seen.clear()
    record = records[1]
    with torch.inference_mode():
        normed, memory = tiny_engine.runner.head.token_memory(hidden[lengths[0]:])
        HeadGraphs(tiny_engine.runner.head, tiny_engine.runner.output_embeddings, capture=False).probabilities(
            normed, memory, record)
    padded = {keys for _, keys, counts in seen if counts == [len(record)]}
    assert len(padded) == 1 and padded.pop() > len(record)  # the bucket's padded memory, of which the record's tokens
    assert all(counts in ([len(record)], [3]) for _, _, counts in seen)  # ... and its 3 questions of the fields


@pytest.mark.parametrize("grouped", [True, False])
def test_a_long_records_cudnn_attention_runs_at_a_shared_padded_length_and_answers_the_same(monkeypatch, grouped):
    """cuDNN builds an execution plan for every new sequence length (~50 ms on the H200), and records come at every
    length: one long record's attention runs padded to a multiple of 256 (zero keys after its last real token), K/V
    heads grouped or repeated, and its real tokens get the plain causal attention's outputs."""
    import contextlib

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    monkeypatch.setattr(attention, "_cudnn_takes_grouped_heads", lambda device, dtype: grouped)
    lengths_seen = []
    sdpa = F.scaled_dot_product_attention

    def watched(q, k, v, **kwargs):
        lengths_seen.append((q.shape[-2], k.shape[1]))
        return sdpa(q, k, v, **kwargs)

    n = attention.LONG_RECORD_TOKENS + 37
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 16, generator=generator)
    k, v = torch.randn(n, 2, 16, generator=generator), torch.randn(n, 2, 16, generator=generator)
    segments = make_segments([n], torch.device("cpu"))
    monkeypatch.setattr(F, "scaled_dot_product_attention", watched)
    got = attention.attention_varlen_cudnn_long(q, k, v, segments)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    assert lengths_seen == [(attention.cudnn_length(n), 2 if grouped else 4)]
    assert attention.cudnn_length(n) % 256 == 0 and attention.cudnn_length(n) > n
    assert got.shape == (n, 4, 16)
    assert torch.allclose(got, attention.attention_sdpa(q, k, v, segments), atol=1e-5)


def test_grouped_kv_heads_are_used_only_where_the_kernel_answers_as_on_repeated_heads():
    """The probe behind passing 4 K/V heads to 24 query heads as they are: a kernel that groups heads natively
    passes, one that answers differently or refuses the shapes does not (the heads are then repeated)."""
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, heads, 32, 16, generator=generator) for heads in (6, 2, 2))

    def grouped(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def first_heads_only(q, k, v):  # pairs query head h with K/V head h % kv: not what repeating means
        return F.scaled_dot_product_attention(q, k.repeat(1, q.shape[1] // k.shape[1], 1, 1),
                                              v.repeat(1, q.shape[1] // k.shape[1], 1, 1), is_causal=True)

    def refuses(q, k, v):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("number of heads differ")
        return grouped(q, k, v)

    assert attention._grouped_heads_match(grouped, q, k, v, 1)
    assert not attention._grouped_heads_match(first_heads_only, q, k, v, 1)
    assert not attention._grouped_heads_match(refuses, q, k, v, 1)


def test_residual_projections_written_in_float32_reach_the_norm_and_come_closer_to_the_float32_answer():
    """On CUDA the projections whose outputs join the residual stream (o_proj, out_proj, down) write their float32
    accumulator instead of rounding it to bf16 (`residual_projection_float32`). Here, on a bf16 copy of the tiny
    release, the same GEMM in float32 on the CPU stands in for it: the add + norm takes the float32 branch and hands
    the next projection bf16, the backbone's output stays bf16, and the answers are no farther from the float32
    model's than the plain bf16 path's are: over every option of eight records, a paired one-sided t-test finds the
    float32-residual path's distances not larger (p > 0.01). Not one maximum against another: on the tiny release both
    paths are a few roundings from the float32 answer, and which of two such numbers is smaller depends on the CPU's
    kernels (on one CI machine the largest distance was 0.0050 vs 0.0049, the mean 0.00157 vs 0.00158)."""
    import clef_engine

    truth_engine = clef_engine.load(clef_engine.demo_release(), device="cpu")
    engine = clef_engine.load(clef_engine.demo_release(), device="cpu", dtype=torch.bfloat16)
    records = [engine.encode(words_request(n, seed)) for seed, n in enumerate((30, 400, 1200, 60, 700, 150, 900, 20))]
    truth = truth_engine.runner.forward(records)
    plain = engine.runner.forward(records)
    engine.runner.backbone.kernels = kernels.Kernels(
        residual_projection=lambda x, weight: F.linear(x.float(), weight.float()))
    ids = torch.tensor(records[0].input_ids)
    hidden, _ = engine.runner.backbone.forward(ids, make_segments([len(ids)], torch.device("cpu")))
    assert hidden.dtype == torch.bfloat16
    wide = engine.runner.forward(records)
    assert max_difference(wide, plain) < 0.05  # the same model, a few roundings apart
    farther = scipy.stats.ttest_rel(distances(wide, truth), distances(plain, truth), alternative="greater")
    assert farther.pvalue > 0.01, farther


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_the_heads_attention_split_over_the_keys_answers_as_the_whole_keys_do(splits):
    """Few queries over a long memory: the keys cut into pieces, each attended on its own, merged by log-sum-exp
    (what the head runs on CUDA through flash, `attention_flash_split`). With the plain per-piece kernel here, the
    merged answer equals the masked attention's, in a batch whose rows have different real key counts, including a
    row whose last pieces hold no real key, and with no counts at all."""
    from clef_engine.fast.head_kernels import attention_split_keys
    from clef_engine.model.head import attention_masked

    generator = torch.Generator().manual_seed(21)
    q = torch.randn(3, 5, 4, 16, generator=generator)
    k, v = (torch.randn(3, 70, 4, 16, generator=generator) for _ in range(2))
    for counts in (torch.tensor([70, 9, 41], dtype=torch.int32), None):
        got = attention_split_keys(q, k, v, counts, splits, partial_attention_torch)
        want = attention_masked(q, k, v, counts)
        assert (got - want).abs().max().item() <= 1e-5


def test_keys_are_split_only_where_few_queries_over_many_keys_would_leave_the_gpu_idle():
    from clef_engine.fast.head_kernels import key_splits

    h200 = 2 * 132
    assert key_splits(1, 65, 16, 14336, h200) == 16  # 64 questions' fields over a ~14k-token memory: 16 blocks -> 256
    assert key_splits(1, 129, 16, 16384, h200) == 8  # two query blocks per head
    assert key_splits(1, 650, 16, 14336, h200) == 1  # 640 options: 96 blocks, the merge would cost what it saves
    assert key_splits(1, 65, 16, 1024, h200) == 1  # a short memory: the merge would cost more than it saves
    assert key_splits(2, 65, 16, 14336, h200) == 8
    assert key_splits(8, 65, 16, 14336, h200) == 1  # a batch of records fills the GPU by itself


def test_heads_flash_attention_does_not_take_run_the_exact_kernel(monkeypatch):
    """Flash attention takes head dimensions that are multiples of 8 up to 256. A release with smaller heads (the
    demo release's are 4 wide) on a GPU where flash runs gets the exact kernel, not a RuntimeError on every decide."""
    from clef_engine.fast import head_kernels
    from clef_engine.model import head as head_module

    monkeypatch.setattr(head_kernels, "_flash_takes_counts", lambda device, dtype: True)
    monkeypatch.setattr(head_kernels, "_flash_splits_keys", lambda device, dtype: True)
    cuda = torch.device("cuda")
    assert head_kernels.head_attention_kernel(cuda, torch.bfloat16, 64) is head_kernels.attention_flash_split
    for head_dim in (4, 12, 264):
        assert head_kernels.head_attention_kernel(cuda, torch.bfloat16, head_dim) is head_module.attention_masked


def test_the_engine_gives_the_head_the_attention_kernel_chosen_for_its_device(tiny_release, monkeypatch):
    """The model layer knows only the exact kernel; the engine hands the head the one fast/head_kernels.py picks for
    its device (flash on a GPU that runs it), and that kernel answers every attention of the head."""
    import clef_engine
    from clef_engine import runner as runner_module
    from clef_engine.model.head import attention_masked

    keys_seen = []

    def chosen(q, k, v, counts):
        keys_seen.append(k.shape[1])
        return attention_masked(q, k, v, counts)

    monkeypatch.setattr(runner_module, "head_attention_kernel", lambda device, dtype, head_dim: chosen)
    engine = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    try:
        assert engine.runner.head.attention is chosen and engine.info()["kernels"]["head_attention"] == "chosen"
        engine.decide({"state": "the invoice is paid", "questions": {"q": {"type": "noul", "instructions": "Paid?"}}})
    finally:
        engine.close()
    config = engine.runner.head.config
    assert len(keys_seen) == config.routing_layers + 2 * config.layers


def test_a_cpu_model_answers_where_transformers_bound_its_gated_deltanet_to_cuda_only_kernels(
        tiny_release, tiny_engine, records, monkeypatch):
    # On a GPU machine with flash-linear-attention installed, transformers binds these names to fla's Triton
    # kernels, which refuse CPU tensors; the engine must still answer a CPU model (the padded path goes through them).
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    import clef_engine

    def cuda_only(plain):
        def kernel(*args, **kwargs):
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        kernel.__wrapped__ = plain
        return kernel

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        bound = getattr(qwen, name)
        monkeypatch.setattr(qwen, name, cuda_only(getattr(bound, "__wrapped__", bound)))
    engine = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    try:
        ours, theirs = engine.runner, tiny_engine.runner
        assert max_difference(ours.forward_padded(records), theirs.forward_padded(records)) <= TOLERANCE
        assert max_difference(reference_decide(ours, records), theirs.forward(records)) <= TOLERANCE
    finally:
        engine.close()
