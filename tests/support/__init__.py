"""What the tests share: fixtures (`fixtures`, loaded by tests/conftest.py), server and workbench processes, the
browser harness and its steps, sample files and requests. Test modules import from here, never from each other."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
