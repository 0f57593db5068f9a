"""Clef engine: load a Clef / Clef-Flash release, keep it resident, and decide System One requests."""

from .encoding import DEFAULT_MAX_LENGTH
from .engine import Engine, demo_release, is_demo_release, load
from .errors import BusyError, ClefError, Problem, ReleaseError, RequestError, TokenBudgetError

__all__ = ["Engine", "load", "demo_release", "is_demo_release", "DEFAULT_MAX_LENGTH", "ClefError", "Problem",
           "RequestError", "TokenBudgetError", "ReleaseError", "BusyError"]
