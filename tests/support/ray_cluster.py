"""A real local Ray cluster on this machine's CPUs for the distributed tests (two CPUs: two replicas of the tiny
release at a time), and the comparison of a run's answers with the same run done in process."""

from __future__ import annotations

import fcntl
import math
import os
import re
import tempfile
from pathlib import Path
from typing import IO

import pytest

CPUS = 2
# Answers are rounded to 4 decimals; float32 sums in packs of other sizes and on other thread counts can land a
# value on the other side of a rounding step.
TOLERANCE = 1.5e-4


# One local cluster on this machine at a time: test workers (pytest-xdist) take turns by this lock, held from the
# cluster's start to its shutdown at the end of the test module that started it (tests/support/fixtures.py).
_LOCK_PATH = Path(tempfile.gettempdir()) / f"clef-tests-ray-{os.getuid()}.lock"
_lock_file: IO[bytes] | None = None


def local_cluster() -> str:
    """Start the cluster once per test module (or reuse it); returns its address for other drivers."""
    global _lock_file
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        if _lock_file is None:
            _lock_file = open(_LOCK_PATH, "wb")  # held open until shutdown_local_cluster
            fcntl.flock(_lock_file, fcntl.LOCK_EX)
        # Ray starts its workers at nice 15. On a machine whose cores are busy (CI runs this suite beside two
        # processes burning both cores) a nice-15 replica gets a few percent of a core: one was still importing
        # torch after a minute at 4.7% CPU and a resumed run waited 300 s for replicas that never loaded.
        ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False,
                 _system_config={"worker_niceness": 0})
    return ray.get_runtime_context().gcs_address


def shutdown_local_cluster() -> None:
    """Stop the cluster local_cluster started in this process, if any, and let another worker start one."""
    global _lock_file
    if _lock_file is None:
        return
    import ray

    ray.shutdown()
    fcntl.flock(_lock_file, fcntl.LOCK_UN)
    _lock_file.close()
    _lock_file = None


def assert_same_answers(expected: list[dict], actual: list[dict]) -> None:
    """Every case has one result in both runs, with the same error or the same probabilities."""
    assert [r["case_id"] for r in actual] == [r["case_id"] for r in expected]
    for want, got in zip(expected, actual):
        assert _same_text(got["error"]) == _same_text(want["error"]), (got["case_id"], want["error"], got["error"])
        if want["error"] is None:
            _assert_close(want["response"]["answers"], got["response"]["answers"], f"case {got['case_id']}")
            assert got["input_tokens"] == want["input_tokens"]


def _same_text(error: str | None) -> str | None:
    """An error message without the object addresses Python puts in some (they differ between processes)."""
    return None if error is None else re.sub(r" at 0x[0-9a-f]+", "", error)


def _assert_close(want, got, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_close(want[key], got[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(want, got)):
            _assert_close(a, b, f"{where}[{index}]")
    elif isinstance(want, float):
        assert math.isclose(want, got, abs_tol=TOLERANCE), f"{where}: {want} != {got}"
    else:
        assert want == got, where
