"""What the tests share, so that no test module imports another (tests/project/test_layout.py): the fixtures
(`fixtures`, loaded by tests/conftest.py), server processes (`servers`), the browser harness and its steps, AppTest
steps, media, request bodies and the API's answer checks, recorded runs, failing endpoints and the helper processes
some tests start (`paused_run`, `readonly_store`). Here: the repository's root and `wait_for`."""

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
