"""What the store takes and returns, typed: the rows (JSON columns decoded) and the settings a run keeps. A result
keeps the engine's response as it came (clef_engine.protocol.Response). Rows are plain dicts at run time
(TypedDicts): a page indexes them as before."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NotRequired, TypedDict

from clef_engine.protocol import OverflowPolicy, Response

Label = str | bool | int  # an expected answer or a reviewer's label: option id, noul's bool, score level


class RayPlacement(TypedDict):
    """Where a run on Ray ran: the cluster's address, how many replicas, their nodes."""

    address: str
    replicas: int
    nodes: list[str]


@dataclass(frozen=True)
class RunSettings:
    """How a run runs, kept with it; the one place its defaults are decided. `max_length`: a case's token budget
    (None: the engine's); `overflow`: what a state over it gets; `chunk_size` cases per chunk, else chunks of about
    `chunk_tokens` tokens (None: the runner's); `schema_slug`: the library schema it was started from; `device`,
    `dtype`, `precision`, `ray`: where and how it ran, for the record."""

    max_length: int | None = None
    overflow: OverflowPolicy = "refuse"
    chunk_size: int | None = None
    chunk_tokens: int | None = None
    schema_slug: str | None = None
    device: str | None = None
    dtype: str | None = None
    precision: str | None = None
    ray: RayPlacement | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSettings:
        """The settings as stored; keys this workbench does not know are left out."""
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__})

    def to_json(self) -> dict[str, Any]:
        """The settings to store: those set (not None)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


class CaseSet(TypedDict):
    id: int
    name: str
    schema_name: str | None
    description: str
    created_at: str
    deleted_at: str | None
    case_count: int


class Media(TypedDict):
    content_type: str
    data: bytes


class NewCase(TypedDict):
    """A case to add: its state (the evidence), media as bytes, expected answers, tags and its own id."""

    state: Any
    images: NotRequired[list[bytes] | None]
    videos: NotRequired[list[bytes] | None]
    expected: NotRequired[dict[str, Label] | None]
    tags: NotRequired[list[str] | None]
    source_id: NotRequired[str | None]


class Case(TypedDict):
    id: int
    case_set_id: int
    position: int
    source_id: str | None
    state: Any
    expected: dict[str, Label]
    tags: list[str]
    image_count: int
    video_count: int
    images: NotRequired[list[Media]]  # with media only
    videos: NotRequired[list[Media]]


class Batch(TypedDict):
    """What a run and a sweep share: a schema over a case set's cases on one model, and where it stands."""

    id: int
    case_set_id: int
    case_set_name: str
    schema: dict[str, Any]  # name, version, description, questions: the content it ran (a sweep's: its base)
    schema_name: str
    schema_version_id: int | None
    model_id: str
    model_revision: str | None
    status: str
    error: str | None
    created_at: str
    started_at: str | None
    finished_at: str | None
    total: int  # its cases (a run's: those of its case set)
    done: int  # cases finished (a run's: with a result; a sweep's: with every variant's answer)


class Run(Batch):
    schema_version: str
    schema_slug: str | None  # of the linked schema version; None: content never saved in the library
    settings: RunSettings
    deleted_at: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    errors: int  # results that are an error


class NewResult(TypedDict):
    """One case's outcome to record: a response or an error (timestamps default to the time of recording)."""

    case_id: int
    response: NotRequired[Response]
    error: NotRequired[str]
    latency_ms: NotRequired[float]
    input_tokens: NotRequired[int | None]
    token_counts: NotRequired[dict[str, int] | None]
    started_at: NotRequired[str]
    finished_at: NotRequired[str]


class Answered(TypedDict):
    """What scoring (stats.answer_frame) reads of a case's answer: a Result is one, a sweep's answer makes one."""

    case_id: int
    position: int
    response: Response | None
    error: str | None
    expected: dict[str, Label]
    latency_ms: float | None
    input_tokens: int | None


class Result(Answered):
    """A result with its case's own id, state and tags."""

    id: int
    run_id: int
    token_counts: dict[str, int] | None
    started_at: str
    finished_at: str
    source_id: str | None
    state: Any
    tags: list[str]


class NewReviewItem(TypedDict):
    run_id: int
    case_id: int
    question_id: str
    question_type: str
    distribution: dict[str, float]  # option → p
    predicted: str
    confidence: float
    margin: float
    reason: str
    model_id: str
    schema_name: str
    schema_version: str


class ReviewItem(NewReviewItem):
    id: int
    status: str
    label: Label | None
    reviewer: str | None
    version: int  # what a reviewer's action must name (see apply_review_action)
    created_at: str
    updated_at: str


class ItemState(TypedDict):
    """What a review action changes on its item."""

    status: str
    label: Label | None
    reviewer: str | None


class ReviewAction(TypedDict):
    id: int
    item_id: int
    run_id: int
    case_id: int
    question_id: str
    reviewer: str
    at: str
    action: str
    before: ItemState
    after: ItemState
    comment: str | None
    undoes_action_id: int | None


class Change(TypedDict):
    """An entry of the change log: a delete or a restore."""

    id: int
    at: str
    who: str
    action: str
    kind: str
    object_id: str
    label: str
    data: Any


class SchemaVersion(TypedDict):
    id: int
    slug: str
    number: int
    content_hash: str
    run_hash: str
    schema: dict[str, Any]
    action: str
    who: str
    note: str  # where it came from, when that is more than its action (a sweep adopted: its name and figures)
    created_at: str
    run_count: int  # runs (not deleted) that ran it


class RecordedSchemaVersion(SchemaVersion):
    new: bool  # just written (False: the slug's latest version had this content already)


class Calibration(TypedDict):
    id: int
    name: str
    run_id: int
    schema_name: str
    schema_version_id: int | None
    model_id: str
    payload: dict[str, Any]
    created_at: str


class SweepVariant(TypedDict):
    """A schema sweep's variant: the schema it runs, and per question the map of its option ids back to the base's."""

    name: str
    kind: str
    question: str | None  # the question it changes (None: several, or none)
    schema: dict[str, Any]
    relabel: dict[str, dict[str, str]]


class Sweep(Batch):
    settings: dict[str, Any]
    variant_count: int
    state_prefills: int  # states computed for the done cases
    variants: NotRequired[list[SweepVariant]]  # get_sweep's, in order


class SweepAnswer(TypedDict):
    """One variant's answer to one case, with the case's position and expected answers."""

    case_id: int
    position: int
    variant: int  # its position
    response: Response | None  # None: it failed
    error: str | None
    expected: dict[str, Label]
