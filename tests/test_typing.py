"""mypy passes on the modules pyproject.toml's [tool.mypy] lists (the contract, the store, the UI-free services):
the ratchet that keeps them typed. Widen the list as modules get clean; never shorten it."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_mypy_passes_on_the_checked_modules():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_ratchet_covers_the_contract_and_the_store():
    checked = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert {"clef_engine/protocol.py", "clef_engine/errors.py", "clef_workbench/store"} <= set(checked)
