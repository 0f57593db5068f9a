"""What the workbench and the HTTP server may ask of an engine, the local `Engine` or a `RemoteEngine` alike: these
methods and nothing else (no probing for attributes, no reaching into an encoder or scheduler). Torch-free.

A request is a plain dict or a `ValidRequest` (see protocol.prepare), which carries its own token budget and
overflow policy: `max_length` / `overflow` apply to plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from .protocol import Question, Response, ValidRequest

Request: TypeAlias = Mapping[str, Any] | ValidRequest


@runtime_checkable
class DecisionEngine(Protocol):
    """A model that answers System One requests, here or at an endpoint."""

    @property
    def model_id(self) -> str:
        """What runs record as the model."""
        ...

    @property
    def token_budget(self) -> int | None:
        """The most tokens one batch, so one request, may take; None where the endpoint decides."""
        ...

    def validate(self, request: Request, *, max_length: int | None = None, overflow: str | None = None,
                 questions: tuple[Question, ...] | None = None) -> ValidRequest:
        """protocol.prepare: the request validated once, or RequestError naming every problem."""
        ...

    def submit(self, requests: Sequence[Request], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse", errors: str = "raise") -> Future:
        """Queue the requests; the future resolves to one System One response per request (with errors="return",
        a request's own error in its slot instead)."""
        ...

    def decide(self, request: Request, *, max_length: int | None = None, overflow: str = "refuse") -> Response:
        ...

    def decide_many(self, requests: Sequence[Request], *, max_length: int | None = None, overflow: str = "refuse",
                    priority: str = "bulk", errors: str = "raise") -> list[Any]:
        ...

    def count_tokens(self, request: Request, *, max_length: int | None = None) -> dict[str, int] | None:
        """Token counts of each part; None where the tokenizer is elsewhere (a remote endpoint)."""
        ...

    def sample_video_frames(self, video: bytes) -> Any | None:
        """The frames the model reads of a video file (a media.Video; MediaError if it cannot be decoded), or None
        where the sampling happens elsewhere (a remote endpoint)."""
        ...

    def queue_position(self, future: Future) -> int | None:
        """Jobs ahead of `future` in the queue; None once it runs, or where the queue is elsewhere."""
        ...

    def queue_depth(self) -> int:
        ...

    def abandon(self, future: Future) -> None:
        """Its caller gives up on `future`: its work stops, or at least never starts."""
        ...

    def info(self) -> dict[str, Any]:
        """What the workbench shows about the model (no network call: pages poll it)."""
        ...

    def close(self, wait: bool = False) -> None:
        """Take no more work; `wait`: return once the work already taken has ended (before a process exits)."""
        ...


@runtime_checkable
class ExplainingEngine(DecisionEngine, Protocol):
    """An engine that also explains its answers (the local engine: a remote endpoint does not)."""

    def explain(self, request: Request, unit: str | None = None, *, max_length: int | None = None,
                overflow: str = "refuse") -> Response:
        ...

    def submit_explanation(self, request: Request, unit: str | None = None, *, priority: str = "interactive",
                           max_length: int | None = None, overflow: str = "refuse",
                           max_tokens: int | None = None) -> Future:
        ...


if TYPE_CHECKING:  # mypy, which has this module on its list, checks that both engines implement the protocols
    from .engine import Engine
    from .remote import RemoteEngine

    def _both_engines_implement_the_protocol(local: Engine, remote: RemoteEngine) -> None:
        engine: DecisionEngine = local
        engine = remote
        explaining: ExplainingEngine = local
        del engine, explaining
