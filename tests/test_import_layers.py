"""The contract and the UI-free services load without the engine: a client, the store, the schema library and the
case-set services never pay for torch (seconds to import) or need it installed. Each check runs in a fresh
interpreter, as a user's process starts, because this test session has long since imported torch."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

TORCH_FREE = [
    "clef_engine",
    "clef_engine.protocol",
    "clef_engine.errors",
    "clef_engine.remote",
    "clef_workbench.store",
    "clef_workbench.schemas",
    "clef_workbench.schema_diff",
    "clef_workbench.schema_library",
    "clef_workbench.casesets",
    "clef_workbench.case_table",
    "clef_workbench.stats",
    "clef_workbench.compare",
    "clef_workbench.review",
    "clef_workbench.state_input",
]


def modules_loaded_by(statement: str) -> set[str]:
    """The module names `sys.modules` holds after running `statement` in a fresh interpreter."""
    probe = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_contract_and_the_store_import_without_torch():
    loaded = modules_loaded_by("import clef_engine.protocol, clef_workbench.store")
    assert "clef_engine.protocol" in loaded and "clef_workbench.store" in loaded
    assert "torch" not in loaded


def test_no_ui_free_module_imports_torch():
    # One interpreter for all: each module is imported in turn, and the first that brings torch in is named.
    probe = ("import importlib, sys\n"
             f"for name in {TORCH_FREE!r}:\n"
             "    importlib.import_module(name)\n"
             "    if 'torch' in sys.modules:\n"
             "        print('torch-came-with:' + name)\n"
             "        break")
    loaded = modules_loaded_by(probe)
    assert set(TORCH_FREE) <= loaded
    assert "torch" not in loaded, sorted(name for name in loaded if name.startswith("torch-came-with:"))


def test_the_engine_still_loads_on_first_use_through_the_package():
    loaded = modules_loaded_by("import clef_engine\nclef_engine.Engine, clef_engine.demo_release")
    assert {"torch", "clef_engine.engine", "clef_engine.tiny"} <= loaded


def test_contract_defaults_are_the_ones_the_engine_uses():
    from clef_engine import DEFAULT_MAX_LENGTH, protocol
    from clef_engine.model import encoding, media

    assert DEFAULT_MAX_LENGTH == protocol.DEFAULT_MAX_LENGTH == encoding.DEFAULT_MAX_LENGTH
    assert media.sniff_content_type is protocol.sniff_content_type
    assert media.MAX_MEDIA_BYTES == protocol.MAX_MEDIA_BYTES
