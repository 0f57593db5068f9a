"""Why: which part of a record's evidence moved each answer (evidence attribution; docs/api.md says what a client
gets).

The evidence is split into segments — sentences (or lines) of a text state, leaf fields of a JSON state, a grid of
regions of each image, the sampled frames of each video — and the record is decided again once per segment with it
removed, every variant in one scheduler job. Text is deleted, a field deleted from its object or list; a region or
frame is painted in its image's mean colour, so that the token count, and the batch's shape, stay the same. A text
variant shares every token before its first change with the record, so on the packed path the record runs once, in
chunks ending at those points, and each variant continues from there (`SharedPrefixes`).

Each segment's `delta` is P(answered option without it) − P(answered option), from the unrounded probabilities: the
answered option is the one the full record picks. An explanation may cost `EXPLAIN_BATCHES` interactive batches of
tokens (less under a server's per-request ceiling); one over that is refused, counted from its segments before any
variant is built. `explain` (the workbench's Why: a person waits) runs the variants as interactive work; the HTTP
server's `Explaining` as bulk work.
"""

from __future__ import annotations

import copy
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from .errors import Problem, RequestError, TokenBudgetError
from .interface import DecisionEngine, ExplainingEngine, Request
from .model import media
from .model.encoding import MEDIA_SLOTS, EncodedRecord, render
from .protocol import EXPLAIN_UNITS, ExplainOption, Response, explain_unit_problem, prepare
from .runner import SharedPrefixes
from .scheduler import JobTiming

if TYPE_CHECKING:
    from .engine import Engine

MEDIA_UNITS = ("region", "frame")
REGION_GRID = 4  # an image is split into REGION_GRID × REGION_GRID regions
EXPLAIN_BATCHES = 4  # an explanation may take this many interactive batches' worth of tokens
ENCODE_GROUP = 16  # text variants tokenized at once, on every core: past the budget, at most this many more
UNIT_NEEDS = {"sentence": 'sentences need a text state; this state is JSON (use "field")',
              "line": 'lines need a text state; this state is JSON (use "field")',
              "field": "fields need a JSON object or list as the state", "region": "regions need at least one image",
              "frame": "frames need at least one video"}

# A sentence: from a non-space character to sentence-ending punctuation (closing quotes and brackets kept) followed by
# a space, or to the end of its line, then the whitespace after it. Segments cover the state from its first
# non-space character on, so deleting one leaves the others as they were written.
SENTENCE = re.compile(r"\S.*?(?:[.!?…。！？]+[\"'”’)\]]*(?=\s|\Z)|(?=\n)|\Z)\s*", re.S)
LINE = re.compile(r"\S[^\n]*(?:\n|\Z)\s*")


# ---- segments ---------------------------------------------------------------------------------------------------


def text_spans(text: str, unit: str = "sentence") -> Iterator[tuple[int, int]]:
    """[start, end) character spans of the sentences (or lines) of `text`, each with the whitespace after it;
    lazily."""
    pattern = LINE if unit == "line" else SENTENCE
    return (match.span() for match in pattern.finditer(text) if match.end() > match.start())


