"""What the tests share: fixtures (`fixtures`, loaded by tests/conftest.py), server and workbench processes, the
browser harness and its steps, sample files and requests. Test modules import from here, never from each other."""

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str):
    """`predicate()` once it is truthy, polled every 50 ms; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
