"""The System One contract (spec §5), in one place: request and response models (the OpenAPI document is built
from them), the order the engine reads options in, shared defaults, request builders, and the hosted Clef service's
published limits (`HOSTED`, which only feed the workbench's lint: the contract accepts what the release code
accepts). Validation reports every problem with its location, so each message can stand by its field.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, NotRequired, TypedDict, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

from .errors import Problem, RequestError, TokenBudgetError

QuestionType = Literal["noul", "choice", "score"]
NoulOptionId = Literal["true", "false"]
# What to do when a record does not fit max_length: refuse it (HTTP 413), or cut the end of the state as the
# reference code does silently.
OverflowPolicy = Literal["refuse", "truncate_state"]

QUESTION_TYPES: tuple[str, ...] = get_args(QuestionType)
QUESTION_FIELDS = ("type", "instructions", "criteria")
NOUL_OPTION_IDS: tuple[str, ...] = get_args(NoulOptionId)
NOUL_DEFAULT_DESCRIPTIONS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
DEFAULT_MODEL_NAME = "clef"
DEFAULT_MAX_LENGTH = 16_384  # the release code's token budget of one record

# Media formats the engine decodes (the bytes decide, see sniff_content_type), with names for messages.
IMAGE_CONTENT_TYPES = ("image/png", "image/jpeg", "image/webp")
VIDEO_CONTENT_TYPES = ("video/mp4", "video/webm", "video/quicktime")
MEDIA_TYPE_NAMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP",
                    "video/mp4": "MP4", "video/webm": "WebM", "video/quicktime": "MOV"}
MAX_MEDIA_BYTES = 64 * 1024 * 1024  # one media item, before decoding
SURROGATE = re.compile("[\ud800-\udfff]")  # a code point no UTF-8 encoder (nor tokenizer) takes


def sniff_content_type(data: bytes) -> str | None:
    """The media type from the file's first bytes (the bytes decide, not a declared name or type), or None when it
    is none of the accepted formats."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp":
        # ISO base media: QuickTime brands are MOV, everything else we accept as MP4.
        return "video/quicktime" if data[8:12] == b"qt  " else "video/mp4"
    if data[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "video/quicktime"  # old QuickTime files without an ftyp box
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm"  # EBML header: WebM (or Matroska, which the decoder also reads)
    return None


@dataclass(frozen=True)
class HostedLimits:
    """Limits published for the hosted Clef service (spec §5), not the contract: a schema outside them works
    locally but the hosted service would refuse it. Videos have no published limit. Counts are ranges of the
    allowed numbers (`len(criteria) in HOSTED.choice_options`)."""

    questions: range = range(1, 64 + 1)
    choice_options: range = range(2, 255 + 1)
    score_levels: range = range(2, 10 + 1)
    question_id: re.Pattern = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
    question_id_rule: str = "1–100 letters, digits, '_', '.' or '-'"
    max_images: int = 4
    max_image_pixels: int = 16_000_000


HOSTED = HostedLimits()


# --- JSON values ----------------------------------------------------------------------------------------------


def _is_text(value: str) -> bool:
    """Valid JSON can carry unpaired surrogates ("\\ud800") that no tokenizer or UTF-8 encoder accepts."""
    return value.isascii() or not SURROGATE.search(value)


def _is_json_value(value: Any) -> bool:
    # A stack, not recursion: json.loads takes nesting deeper than Python's recursion limit allows a checker.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return False
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(k, str) and _is_text(k) for k in item):
                return False
            stack.extend(item.values())
        elif not (item is None or isinstance(item, (bool, int))):
            return False
    return True


def _json_value(value: Any) -> Any:
    if not _is_json_value(value):
        raise PydanticCustomError("json_value", "must be text or a JSON value (no NaN, infinity or unpaired "
                                                "surrogates)")
    return value


def _description(value: Any) -> Any:
    if value is None:  # every level is shown in the legend, so a level needs words
        raise PydanticCustomError("json_value", "a level description must be text or JSON, not null")
    return _json_value(value)


def _identifier(value: str) -> str:
    if not value:
        raise PydanticCustomError("id_empty", "ids must be non-empty strings")
    if not _is_text(value):
        raise PydanticCustomError("id_text", "ids must be valid text (no unpaired surrogates)")
    return value


