"""Shared fixtures: one tiny Clef-format release and one CPU engine per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    """A tiny release written by `build_tiny_release` (the same code as `python -m clef_engine tiny`)."""
    from clef_engine.tiny import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("tiny-release"), seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_release):
    """The tiny release loaded through the real loading path, on the CPU in float32."""
    import clef_engine

    engine = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    yield engine
    engine.close()
