"""Errors the engine raises for bad input. Each carries what a client needs to fix its request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a request: where (a path into the request JSON), what, and a machine-readable kind."""

    loc: tuple[str | int, ...]
    msg: str
    type: str = "value_error"

    def as_dict(self) -> dict:
        return {"loc": list(self.loc), "msg": self.msg, "type": self.type}


class ClefError(Exception):
    """Base class of every error the engine raises on purpose."""


class RequestError(ClefError, ValueError):
    """The request breaks the System One contract (HTTP 422). `problems` names every field at fault."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{'.'.join(map(str, p.loc))}: {p.msg}" for p in self.problems))


class TokenBudgetError(ClefError, ValueError):
    """The record does not fit in max_length (HTTP 413). `facts` says how many tokens over and which part is to
    blame; `advice` what would make it fit, in a Python caller's words (the HTTP server words its own)."""

    def __init__(self, facts: str, *, over_by: int, part: str, token_counts: dict[str, int], max_length: int,
                 advice: str = ""):
        self.facts = facts
        self.advice = advice
        self.over_by = over_by
        self.part = part
        self.token_counts = dict(token_counts)
        self.max_length = max_length
        super().__init__(f"{facts} — {advice}" if advice else facts)


class ReleaseError(ClefError):
    """A release folder or repo is missing, incomplete or of the wrong kind. The message says what to do."""


class BusyError(ClefError):
    """The GPU queue is full (HTTP 429). Try again later."""


class CancelledError(ClefError):
    """The request was cancelled before it ran."""