# Pydantic accepts NaN, infinity and lone surrogates in `Any`; the engine cannot encode them.
JsonValue = Annotated[Any, AfterValidator(_json_value)]
Identifier = Annotated[str, AfterValidator(_identifier)]
_MEDIA_ITEM_SCHEMA = {"anyOf": [
    {"type": "string", "description": "a data URL, e.g. data:image/png;base64,…"},
    {"type": "object", "properties": {"content_type": {"type": "string", "description": "optional: the bytes decide"},
                                      "base64": {"type": "string"}}, "required": ["base64"]},
]}
# In-process callers may also pass PIL images, bytes, paths or frame arrays; model/media.py decodes each form.
MediaList = Annotated[list[Any], WithJsonSchema({"type": "array", "items": _MEDIA_ITEM_SCHEMA})]


# --- Request models -------------------------------------------------------------------------------------------


class _Question(BaseModel):
    model_config = ConfigDict(strict=True)

    instructions: JsonValue = Field(None, description="Text or any JSON value; empty or missing: the question id")


class NoulQuestion(_Question):
    """A yes/no question. Criteria override the default descriptions of `true` and `false`; null keeps one."""

    type: Literal["noul"]
    criteria: dict[NoulOptionId, JsonValue] | None = None


class ChoiceQuestion(_Question):
    """Pick one option. The model reads the options sorted by id; answers list them in the caller's order."""

    type: Literal["choice"]
    criteria: dict[Identifier, JsonValue] = Field(min_length=1, description="option id → description (or null)")


class ScoreQuestion(_Question):
    """A level on an ordered scale, lowest first; levels are answered as "0".."n-1"."""

    type: Literal["score"]
    criteria: list[Annotated[Any, AfterValidator(_description)]] = Field(min_length=1)


QuestionModel = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


ExplainUnit = Literal["sentence", "line", "field", "region", "frame"]
EXPLAIN_UNITS: tuple[str, ...] = get_args(ExplainUnit)


class ExplainOption(BaseModel):
    """Which segments to explain by: sentences or lines of a text state, fields of a JSON state, image regions, video
    frames. Without a unit: the state's sentences or fields, plus every image's regions and every video's frames."""

    model_config = ConfigDict(strict=True, extra="forbid")

    unit: ExplainUnit | None = None


class SystemOneRequest(BaseModel):
    """A System One request. Unknown top-level fields are allowed (hosted Jev accepts them)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = Field(None, description="Any model name; echoed in the response")
    state: JsonValue = Field(description="The record to decide on: text or any JSON value")
    questions: dict[Identifier, QuestionModel] = Field(min_length=1, description="Ordered map id → question")
    images: MediaList | None = None
    videos: MediaList | None = None
    x_max_length: int | None = Field(None, ge=1, description="Token budget of the record (server extension)")
    x_overflow: OverflowPolicy = Field(
        "refuse", description="Over budget: refuse (413) or cut the end of the state (server extension)")
    x_explain: bool | ExplainOption | None = Field(
        None, description="Add x_explanations: per question, how removing each segment of the evidence moves the "
                          "answered option's probability (server extension)")
    x_calibration: str | None = Field(
        None, description="Add x_calibrated: the answers as the named calibration maps them (server extension)")


# --- Response models ------------------------------------------------------------------------------------------


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(true), 4 decimals")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    confidence: float = Field(description="P(choice)")
    probabilities: dict[str, float] = Field(description="option id → p, in the caller's order")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="Σ i·p_i")
    confidence: float = Field(description="max p")
    legend: dict[str, Any]
    probabilities: dict[str, float]


AnswerModel = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class SystemOneResponse(BaseModel):
    """The answer to a request; servers may add `x_` fields."""

    model_config = ConfigDict(extra="allow")

    model: str
    answers: dict[str, AnswerModel]
    usage: Usage


class Response(TypedDict):
    """One System One response as an engine returns it and the server sends it (`SystemOneResponse` is its wire
    schema): the answers by question id, with the engine's `x_` extras (see Engine.response and RemoteEngine)."""

    model: str
    answers: dict[str, dict[str, Any]]
    usage: dict[str, int]
    x_latency_ms: float
    x_compute_ms: NotRequired[float]
    x_queue_ms: NotRequired[float]
    x_token_counts: NotRequired[dict[str, int]]
    x_truncated_state_tokens: NotRequired[int]
    x_calibrated: NotRequired[dict[str, dict[str, Any]]]  # the server's, with x_calibration
    x_explanations: NotRequired[dict[str, list]]  # Engine.explain's, with the tokens its variants took:
    x_explain_tokens: NotRequired[int]
    x_server_latency_ms: NotRequired[float]  # a remote engine's: what the endpoint reported as x_latency_ms
    x_attempts: NotRequired[int]  # a remote engine's: requests sent (retries included)