def json_leaves(value: Any) -> Iterator[tuple[list, Any]]:
    """(path, value) of every leaf of a JSON value: scalars and empty objects or lists, in the value's own order.
    Lazy, so that counting the first few leaves of a large state costs only those."""
    stack: list[tuple[list, Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict) and item:
            stack.extend(([*path, key], child) for key, child in reversed(item.items()))
        elif isinstance(item, list) and item:
            stack.extend(([*path, index], child) for index, child in reversed(list(enumerate(item))))
        elif path:
            yield path, item


def without_field(value: Any, path: list) -> Any:
    """A copy of a JSON value with the field at `path` deleted (from its object, or from its list)."""
    copied = copy.deepcopy(value)
    parent = copied
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return copied


def mean_colour(pixels: np.ndarray) -> np.ndarray:
    """The mean colour of an H×W×3 uint8 image, rounded to the nearest integer per channel."""
    return np.rint(pixels.reshape(-1, 3).mean(axis=0)).astype(np.uint8)


def region_boxes(width: int, height: int, grid: int = REGION_GRID) -> list[tuple[int, int, int, int]]:
    """(left, top, right, bottom) pixel boxes of a grid × grid split of an image, row by row; edges rounded down."""
    xs = [width * i // grid for i in range(grid + 1)]
    ys = [height * i // grid for i in range(grid + 1)]
    return [(xs[c], ys[r], xs[c + 1], ys[r + 1]) for r in range(grid) for c in range(grid)
            if xs[c + 1] > xs[c] and ys[r + 1] > ys[r]]


def without_frame(video: media.Video, index: int) -> media.Video:
    """The sampled video with its `index`-th sampled frame painted in that frame's mean colour."""
    frames = video.frames.copy()
    frames[index] = mean_colour(frames[index])
    return media.Video(frames, video.fps, list(video.frame_indices), video.total_frames)


Segment = tuple[dict, Callable[[], dict]]  # (location, the request without that segment, built when called)


def segments(request: Mapping[str, Any], record: EncodedRecord, unit: str | None = None) -> Iterator[Segment]:
    """(location, variant) for every segment of the request, lazily: a caller counts them before any variant is
    built. `unit` None: sentences of a text state or fields of a JSON state, plus the regions of every image and the
    frames of every video; else only that kind. Text segments (sentences, lines, fields) come first, then media
    ones. Media in the variants are the decoded images and the sampled videos the record was made from, so nothing
    is decoded more than once. `unit` is one of EXPLAIN_UNITS."""
    state = request["state"]
    opened = [media.open_image(item) for item in request.get("images") or []]  # headers: sizes, no pixels
    decoded = _Decoded(opened)
    videos = list(record.videos)
    base = dict(request, videos=videos) if videos else dict(request)

    def variant(**evidence: Any) -> dict:
        return dict(base, images=decoded.images(), **evidence) if opened else dict(base, **evidence)
    wanted = {unit} if unit is not None else {"sentence", "field", "region", "frame"}
    text, fields = isinstance(state, str), isinstance(state, (dict, list))
    present = {"sentence": text, "line": text, "field": fields, "region": bool(opened), "frame": bool(videos)}
    if unit is not None and not present[unit]:
        raise RequestError([Problem(("x_explain", "unit"), UNIT_NEEDS[unit])])
    if wanted & {"sentence", "line"} and text:
        for start, end in text_spans(state, unit or "sentence"):
            yield ({"kind": unit or "sentence", "start": start, "end": end, "text": state[start:end]},
                   partial(lambda s, e: variant(state=state[:s] + state[e:]), start, end))
    if "field" in wanted and fields:
        for path, value in json_leaves(state):
            yield ({"kind": "field", "path": path, "text": render(value)},
                   partial(lambda p: variant(state=without_field(state, p)), path))
    if "region" in wanted:
        for i, image in enumerate(opened):
            for box in region_boxes(image.width, image.height):
                yield ({"kind": "region", "image": i, "box": list(box)},
                       partial(lambda i, box: dict(base, images=decoded.without_region(i, box)), i, box))
    if "frame" in wanted:
        for v, video in enumerate(videos):
            for k, source_index in enumerate(video.frame_indices):
                location: dict[str, Any] = {"kind": "frame", "video": v, "frame": source_index}
                if video.fps:
                    location["seconds"] = round(source_index / video.fps, 3)
                yield location, partial(
                    lambda v, k: variant(videos=videos[:v] + [without_frame(videos[v], k)] + videos[v + 1:]), v, k)


class _Decoded:
    """The request's images, decoded once, when a region variant first needs them (each with its RGB pixels and
    mean colour), shared by the threads that build the variants."""

    def __init__(self, opened: list):
        self._opened = opened
        self._lock = threading.Lock()
        self._images: list | None = None

    def images(self) -> list:
        with self._lock:
            if self._images is None:
                self._images = [media.decode_image(image) for image in self._opened]
                self._pixels = [np.asarray(image) for image in self._images]
                self._colours = [mean_colour(pixels) for pixels in self._pixels]
            return self._images

    def without_region(self, index: int, box: tuple[int, int, int, int]) -> list:
        """The images with image `index`'s `box` painted in its mean colour."""
        images = self.images()
        painted = self._pixels[index].copy()
        left, top, right, bottom = box
        painted[top:bottom, left:right] = self._colours[index]
        return images[:index] + [Image.fromarray(painted)] + images[index + 1:]


# ---- a segmentation that fits ------------------------------------------------------------------------------------


def segment_counts(request: Mapping[str, Any], frame_counts: Sequence[int]) -> dict[str, int]:
    """How many segments each unit makes of a request (as `segments` makes them, without making them), given how many
    frames the model samples from each of its videos; the units that make none are left out."""
    state = request["state"]
    if isinstance(state, str):
        counts = {"sentence": sum(1 for _ in text_spans(state)), "line": sum(1 for _ in text_spans(state, "line"))}
    else:
        counts = {"field": sum(1 for _ in json_leaves(state))}
    counts["region"] = sum(len(region_boxes(image.width, image.height))
                           for image in map(media.open_image, request.get("images") or []))
    counts["frame"] = sum(frame_counts)
    return {unit: count for unit, count in counts.items() if count}


def unit_that_fits(counts: Mapping[str, int], record_tokens: int, budget: int) -> str | None:
    """Of the units `counts` lists, the one with the most segments whose explanation surely fits the `budget` of one
    explanation (no variant is longer than the record): what to explain by when everything at once, or the unit
    asked for, is over it. None when no unit fits."""
    fitting = [unit for unit, count in counts.items() if record_tokens * (1 + count) <= budget]
    return max(fitting, key=lambda unit: counts[unit], default=None)


# ---- deciding the variants ----------------------------------------------------------------------------------------


def explanations(record: EncodedRecord, found: list[Segment], probabilities: list) -> dict[str, list]:
    """Per question id, the segments with their `delta`, largest |delta| first (ties in the state's order)."""
    base = probabilities[0]
    # per question, the option (model order) its answer gives: the likeliest, ties to the first
    chosen = [max(range(len(probs)), key=lambda k: (probs[k], -k)) for probs in base]
    out: dict[str, list] = {}
    for q, question in enumerate(record.questions):
        k = chosen[q]
        ranked = [dict(location, delta=variant[q][k] - base[q][k])
                  for (location, _), variant in zip(found, probabilities[1:])]
        ranked.sort(key=lambda segment: -abs(segment["delta"]))
        out[question.id] = ranked
    return out


def explain_budget(engine: Engine, max_tokens: int | None = None) -> int:
    """The most tokens one explanation may take: EXPLAIN_BATCHES interactive batches, or `max_tokens` (a server's
    token ceiling per request) when that is less."""
    budget = EXPLAIN_BATCHES * engine.token_budget
    return budget if max_tokens is None else min(budget, max_tokens)


def check_cost(record_tokens: int, variants: int, total: int, budget: int, *, at_least: bool = False,
               more_variants: bool = False) -> None:
    """Raise TokenBudgetError when the record and its variants, `total` tokens (a lower bound if `at_least`), do
    not fit the budget of one explanation (`more_variants`: the segments were counted no further than that)."""
    if total <= budget:
        return
    bound = "at least " if at_least else ""
    counted = "at least " if more_variants else ""
    raise TokenBudgetError(
        f"explaining this record takes {bound}{total:,} tokens (the record, {record_tokens:,} tokens, and {counted}"
        f"{variants:,} variants of it, one per segment), {bound}{total - budget:,} over the {budget:,}-token budget of "
        f"one explanation ({EXPLAIN_BATCHES} interactive batches)",
        advice="ask for fewer segments (another unit) or shorten the record", over_by=total - budget,
        part="explanation", token_counts={"record": record_tokens, "variants": variants, "explanation": total},
        max_length=budget)


def submit_explanation(engine: Engine, request: Request, unit: str | None = None, *, priority: str = "interactive",
                       max_length: int | None = None, overflow: str = "refuse",
                       max_tokens: int | None = None) -> Future:
    """Encode the request and its variants now (raising RequestError / TokenBudgetError), decide them all as one
    scheduler job; the future resolves to the request's System One response with `x_explanations` added (and
    `x_explain_tokens`, what the explanation cost). `max_tokens`: at most this many tokens in all (see
    explain_budget)."""
    started = time.perf_counter()
    if unit is not None and unit not in EXPLAIN_UNITS:
        raise RequestError([explain_unit_problem({"unit": unit})])
    valid = prepare(request, max_length=max_length, overflow=overflow)
    record = engine.encode(valid)
    budget = explain_budget(engine, max_tokens)
    # Cheapest first, nothing built before it is known to fit: every variant has at least the record's tokens but
    # its state's (a media variant has the record's own length), so the segments are counted only as far as that
    # many could fit; then the text variants are built and tokenized, ENCODE_GROUP at once, each one's exact count
    # added as it comes; the media variants, whose pixels are processed, are built last, as many at once as the
    # encoder has processors.
    fixed = max(1, len(record) - record.token_counts["state"])
    found = list(itertools.islice(segments(valid.request, record, unit), budget // fixed + 1))
    media_variants = sum(location["kind"] in MEDIA_UNITS for location, _ in found)
    text_variants = len(found) - media_variants
    total = len(record) * (1 + media_variants) + fixed * text_variants
    check_cost(len(record), len(found), total, budget, at_least=bool(text_variants),
               more_variants=len(found) > budget // fixed)
    text_records: list[EncodedRecord] = []
    for start in range(0, text_variants, ENCODE_GROUP):
        group = found[start: min(start + ENCODE_GROUP, text_variants)]
        for variant_record in engine.encoder.encode_many([valid.with_evidence(variant()) for _, variant in group]):
            text_records.append(variant_record)
            total += len(variant_record) - fixed
            check_cost(len(record), len(found), total, budget, at_least=len(text_records) < text_variants)
    media_records: list[EncodedRecord] = []
    if media_variants:  # built and encoded on up to MEDIA_SLOTS threads: that many variants' pixels held at most
        with ThreadPoolExecutor(min(MEDIA_SLOTS, media_variants), thread_name_prefix="clef-explain") as pool:
            media_records = list(pool.map(lambda segment: engine.encode(valid.with_evidence(segment[1]())),
                                          found[text_variants:]))
    records = [record, *text_records, *media_records]
    shared = engine.config.packed and not record.has_media  # text variants of a text record: the packed runner's

    def respond(results: list, timing: JobTiming) -> list[Response]:
        probabilities = results[0] if shared else results
        # timed like every answer; its compute is the record's and its variants' (what the explanation cost)
        response = engine.response(valid, record, probabilities[0], (time.perf_counter() - started) * 1000,
                                   compute_ms=sum(timing.compute_s) * 1000, queue_ms=timing.queued_s * 1000)
        response["x_explanations"] = explanations(record, found, probabilities)
        response["x_explain_tokens"] = sum(len(r) for r in records[1:])
        return [response]

    job = [SharedPrefixes(records)] if shared else records
    return engine.scheduler.submit(job, priority=priority, finalize=respond)


@dataclass(frozen=True)
class Explaining:
    """An engine whose `submit` answers with explanations: what the HTTP server calls for `"x_explain"`."""

    engine: ExplainingEngine
    unit: str | None
    max_tokens: int | None = None

    def submit(self, requests: Sequence[Request], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse") -> Future:
        """The explanation as bulk work whatever `priority` asks: its variants are many records, and a client's small
        decide must wait for a layer of them at most, not for all of them (see Scheduler)."""
        (request,) = requests
        return self.engine.submit_explanation(request, self.unit, priority="bulk", max_length=max_length,
                                              overflow=overflow, max_tokens=self.max_tokens)

    def abandon(self, future: Future) -> None:
        self.engine.abandon(future)


def explaining(engine: DecisionEngine, option: bool | ExplainOption | None,
               max_tokens: int | None = None) -> DecisionEngine | Explaining:
    """The engine as the server should call it for a request's `x_explain` option (validated by the contract's
    model: None, a bool, or an object with `unit`): the engine itself unless explanations are asked for, explaining
    within `max_tokens` in all (see explain_budget). Raises RequestError for an engine that does not explain (a
    remote endpoint)."""
    if option is None or option is False:
        return engine
    if not isinstance(engine, ExplainingEngine):
        raise RequestError([Problem(("x_explain",), "this model answers through a remote endpoint; explanations "
                                                    "need a model loaded here")])
    return Explaining(engine, option.unit if isinstance(option, ExplainOption) else None, max_tokens)
