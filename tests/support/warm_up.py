"""Watching an engine warm up on the tiny release (CPU), by events: warm-up turned on (CLEF_WARM_UP is off on the CPU
by default) and held at a step that waits for the test (`held_warm_up`), so every "before" and "after" is an event,
not a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

import clef_engine
from clef_engine.config import EngineConfig
from clef_engine.engine import Engine

WAIT_SECONDS = 120  # only a bound on a hang: every assertion waits for an event


def held_warm_up(monkeypatch: pytest.MonkeyPatch, gate: threading.Event, after: int = 0) -> list[str]:
    """Hold every engine's warm-up at a step that waits for `gate`, after its first `after` real steps; returns the
    names of the steps as they finish."""
    done: list[str] = []
    steps = Engine.warm_up_steps

    def counted(step: Callable[[], object], name: str) -> None:
        step()
        done.append(name)

    def held(self: Engine) -> list[Callable[[], None]]:
        real = steps(self)
        named = [*real[:after], gate.wait, *real[after:]]
        return [partial(counted, step, f"step {n}") for n, step in enumerate(named)]

    monkeypatch.setattr(Engine, "warm_up_steps", held)
    return done


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def warming_engine(tiny_release: Path) -> Engine:
    return clef_engine.load(tiny_release, config=EngineConfig.resolve(device="cpu", dtype="float32", warm_up=True))