class ValidationProblem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """The 422 body: every problem of the request with its location."""

    detail: list[ValidationProblem]


# --- Validation -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    """One validated question, its options in the order the model reads them."""

    id: str
    type: str  # noul | choice | score
    instructions: Any  # str or any JSON value; rendered like the state
    option_ids: tuple[str, ...]  # model order: noul true,false; choice sorted by id; score "0".."n-1"
    option_descriptions: tuple[Any, ...]  # same order; None means "no description"
    caller_option_ids: tuple[str, ...]  # the order the caller wrote them (choice); used for the response


def option_ids(question_type: Any, criteria: Any) -> tuple[str, ...]:
    """A question's answer keys in the caller's order (noul true, false; choice as written; score "0".."n-1"),
    the keys of its answer's probabilities. Tolerates malformed criteria (no keys)."""
    if question_type == "noul":
        return NOUL_OPTION_IDS
    if question_type == "score":
        return tuple(str(i) for i in range(len(criteria))) if isinstance(criteria, list) else ()
    return tuple(str(k) for k in criteria) if isinstance(criteria, Mapping) else ()


def _to_question(question_id: str, model: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> Question:
    caller_ids = option_ids(model.type, model.criteria)
    if isinstance(model, NoulQuestion):
        descriptions = dict(NOUL_DEFAULT_DESCRIPTIONS)
        descriptions.update({k: v for k, v in (model.criteria or {}).items() if v is not None})
        return Question(question_id, "noul", model.instructions, NOUL_OPTION_IDS,
                        tuple(descriptions[o] for o in NOUL_OPTION_IDS), caller_ids)
    if isinstance(model, ChoiceQuestion):
        model_ids = tuple(sorted(model.criteria))  # the model reads choice options sorted by id
        return Question(question_id, "choice", model.instructions, model_ids,
                        tuple(model.criteria[o] for o in model_ids), caller_ids)
    return Question(question_id, "score", model.instructions, caller_ids, tuple(model.criteria), caller_ids)


# Clearer words than pydantic's for the mistakes callers make most.
_MESSAGES = {
    "missing": "field required",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "a question must be an object with \"type\", \"instructions\", \"criteria\"",
    "list_type": "must be a list",
    "string_type": "must be a string",
    "union_tag_not_found": "field required: one of noul, choice, score",
    "union_tag_invalid": "type must be one of noul, choice, score",
}
_CRITERIA_SHAPES = {
    "noul": "noul criteria must be null or a map with keys 'true'/'false'",
    "choice": "choice criteria must be a map option id → description",
    "score": "score criteria must be a list of level descriptions, lowest first",
}


def _problem(error: Mapping[str, Any], questions: Any) -> Problem:
    """A pydantic error as a Problem whose location is a path into the request and whose message says what the
    field must be."""
    loc = list(error["loc"])
    kind = error["type"]
    # Pydantic puts the discriminator tag after the question id and "[key]" after a bad key; neither is a place in
    # the request. A bad or missing tag is the question's "type" field.
    if len(loc) > 2 and loc[0] == "questions" and loc[2] in QUESTION_TYPES:
        del loc[2]
    if loc and loc[-1] == "[key]":
        loc.pop()
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        loc.append("type")
    message = _MESSAGES.get(kind, error["msg"])
    question = questions.get(loc[1]) if len(loc) > 1 and isinstance(questions, dict) else None
    question_type = question.get("type") if isinstance(question, dict) else None
    is_criteria = len(loc) == 3 and loc[2] == "criteria"
    if kind == "union_tag_invalid":
        message += f"; got {json.dumps(question_type, ensure_ascii=False)}"
    elif kind == "too_short" and loc == ["questions"]:
        message = "at least one question is required"
    elif kind == "too_short" and is_criteria:
        message = "a score needs at least one level" if question_type == "score" else \
            "a choice needs at least one option"
    elif kind in ("dict_type", "list_type") and is_criteria and question_type in _CRITERIA_SHAPES:
        message = _CRITERIA_SHAPES[question_type]
    elif kind == "literal_error" and len(loc) == 4 and loc[2] == "criteria":
        message = "noul criteria keys must be 'true' or 'false'"
    elif kind == "literal_error" and loc == ["x_overflow"]:
        message = f"x_overflow must be one of {', '.join(OVERFLOW_POLICIES)}"
    return Problem(tuple(loc), message, kind)


def validate_request(request: Any, model: type[SystemOneRequest] = SystemOneRequest) -> SystemOneRequest:
    """The request as a model, or RequestError listing every problem with its location."""
    if not isinstance(request, dict):
        raise RequestError([Problem((), "the request must be a JSON object", "dict_type")])
    try:
        return model.model_validate(request)
    except ValidationError as exc:
        questions = request.get("questions")
        errors = exc.errors(include_url=False)
        problems = [_problem(e, questions) for e in errors if e["loc"][:1] != ("x_explain",)]
        if len(problems) < len(errors):  # one problem for a bad x_explain, not one per member of its union
            problems.append(explain_unit_problem(request["x_explain"]))
        raise RequestError(problems) from None


def explain_unit_problem(value: Any) -> Problem:
    """The problem with a bad `x_explain`, or with a bad unit (`{"unit": value}`) given to the engine."""
    units = "|".join(f'"{u}"' for u in EXPLAIN_UNITS)
    if isinstance(value, dict) and set(value) <= {"unit"}:
        return Problem(("x_explain", "unit"), f"unit must be one of {', '.join(EXPLAIN_UNITS)}; got "
                                              f"{json.dumps(value['unit'], ensure_ascii=False)}", "literal_error")
    return Problem(("x_explain",), f'x_explain must be true, false or {{"unit": {units}}}', "value_error")


@dataclass(frozen=True)
class ValidRequest:
    """A request the contract accepted, validated once by `prepare` where it enters (the HTTP server, the job
    runner, the Decide page, `Engine.submit` for a plain dict) and never again on its way to the GPU: what the
    engine reads, with the budget it is encoded under. `request` is the request as given (not copied): what a remote
    engine sends and what explanations vary."""

    request: Mapping[str, Any]
    model: str | None
    state: Any
    questions: tuple[Question, ...]
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()
    max_length: int | None = None  # None: DEFAULT_MAX_LENGTH
    overflow: OverflowPolicy = "refuse"
    explain: bool | ExplainOption | None = None

    def with_evidence(self, variant: Mapping[str, Any]) -> ValidRequest:
        """The same questions and budget over the state and media of `variant`, a copy of `request` with evidence
        taken out (an explanation's variants): derived from validated evidence, so not validated again."""
        return replace(self, request=variant, state=variant["state"], images=tuple(variant.get("images") or ()),
                       videos=tuple(variant.get("videos") or ()))


class _EvidenceRequest(SystemOneRequest):
    """A request whose questions were validated before, with the schema they come from (see `prepare`)."""

    questions: Any = None


def prepare_questions(questions: Any) -> tuple[Question, ...]:
    """A schema's questions map validated once, as `prepare` would validate it inside a request: what a batch run
    hands `prepare` for each of its cases. Raises RequestError with the problems located under `questions`."""
    return prepare({"state": "", "questions": questions}).questions


def prepare(request: Any, *, max_length: int | None = None, overflow: str | None = None,
            questions: tuple[Question, ...] | None = None) -> ValidRequest:
    """Validate `request` once and return it as the engine consumes it; a ValidRequest is returned as it is, with
    its own budget. The budget is `max_length` / `overflow` when given, else the request's own `x_max_length` /
    `x_overflow` (the wire's fields), else the defaults. `questions`: the request's questions map as
    `prepare_questions` returned it for the schema it was built from (a batch run's cases share one schema): its
    questions are taken from there and the rest of the request is validated. Raises RequestError listing every
    problem with its location."""
    if isinstance(request, ValidRequest):
        return request
    if questions is None:
        model = validate_request(request)
        questions = tuple(_to_question(qid, q) for qid, q in model.questions.items())
    else:
        evidence = {k: v for k, v in request.items() if k != "questions"} if isinstance(request, dict) else request
        model = validate_request(evidence, _EvidenceRequest)
    max_length = model.x_max_length if max_length is None else max_length
    if max_length is not None and (type(max_length) is not int or max_length < 1):
        raise RequestError([Problem(("max_length",), "max_length must be a positive integer")])
    overflow = model.x_overflow if overflow is None else overflow
    if overflow not in OVERFLOW_POLICIES:
        raise RequestError([Problem(("overflow",), f"overflow must be one of {OVERFLOW_POLICIES}")])
    return ValidRequest(request=request, model=model.model, state=model.state, questions=questions,
                        images=tuple(model.images or ()), videos=tuple(model.videos or ()), max_length=max_length,
                        overflow=overflow, explain=model.x_explain)  # type: ignore[arg-type]


def check_schema_floor(request: Any, max_length: int) -> None:
    """Raise TokenBudgetError when the request's questions cannot fit `max_length` tokens, counted from their number
    and their options' before any validation: each question's header, "ALLOWED OPTIONS" and "END FIELD", and per
    option "OPTION k: ", its JSON and a newline, are text pieces of at least one token each (spec §2). So a request
    of thousands of questions is refused cheaply; a malformed question counts what it has."""
    questions = request.get("questions") if isinstance(request, dict) else None
    if not isinstance(questions, dict):
        return
    floor = 1  # the schema's header
    for question in questions.values():
        criteria = question.get("criteria") if isinstance(question, dict) else None
        options = 2 if isinstance(question, dict) and question.get("type") == "noul" else \
            len(criteria) if isinstance(criteria, (dict, list)) else 0
        floor += 3 + 3 * options
        if floor > max_length:
            raise TokenBudgetError(
                f"the {len(questions)} questions take at least {floor} tokens, over max_length {max_length} before "
                "any state", advice="ask fewer questions, with fewer options, or raise max_length",
                over_by=floor - max_length, part="schema", token_counts={"schema": floor}, max_length=max_length)


# --- The hosted service's limits ------------------------------------------------------------------------------


def _span(allowed: range) -> str:
    return f"{allowed[0]}–{allowed[-1]}"


def hosted_service_problems(questions: Any) -> list[Problem]:
    """Where the hosted Clef service would refuse a questions map that the contract accepts. Locations are in the
    request (`("questions", id, ...)`). Shapes the contract refuses are not repeated here."""
    problems: list[Problem] = []

    def refuse(loc: tuple[str | int, ...], what: str) -> None:
        problems.append(Problem(loc, f"the hosted service would refuse this: {what}", "hosted_limit"))

    if not isinstance(questions, dict):
        return problems
    if len(questions) not in HOSTED.questions:
        refuse(("questions",), f"it takes {_span(HOSTED.questions)} questions, this has {len(questions)}")
    for question_id, question in questions.items():
        loc = ("questions", question_id)
        if isinstance(question_id, str) and not HOSTED.question_id.fullmatch(question_id):
            refuse(loc, f"question ids must be {HOSTED.question_id_rule}")
        kind = question.get("type") if isinstance(question, dict) else None
        criteria = question.get("criteria") if isinstance(question, dict) else None
        if kind == "choice" and isinstance(criteria, dict):
            allowed, what = HOSTED.choice_options, "options"
        elif kind == "score" and isinstance(criteria, list):
            allowed, what = HOSTED.score_levels, "levels"
        else:
            continue
        if len(criteria) not in allowed:
            refuse((*loc, "criteria"), f"a {kind} takes {_span(allowed)} {what}, this has {len(criteria)}")
    return problems


# --- Building requests and formatting answers -----------------------------------------------------------------


def data_url(content_type: str, data: bytes) -> str:
    """The form a System One request carries media in."""
    return f"data:{content_type};base64,{base64.b64encode(data).decode('ascii')}"


def build_request(state: Any, questions: Mapping[str, Any], *, images: Iterable[str | bytes] = (),
                  videos: Iterable[str | bytes] = (), model: str = DEFAULT_MODEL_NAME) -> dict[str, Any]:
    """A System One request dict. Media are data URLs (see `data_url`, the wire's form) or bytes (what an engine
    in this process takes), images before videos, in the order given; the `images` / `videos` keys are present
    only when there are any."""
    media = {"images": list(images), "videos": list(videos)}
    return {"model": model, "state": state, "questions": questions, **{k: v for k, v in media.items() if v}}


def format_answer(question: Question, probabilities: list[float]) -> dict:
    """One System One answer from the option probabilities in model order (reference rounding: 4 decimals)."""
    by_id = dict(zip(question.option_ids, probabilities))
    if question.type == "noul":
        return {"type": "noul", "noul": round(by_id["true"], 4)}
    rounded = {o: round(by_id[o], 4) for o in question.caller_option_ids}
    if question.type == "choice":
        best = max(question.option_ids, key=lambda o: by_id[o])  # ties go to the first in model order
        return {"type": "choice", "choice": best, "confidence": round(by_id[best], 4), "probabilities": rounded}
    return {"type": "score", "score": round(sum(i * p for i, p in enumerate(probabilities)), 4),
            "confidence": round(max(probabilities), 4),
            "legend": dict(zip(question.option_ids, question.option_descriptions)), "probabilities": rounded}
