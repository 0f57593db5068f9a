"""The fused Triton kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are
defined, hence a child process): each against its PyTorch function, and the whole packed backbone of the tiny
release with every Triton kernel swapped in against the PyTorch set."""

from __future__ import annotations

import pytest

from tests.support.engine_paths import run_interpreted

pytestmark = pytest.mark.slow  # Triton's interpreter runs the kernels on the CPU: minutes

def test_each_triton_kernel_matches_its_pytorch_function_in_bf16_and_float32():
    out = run_interpreted("""
        import torch
        from clef_engine.fast import kernels
        for dtype in (torch.bfloat16, torch.float32):
            problem = kernels.triton_matches_torch(torch.device("cpu"), dtype, heads=4, kv_heads=2, head_dim=32,
                                                   value_head_dim=16)
            print(dtype, problem)
            assert problem is None, problem
    """)
    assert out.count("None") == 2


def test_triton_conv_keeps_records_apart_and_splits_qkv():
    run_interpreted("""
        import torch
        from clef_engine.fast import kernels
        from clef_engine.fast.segments import make_segments
        torch.manual_seed(0)
        segments = make_segments([4, 1, 9], torch.device("cpu"))
        mixed = torch.randn(14, 2 * 8 + 12 + 3)[:, :28]  # strided rows, like a slice of the fused projection
        weight = torch.randn(28, 4)
        q, k, v = kernels.causal_conv_triton(mixed, weight, segments, 8)
        assert q.shape == (14, 8) and k.shape == (14, 8) and v.shape == (14, 12)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        want = torch.cat(kernels.causal_conv_torch(mixed, weight, segments, 8), dim=1)
        got = torch.cat([q, k, v], dim=1)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        changed = mixed.clone()
        changed[:5] += 10.0  # the first two records change; the third's outputs must not
        again = torch.cat(kernels.causal_conv_triton(changed, weight, segments, 8), dim=1)
        assert torch.equal(again[5:], torch.cat([q, k, v], dim=1)[5:])
    """)


def test_packed_backbone_with_triton_kernels_matches_the_pytorch_kernels():
    out = run_interpreted("""
        import torch
        import clef_engine
        from clef_engine.fast import kernels
        from clef_engine.fast.segments import make_segments
        from clef_engine.fast.packed import PackedBackbone
        engine = clef_engine.load(clef_engine.demo_release(), device="cpu")
        # Three records of 3, 40 and 9 tokens: the conv's 32-token blocks and the norms' 16-row blocks each split a
        # record, and records start inside a block. (Triton's interpreter takes seconds per token.)
        torch.manual_seed(0)
        lengths = [3, 40, 9]
        ids = torch.randint(0, engine.runner.backbone.config.vocab_size, (sum(lengths),))
        segments = make_segments(lengths, torch.device("cpu"))
        plain, _ = engine.runner.backbone.forward(ids, segments)
        fused = kernels.Kernels(rms_norm=kernels.rms_norm_triton, gated_rms_norm=kernels.gated_rms_norm_triton,
                                causal_conv=kernels.causal_conv_triton, norm_rope=kernels.norm_rope_triton,
                                sigmoid_gate=kernels.sigmoid_gate_triton, silu_mul=kernels.silu_mul_triton)
        engine.runner.backbone.kernels = fused
        got, _ = engine.runner.backbone.forward(ids, segments)
        error = (got - plain).abs().max().item()
        print("max abs difference", error)
        assert error <= 1e-4, error
        vocabulary = "the invoice ticket customer payment refund amount total due date vendor alert".split()
        records = [engine.encode({"state": " ".join(vocabulary[(i * 7 + s) % 12] for i in range(n)),
                                  "questions": {"paid": {"type": "noul", "instructions": "Is it paid?"}}})
                   for s, n in enumerate((3, 9))]
        answers = engine.runner.forward(records)
        engine.runner.backbone.kernels = kernels.Kernels()
        assert max(abs(a - b) for x, y in zip(answers, engine.runner.forward(records)) for qa, qb in zip(x, y)
                   for a, b in zip(qa, qb)) <= 1e-5
    """)
    assert "max abs difference" in out


def test_the_residual_stream_stays_in_float32_from_the_first_layer_on():
    """The add + RMSNorm keeps the residual sum in float32 (the release path rounds it to bf16 after every layer)
    while the normed output stays in the model's dtype, in the PyTorch function and in the Triton kernel alike."""
    run_interpreted("""
        import torch
        from clef_engine.fast import kernels
        torch.manual_seed(0)
        x = torch.randn(5, 48).to(torch.bfloat16)
        residual = torch.randn(5, 48) * 100  # float32 values that bf16 cannot hold
        weight = 1 + 0.1 * torch.randn(48)
        for fn in (kernels.rms_norm_torch, kernels.rms_norm_triton):
            normed, stream = fn(x, weight, 1e-6, residual)
            assert normed.dtype == torch.bfloat16 and stream.dtype == torch.float32, fn
            assert torch.equal(stream, residual + x.float()), fn
            normed, first = fn(x, weight, 1e-6)  # the first layer: the embeddings start the stream
            assert normed.dtype == torch.bfloat16 and first.dtype == torch.float32, fn
            assert torch.equal(first, x.float()), fn
    """)


def test_gated_delta_gets_q_and_k_l2_normed_by_our_kernel_not_by_flas_autotuned_one():
    """flash-linear-attention's own q/k L2 norm (`use_qk_l2norm_in_kernel`) is autotuned again for every 65,536 rows
    of input: on the H200 the first pack of a new size class stalled for ~12 s. Our kernel norms q and k (the same
    formula) and fla is told not to."""
    run_interpreted("""
        import sys, types
        import torch
        calls = []
        rule = types.ModuleType("fla.ops.gated_delta_rule")

        def chunk_gated_delta_rule(q, k, v, **kwargs):
            calls.append((q, k, kwargs))
            return v, None
        rule.chunk_gated_delta_rule = chunk_gated_delta_rule
        for name in ("fla", "fla.ops"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["fla.ops.gated_delta_rule"] = rule
        from clef_engine.fast import kernels
        from clef_engine.fast.segments import make_segments
        torch.manual_seed(0)
        q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 4, 8)
        a, b = torch.randn(5, 4), torch.randn(5, 4)
        kernels.gated_delta_fla(q, k, v, a, b, torch.zeros(4), torch.zeros(4), make_segments([5], "cpu"))
        (got_q, got_k, kwargs), = calls
        assert kwargs["use_qk_l2norm_in_kernel"] is False
        def normed(x):
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        assert torch.allclose(got_q[0], normed(q), atol=1e-6), (got_q[0] - normed(q)).abs().max()
        assert torch.allclose(got_k[0], normed(k), atol=1e-6)
    """)
