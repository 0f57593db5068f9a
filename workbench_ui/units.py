"""Numbers as the pages show them (short enough for a metric at 1024 px), and refusals as their reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from clef_workbench.store import StoreError

T = TypeVar("T")


def refusal(action: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, str | None]:
    """(What `action` returned, None), or (None, why the store or a bad value refused it)."""
    try:
        return action(*args, **kwargs), None
    except (StoreError, ValueError) as exc:
        return None, str(exc)

SECONDS_ABOVE_MS = 10_000  # durations above this many milliseconds are shown in seconds


def duration(ms: float | None) -> str:
    """A duration given in milliseconds: "–", "850.2 ms", "12.3 s", "2 min 31 s"."""
    if ms is None:
        return "–"
    if ms <= SECONDS_ABOVE_MS:
        return f"{ms:,.1f} ms" if ms < 1000 else f"{ms:,.0f} ms"
    seconds = ms / 1000
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def rate(value: float | None, unit: str) -> str:
    """A rate per second: whole numbers from 100 up, else 3 digits."""
    if value is None:
        return "–"
    return (f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}") + f" {unit}/s"
