"""Clef engine: load a Clef / Clef-Flash release, keep it resident, and decide System One requests."""

from .engine import Engine, load
from .errors import BusyError, ClefError, Problem, ReleaseError, RequestError, TokenBudgetError
from .model.encoding import DEFAULT_MAX_LENGTH
from .tiny import demo_release, is_demo_release

__all__ = ["Engine", "load", "demo_release", "is_demo_release", "DEFAULT_MAX_LENGTH", "ClefError", "Problem",
           "RequestError", "TokenBudgetError", "ReleaseError", "BusyError"]
