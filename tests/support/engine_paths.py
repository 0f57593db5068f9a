"""What the tests of the engine's forward paths share: requests of a chosen length, the float32 tolerance between two
paths' answers, code run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are defined,
hence a child process), and plain PyTorch versions of the CUDA-only attention calls, to swap in on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from tests.support import REPO

TOLERANCE = 1e-5  # float32 on the CPU: two forward paths' probabilities differ by at most this


def words_request(words: int, seed: int = 0) -> dict:
    """A request of one question of each type whose state is `words` words long (`seed` varies it)."""
    vocabulary = "the invoice ticket customer payment refund amount total due date vendor alert".split()
    state = " ".join(vocabulary[(i * 7 + seed) % len(vocabulary)] for i in range(words))
    return {"state": state, "questions": {
        "paid": {"type": "noul", "instructions": "Is the invoice paid?"},
        "priority": {"type": "choice", "instructions": f"Priority {seed}",
                     "criteria": {"high": "urgent", "medium": None, "low": "can wait"}},
        "severity": {"type": "score", "instructions": "How bad is it", "criteria": ["fine", "bad", "awful"]}}}


def distances(a: list, b: list) -> list[float]:
    """|a - b| for every option of every question of every record."""
    return [abs(x - y) for ra, rb in zip(a, b) for qa, qb in zip(ra, rb) for x, y in zip(qa, qb)]


def max_difference(a: list, b: list) -> float:
    return max(distances(a, b))


def run_interpreted(code: str) -> str:
    """Run `code` in a child Python with TRITON_INTERPRET=1; its output. Fails the test if it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def attention_with_lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """attention.attention_with_lse_cudnn in plain PyTorch (top-left causal mask, as cuDNN's; K/V heads grouped):
    (out [1, H, Lq, D], log-sum-exp [1, H, Lq] in float32)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1).float(), v.repeat_interleave(repeat, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    return (torch.softmax(scores, -1) @ v).to(q.dtype), torch.logsumexp(scores, -1)


def partial_attention_torch(q, k, v, cu_q, cu_k, max_q, max_k, used_k):
    """head_kernels.partial_attention_flash in plain PyTorch, sequence by sequence: (out [Nq, H, d], log-sum-exp
    [H, Nq] in float32); a sequence with no keys gives zeros and an infinite log-sum-exp."""
    scale = q.shape[-1] ** -0.5
    outs, lses = [], []
    for index in range(cu_q.numel() - 1):
        qs = q[int(cu_q[index]): int(cu_q[index + 1])].float().transpose(0, 1)  # [H, Lq, d]
        start = int(cu_k[index])
        end = start + min(int(used_k[index]), int(cu_k[index + 1]) - start)
        ks, vs = (x[start:end].float().transpose(0, 1) for x in (k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        lse = torch.logsumexp(scores, -1) if end > start else torch.full(qs.shape[:2], float("inf"))
        out = torch.softmax(scores, -1) @ vs if end > start else torch.zeros_like(qs)
        outs.append(out.transpose(0, 1).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)
