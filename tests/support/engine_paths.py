"""What the tests of the engine's forward paths share: requests of a chosen length, the float32 tolerance between two
paths' answers, and code run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are defined,
hence a child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
