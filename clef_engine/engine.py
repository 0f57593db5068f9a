"""The resident engine: a loaded release, an encoder, and the GPU worker that runs batches.

`Engine.decide` / `decide_many` / `submit` encode in the caller's thread (so a bad request fails fast, off the
GPU), then hand records to the scheduler, the one place that groups records into GPU batches within a token budget.
The worker thread runs `forward_batch` on each batch, chosen once from the `EngineConfig`:

- `forward_plain` (packed=False): the release's own padded call for every record.
- `forward_packed` (default): records with media take the padded multimodal call; text records run through our
  packed layer loop (fast/packed.py): several records as one pack with no padding; a record alone in its batch
  replays a CUDA graph of its length bucket (fast/graphs.py), or, when its state is long enough to keep, runs once
  over the whole record and keeps the state's layer states (fast/cache.py) so that a new schema on the same state
  later runs only the schema's tokens. A record alone longer than `prefill_chunk_tokens` runs in chunks of that
  many tokens (bounded activations).

Then the joint head over the batch, and one host sync per batch.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .config import EngineConfig
from .errors import ClefError, RequestError, TokenBudgetError
from .explain import explain as explain_request
from .explain import submit_explanation as explanation_future
from .fast import attention, kernels
from .fast.cache import PrefixCache, StateCache, prefix_key
from .fast.graphs import HeadGraphs, PrefillGraphs
from .fast.head_kernels import head_attention_kernel
from .fast.packed import PackedBackbone, chunked_head_inputs, pack_ids
from .fast.segments import make_segments
from .fp8_fidelity import measured_fidelity
from .model import backbone, media, release
from .model.encoding import DEFAULT_MAX_LENGTH, EncodedRecord, Encoder
from .model.head import JointSchemaHead, layout, load_head, option_probabilities
from .protocol import Question, ValidRequest, format_answer, prepare, prepared
from .scheduler import PRIORITIES, BatchAbandoned, JobTiming, Scheduler, WorkerCall, device_turn
from .tiny import is_demo_release

LAYERS_AHEAD = 1  # in a bulk batch, how many layers the host may launch ahead of the GPU
DECIDE_MANY_GROUP = 16  # requests encoded and queued together by decide_many
ERROR_MODES = ("raise", "return")  # of submit / decide_many: a bad request raises, or its slot holds its error
LONG_ATTENTION_WARM_TOKENS = 2 * DEFAULT_MAX_LENGTH  # warm-up builds cuDNN's attention plans up to this length


def fast_kernels_available() -> dict[str, bool]:
    """Which optional fast kernels can be imported here (they are used only on CUDA)."""
    return {name: importlib.util.find_spec(module) is not None
            for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}


def check_fast_kernels(config: EngineConfig) -> None:
    """On CUDA, refuse to run on the per-record torch fallbacks unless told to (they are many times slower)."""
    if config.cuda and config.packed and not kernels.fla_importable() and not config.allow_slow_kernels:
        raise release.ReleaseError(
            "flash-linear-attention (package `fla`) is not importable, so the Gated DeltaNet layers would run on "
            "slow per-record PyTorch fallbacks. Install flash-linear-attention (and fla-core), or allow the slow "
            "path with allow_slow_kernels=True / CLEF_ALLOW_SLOW_KERNELS=1.")


def padded_chunks(records: list[EncodedRecord], indices, token_budget: int) -> list[list[int]]:
    """Indices grouped into padded batches: text apart from media, similar lengths together (sorted), each batch's
    padded size (count × longest) within the token budget; a record longer than the budget goes alone. (The padded
    call pays for padding, so it regroups the scheduler's batch by length.)"""
    chunks: list[list[int]] = []
    for index in sorted(indices, key=lambda i: (records[i].has_media, len(records[i]))):
        chunk = chunks[-1] if chunks else None
        if (chunk and records[chunk[0]].has_media == records[index].has_media
                and (len(chunk) + 1) * len(records[index]) <= token_budget):
            chunk.append(index)
        else:
            chunks.append([index])
    return chunks


def device_key(device: torch.device) -> str:
    """One name per physical device ("cuda" and "cuda:0" are the same GPU): engines on it share one GPU queue."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


class Engine:
    def __init__(self, checked: release.Release, model, head: JointSchemaHead, encoder: Encoder,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, *,
                 config: EngineConfig | None = None, load_seconds: float = 0.0, **options):
        """`config` as resolved by `load`; without it, one is resolved from `device`, `dtype` and `options`
        (EngineConfig fields)."""
        config = config or EngineConfig.resolve(device=device, dtype=dtype, **options)
        config.apply_process_settings()
        check_fast_kernels(config)
        self.config = config
        self.release = checked
        self.model = model
        self.head = head
        self.encoder = encoder
        self.device = config.device
        self.dtype = config.dtype
        self.load_seconds = load_seconds
        self.warm_up_seconds = 0.0
        self.model_id = checked.source
        self.output_embeddings = model.lm_head.weight  # the head reads it as a table (untied in Clef)
        self.loaded_bytes = self._memory_stats().get("allocated", 0)
        # counted once: info() is polled by every open workbench page
        self.backbone_parameters = sum(p.numel() for p in model.parameters())
        self.head_parameters = sum(p.numel() for p in head.parameters())
        # chosen (and checked on the device) here, on the loading thread: not first inside a CUDA graph capture
        head.attention = head_attention_kernel(self.device, self.dtype, head.config.width // head.config.heads)
        self.head_attention = head.attention.__name__
        self.token_budget = config.token_budget
        self.backbone: PackedBackbone | None = None
        self.graphs: PrefillGraphs | None = None
        self.head_graphs: HeadGraphs | None = None
        self.state_cache: StateCache | None = None
        self.prefix: PrefixCache | None = None
        self.forward_batch = self.forward_plain
        self.state_prefills = 0  # records whose state the backbone computed, rather than continued from a kept one
        self._fp8_fidelity: dict | str | None = None
        if config.packed:
            self.backbone = PackedBackbone(model, precision=config.precision)
            if config.fp8:  # the projections are FP8 now, their bf16 weights freed
                self.loaded_bytes = self._memory_stats().get("allocated", 0)
            self.forward_batch = self.forward_packed
            if config.cuda_graphs:
                self.graphs = PrefillGraphs(self.backbone, config.graph_max_tokens)
                self.head_graphs = HeadGraphs(head, self.output_embeddings)
            self.state_cache = StateCache(config.device, device_bytes=config.state_cache_bytes,
                                          host_bytes=config.state_cache_host_bytes,
                                          min_prefix_tokens=config.min_prefix_tokens,
                                          enabled=config.state_cache_bytes > 0)
            self.prefix = PrefixCache(self.state_cache, self.backbone, head, self.graphs,
                                      model_key=f"{self.model_id}@{checked.revision}",
                                      pad_token_id=encoder.pad_token_id, dtype=config.dtype)
        self.scheduler = Scheduler(self._counting_prefills(self.forward_batch), token_budget=config.token_budget,
                                   bulk_batch_tokens=config.bulk_batch_tokens,
                                   max_queued_records=config.max_queued_records,
                                   turn=device_turn(device_key(config.device)))

    # ---- requests ---------------------------------------------------------------------------------------------

    def validate(self, request: Any, *, max_length: int | None = None, overflow: str | None = None,
                 questions: tuple[Question, ...] | None = None) -> ValidRequest:
        """`request` validated once against the System One contract (no tokenization, no media decode), as `submit`
        and `encode` take it without validating it again; raises RequestError naming every problem. See
        protocol.prepare for the budget."""
        return prepare(request, max_length=max_length, overflow=overflow, questions=questions)

    def encode(self, request: Any, *, max_length: int | None = None, overflow: str = "refuse") -> EncodedRecord:
        """One record: a ValidRequest as it is (its own budget), a plain dict validated here under `max_length` /
        `overflow`."""
        return self.encoder.encode(request, max_length=max_length, overflow=overflow)

    def count_tokens(self, request: Any, *, max_length: int | None = None) -> dict[str, int]:
        """Token count of each part and how many state tokens would be cut at `max_length` (for a budget bar)."""
        limit = DEFAULT_MAX_LENGTH if max_length is None else max_length
        counts = self.encoder.count_tokens(prepared(request))
        counts["max_length"] = limit
        fixed = counts["total"] - counts["state"]
        counts["state_tokens_over"] = max(0, min(counts["state"], counts["total"] - limit))
        counts["fixed_tokens_over"] = max(0, fixed - limit)
        return counts

    def submit(self, requests: Sequence[Any], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse", errors: str = "raise") -> Future:
        """Encode now, run on the GPU worker later. A request is a ValidRequest (validated where it entered, encoded
        under its own budget) or a plain dict (validated here, once, under `max_length` / `overflow`). The future
        resolves to one System One response per request.
        errors="raise": a bad request (RequestError, TokenBudgetError) raises here, and a failure on the GPU fails
        the whole future. errors="return": each request's slot holds its response or its own error (a ClefError
        from encoding, or what its batch raised with the record alone, see Scheduler), so one bad request costs
        the others nothing: they are encoded and batched as if it were not there."""
        if errors not in ERROR_MODES:
            raise ValueError(f"errors must be one of {ERROR_MODES}, not {errors!r}")
        started = time.perf_counter()
        outcomes: list[Any] = [None] * len(requests)
        records: list[EncodedRecord] = []
        valids: list[ValidRequest] = []
        positions: list[int] = []
        for position, request in enumerate(requests):
            try:
                valid = prepared(request, max_length=max_length, overflow=overflow)
                records.append(self.encoder.encode(valid))
            except ClefError as error:
                if errors == "raise":
                    raise
                outcomes[position] = error
                continue
            valids.append(valid)
            positions.append(position)

        def respond(probabilities: list, timing: JobTiming) -> list[Any]:
            latency_ms = (time.perf_counter() - started) * 1000
            for position, valid, record, probs, compute_s in zip(positions, valids, records, probabilities,
                                                                 timing.compute_s, strict=True):
                outcomes[position] = probs if isinstance(probs, Exception) else self.response(
                    valid, record, probs, latency_ms, compute_ms=compute_s * 1000,
                    queue_ms=timing.queued_s * 1000)
            return outcomes

        return self.scheduler.submit(records, priority=priority, finalize=respond, per_record=errors == "return",
                                     timed=True)

    def decide(self, request: Any, *, max_length: int | None = None, overflow: str = "refuse") -> dict:
        return self.submit([request], priority="interactive", max_length=max_length, overflow=overflow).result()[0]

    def decide_many(self, requests: Sequence[Any], *, max_length: int | None = None, overflow: str = "refuse",
                    priority: str = "bulk", errors: str = "raise") -> list[Any]:
        """Responses in order. Submitted in groups as they are encoded, so the GPU starts on the first group while
        the rest are encoded; with errors="raise" a bad request raises before any answer is returned (groups
        queued before it are cancelled if they have not started), with errors="return" its slot holds its error
        (see submit)."""
        futures: list[Future] = []
        try:
            for start in range(0, len(requests), DECIDE_MANY_GROUP):
                futures.append(self.submit(requests[start: start + DECIDE_MANY_GROUP], priority=priority,
                                           max_length=max_length, overflow=overflow, errors=errors))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [response for future in futures for response in future.result()]

    def probabilities(self, requests: Sequence[Any], *, max_length: int | None = None,
                      overflow: str = "refuse") -> list[list[list[float]]]:
        """Per request, per question, the options' probabilities in model order, unrounded: what the answers are
        rounded from."""
        records = [self.encode(r, max_length=max_length, overflow=overflow) for r in requests]
        return self.scheduler.submit(records, priority="interactive").result()

    def decide_variants(self, requests: Sequence[Any], *, max_length: int | None = None, overflow: str = "refuse",
                        priority: str = "bulk", probabilities: bool = False) -> list[Any]:
        """Responses to requests over one state with different schemas (the variants of a schema sweep), as
        `decide_many` gives them, at the cost of one state: on the worker thread, in one call, the records that share
        a state prefix (tokens before the schema, and media) have it prefilled once (or taken from the state cache,
        which keeps it for a later call) and every schema continued from it (`PrefixCache.forward_after`), whatever
        the state's length (the cache's `min_prefix_tokens` weighs one reuse; here there are many). Each response
        says `x_state_cached`: true when its record continued from a state it did not compute itself. Records with
        media, and every record without the packed path, run as `decide_many` runs them. A bad request raises before
        anything runs. `probabilities`: per request, per question, the options' probabilities in model order,
        unrounded (as `probabilities`), instead of responses."""
        started = time.perf_counter()
        valids = [prepared(request, max_length=max_length, overflow=overflow) for request in requests]
        records = [self.encoder.encode(valid) for valid in valids]
        if self.prefix is None or any(record.has_media for record in records):
            outcomes = self.scheduler.submit(records, priority=priority).result()
            computed = set(range(len(records)))
        else:
            outcomes, computed = self.scheduler.submit(
                [WorkerCall(lambda: self._forward_shared_state(records))], priority=priority, tokens=float("inf"),
                finalize=lambda results: results[0]).result()
        if probabilities:
            return outcomes
        latency_ms = (time.perf_counter() - started) * 1000
        return [dict(self.response(valid, record, probs, latency_ms), x_state_cached=i not in computed)
                for i, (valid, record, probs) in enumerate(zip(valids, records, outcomes, strict=True))]

    @torch.inference_mode()
    def _forward_shared_state(self, records: list[EncodedRecord]) -> tuple[list[list[list[float]]], set[int]]:
        """decide_variants on the worker thread: per distinct state prefix, one prefill (`forward_for_store`, which
        also answers the first record) unless the cache holds it, then the other records continued from it. Returns
        the probabilities and the indices of the records whose state was computed."""
        results: dict[int, list[list[float]]] = {}
        computed: set[int] = set()
        groups: dict[str, list[int]] = {}
        for i, record in enumerate(records):
            key = prefix_key(self.prefix.model_key, record.input_ids[: record.state_end], record.media_digest)
            groups.setdefault(key, []).append(i)
        chunk = self.config.prefill_chunk_tokens
        for key, indices in groups.items():
            state = self.state_cache.get(key)
            if state is None:
                first = records[indices[0]]
                if 0 < chunk < len(first):
                    self.state_cache.make_room()  # as forward_one: a chunked record's activations take its room
                normed, memory, state = self.prefix.forward_for_store(first, self._between_layers(), chunk)
                self.state_prefills += 1
                computed.add(indices[0])
                results[indices[0]] = self.head_one(normed, memory, first)
                if self.state_cache.enabled:
                    self.state_cache.put(key, state)
                indices = indices[1:]
            for i in indices:
                results[i] = self.head_one(*self.prefix.forward_after(records[i], state), records[i])
        return [results[i] for i in range(len(records))], computed

    def explain(self, request: Any, unit: str | None = None, *, max_length: int | None = None,
                overflow: str = "refuse") -> dict:
        """The request's response plus `x_explanations`: per question, the state's segments (sentences, fields,
        image regions, video frames; or only `unit`) ranked by how much removing each moves the answer. See
        explain.py."""
        return explain_request(self, request, unit, max_length=max_length, overflow=overflow)

    def submit_explanation(self, request: Any, unit: str | None = None, *, priority: str = "interactive",
                           max_length: int | None = None, overflow: str = "refuse",
                           max_tokens: int | None = None) -> Future:
        """`explain` as a future (what the HTTP server waits on within its deadline), within `max_tokens` in all."""
        return explanation_future(self, request, unit, priority=priority, max_length=max_length, overflow=overflow,
                                  max_tokens=max_tokens)

    def sample_video_frames(self, video: bytes) -> media.Video:
        """The frames of a video file the video processor samples, what the model reads (T×H×W×3 uint8, fps, source
        frame indices, source frame count). Raises MediaError when the video cannot be decoded."""
        return media.load_video(video, self.encoder.video_sample_indices)

    def queue_position(self, future: Future) -> int | None:
        """Jobs ahead of `future` (from `submit`) in the GPU queue; None once it runs."""
        return self.scheduler.position(future)

    def response(self, request: ValidRequest, record: EncodedRecord, probabilities: list[list[float]],
                 latency_ms: float, *, compute_ms: float | None = None, queue_ms: float | None = None) -> dict:
        """One System One response. Beside the answers: `x_latency_ms`, from submission to the answer (queueing
        included); `x_compute_ms`, the record's share of the batch it ran in (by tokens); `x_queue_ms`, how long its
        job waited before its first batch started."""
        answers = {q.id: format_answer(q, probs) for q, probs in zip(record.questions, probabilities)}
        return {
            "model": request.model if isinstance(request.model, str) else self.model_id,
            "answers": answers,
            "usage": {"input_tokens": len(record), "output_tokens": 0},
            "x_latency_ms": round(latency_ms, 2),
            **({} if compute_ms is None else {"x_compute_ms": round(compute_ms, 3)}),
            **({} if queue_ms is None else {"x_queue_ms": round(queue_ms, 2)}),
            "x_token_counts": dict(record.token_counts),
            "x_truncated_state_tokens": record.truncated_state_tokens,
        }

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def limit_queue(self, records: int) -> None:
        """Refuse (BusyError) a submission that would leave more than `records` records waiting; takes effect at
        once, since the scheduler reads the bound on every submit."""
        self.scheduler.max_queued_records = max(1, records)

    # ---- the GPU worker: one scheduler batch at a time ----------------------------------------------------------

    def forward_plain(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The plain path for a whole scheduler batch: padded backbone batches of similar length."""
        results: dict[int, list[list[float]]] = {}
        for chunk in padded_chunks(records, range(len(records)), self.token_budget):
            for i, probs in zip(chunk, self.forward_padded([records[i] for i in chunk])):
                results[i] = probs
        return [results[i] for i in range(len(records))]

    @torch.inference_mode()
    def forward_packed(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The fast path for a whole scheduler batch: media records padded; a text record whose state is cached
        continues from the cache; a text record alone runs by itself (`forward_one`); the other text records run
        as one pack."""
        results: dict[int, list[list[float]]] = {}
        text = [i for i, r in enumerate(records) if not r.has_media]
        pack = []
        for i in text:
            cached = self.prefix.lookup(records[i]) if self.prefix is not None and len(text) > 1 else None
            if cached is not None:
                results[i] = self.head_one(*self.prefix.forward_after(records[i], cached), records[i])
            else:
                pack.append(i)
        if len(pack) == 1:
            results[pack[0]] = self.forward_one(records[pack[0]])
        elif pack:
            chosen = [records[i] for i in pack]
            lengths = [len(r) for r in chosen]
            segments = make_segments(lengths, self.device)
            hidden, _ = self.backbone.forward(pack_ids(chosen, self.device), segments,
                                              between_layers=self._between_layers())
            for i, probs in zip(pack, self.head_probabilities(hidden, chosen, segments.starts, lengths)):
                results[i] = probs
        media = [i for i, r in enumerate(records) if r.has_media]
        for chunk in padded_chunks(records, media, self.token_budget):
            for i, probs in zip(chunk, self.forward_padded([records[i] for i in chunk])):
                results[i] = probs
        return [results[i] for i in range(len(records))]

    def forward_one(self, record: EncodedRecord) -> list[list[float]]:
        """One text record: continued from its cached state; or, with a state long enough to keep, one forward that
        also returns the state, stored once the record is answered; or its length bucket's CUDA graph; or eager. A
        record longer than `prefill_chunk_tokens` runs in chunks (bounded activations, fast/packed.py)."""
        chunk = self.config.prefill_chunk_tokens
        key = self.prefix.key(record) if self.prefix is not None else None
        cached = self.state_cache.get(key) if key is not None else None
        if cached is not None:
            return self.head_one(*self.prefix.forward_after(record, cached), record)
        if 0 < chunk < len(record) and self.state_cache is not None:
            self.state_cache.make_room()  # earlier long states would add to this record's activations and state
        if key is not None:
            normed, memory, state = self.prefix.forward_for_store(record, self._between_layers(), chunk)
            answer = self.head_one(normed, memory, record)  # the answer's host sync first: storing is off its path
            self.state_cache.put(key, state)
            return answer
        ids = torch.tensor(record.input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        if 0 < chunk < len(record):
            normed, memory, _ = chunked_head_inputs(self.backbone, ids, self.head.token_memory, self.dtype, chunk,
                                                    between_layers=self._between_layers())
            return self.head_one(normed, memory, record)
        hidden = self.graphs.run(ids) if self.graphs is not None else None
        if hidden is None:
            hidden, _ = self.backbone.forward(ids, make_segments([len(record)], self.device),
                                              between_layers=self._between_layers())
        normed, memory = self.head.token_memory(hidden.to(self.dtype))
        return self.head_one(normed, memory, record)

    def _counting_prefills(self, forward_batch):
        """`forward_batch` counting in `state_prefills` the records of each batch not continued from the state
        cache (its hits during the batch)."""
        def counted(records: list[EncodedRecord]) -> list[list[list[float]]]:
            hits = self.state_cache.stats()["hits"] if self.state_cache is not None else 0
            try:
                return forward_batch(records)
            finally:
                after = self.state_cache.stats()["hits"] if self.state_cache is not None else 0
                self.state_prefills += len(records) - (after - hits)
        return counted

    def _between_layers(self):
        """For an eager forward: a callback between layers that stops the batch once every request in it was
        abandoned (its caller's deadline passed), and, inside a bulk batch, keeps the host at most LAYERS_AHEAD
        layers ahead of the GPU and runs the interactive requests waiting: they queue on the GPU behind a few layers
        of the bulk batch instead of all of it."""
        scheduler = self.scheduler
        if scheduler.running_priority != PRIORITIES["bulk"]:
            def check(_index: int) -> None:
                if scheduler.should_stop():
                    raise BatchAbandoned
            return check
        launched: list[torch.cuda.Event] = []

        def between(_index: int) -> None:
            if scheduler.should_stop():
                raise BatchAbandoned
            if self.config.cuda:
                event = torch.cuda.Event()
                event.record()
                launched.append(event)
                if len(launched) > LAYERS_AHEAD:
                    launched.pop(0).synchronize()
            if scheduler.interactive_waiting():
                scheduler.run_waiting_interactive()

        return between

    def _stop_if_abandoned(self) -> None:
        """Between the backbone and the head, and between padded chunks: the same check as between layers."""
        if self.scheduler.should_stop():
            raise BatchAbandoned

    def abandon(self, future: Future) -> None:
        """Its caller gives up on `future` (from `submit`): see Scheduler.abandon."""
        self.scheduler.abandon(future)

    @torch.inference_mode()
    def forward_padded(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The plain path: padded backbone batch, then the batched head."""
        self._stop_if_abandoned()
        hidden = backbone.run_padded(self.model, records, self.encoder.pad_token_id)
        batch_size, padded_length, width = hidden.shape
        lengths = [len(r) for r in records]
        offsets = [b * padded_length for b in range(batch_size)]
        return self.head_probabilities(hidden.reshape(-1, width), records, offsets, lengths)

    def head_one(self, normed: torch.Tensor, memory: torch.Tensor, record: EncodedRecord) -> list[list[float]]:
        """The head over one record's normed hidden states and memory: from a CUDA graph of its shape bucket where
        graphs are on, else eagerly."""
        self._stop_if_abandoned()
        if self.head_graphs is not None:
            probabilities = self.head_graphs.probabilities(normed, memory, record)
            if probabilities is not None:
                return probabilities
        batch = layout([record], [0], [len(record)]).to(self.device)
        logits = self.head.decide_from_memory(normed, memory, self.output_embeddings, batch)
        return self._split_probabilities(logits, batch, [record])[0]

    def head_probabilities(self, hidden_flat: torch.Tensor, records: list[EncodedRecord], offsets: list[int],
                           lengths: list[int]) -> list[list[list[float]]]:
        self._stop_if_abandoned()
        if len(records) == 1:
            normed, memory = self.head.token_memory(hidden_flat[offsets[0]: offsets[0] + lengths[0]].to(self.dtype))
            return [self.head_one(normed, memory, records[0])]
        batch = layout(records, offsets, lengths).to(self.device)
        logits = self.head(hidden_flat.to(self.dtype), self.output_embeddings, batch)
        return self._split_probabilities(logits, batch, records)

    @staticmethod
    def _split_probabilities(logits: torch.Tensor, batch, records: list[EncodedRecord]) -> list[list[list[float]]]:
        flat = option_probabilities(logits, batch).cpu().tolist()  # the one host sync of the batch
        out, cursor = [], 0
        for record in records:
            per_question = []
            for spans in record.option_spans:
                per_question.append(flat[cursor: cursor + len(spans)])
                cursor += len(spans)
            out.append(per_question)
        return out

    # ---- status -----------------------------------------------------------------------------------------------

    def _memory_stats(self) -> dict[str, int]:
        if not self.config.cuda:
            return {}
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved": torch.cuda.max_memory_reserved(self.device)}

    def memory(self) -> dict[str, int]:
        stats = self._memory_stats()
        if stats:
            stats["loaded"] = self.loaded_bytes
        return stats

    def info(self) -> dict:
        return {
            "model": self.model_id,
            "revision": self.release.revision,
            "path": str(self.release.path),
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.config.cuda else "CPU",
            "dtype": str(self.dtype).removeprefix("torch."),
            **self.precision_info(),
            "backbone_parameters": self.backbone_parameters,
            "head_parameters": self.head_parameters,
            "load_seconds": round(self.load_seconds, 2),
            "warm_up_seconds": round(self.warm_up_seconds, 2),
            "kernels": self.kernel_info(),
            "memory": self.memory(),
            "queue_depth": self.queue_depth(),
            "scheduler": vars(self.scheduler.stats).copy(),
            "demo": is_demo_release(self.release.path),
            "random_weights": self.release.random_weights or is_demo_release(self.release.path),
            "state_cache": self.state_cache.stats() if self.state_cache is not None else None,
            "state_prefills": self.state_prefills,
        }

    def precision_info(self) -> dict:
        """Which precision answers: "bf16", or "fp8" (W8A8 projections) with its measured distance from the float32
        answer (bench/lengths_and_precision.py's results, read once, or "not measured")."""
        if not self.config.fp8:
            return {"precision": "bf16"}
        if self._fp8_fidelity is None:
            self._fp8_fidelity = measured_fidelity()
        return {"precision": "fp8", "distance_from_float32": self._fp8_fidelity}

    def kernel_info(self) -> dict:
        """Which path and which kernels answer requests here."""
        info: dict[str, Any] = {"available": fast_kernels_available(), "path": self.forward_batch.__name__,
                                "head_attention": self.head_attention}
        if self.backbone is not None:
            info["packed"] = self.backbone.kernels.describe()
            info["slow_fallbacks"] = self.backbone.kernels.slow if self.config.cuda else []
            info["fused_projections"] = True
            info["prefill_chunk_tokens"] = self.config.prefill_chunk_tokens or None  # None: whole records
            info["media_records"] = "forward_padded (multimodal model, padded batch)"
            info["cuda_graphs"] = self.graphs.describe() if self.graphs is not None else None
            info["head_graphs"] = self.head_graphs.describe() if self.head_graphs is not None else None
        return info

    def use_kernels(self, chosen: kernels.Kernels) -> None:
        """Run the packed backbone on `chosen` from now on (benchmarks put a kernel back to its plain version to
        measure what it does). The prefill graphs replay the kernels they were captured with and the state cache holds
        states the old kernels computed, so both are emptied. Call it while no request runs."""
        self.backbone.kernels = chosen
        if self.state_cache is not None:
            self.state_cache.clear()
        if self.graphs is not None:
            self.graphs.forget()

    def warm_up(self) -> float:
        """Compile, autotune and capture while loading, not in a user's first request: a CUDA graph for every
        length bucket, cuDNN's attention plan for every padded length of a long record, then one record alone, a
        pack of records of uneven lengths, and a long state twice (stored, then continued from the cache; the entry
        is dropped afterwards; on CUDA as long as a bulk batch and longer than a prefill chunk). Returns the seconds
        it took."""
        started = time.perf_counter()
        if self.graphs is not None:
            self.graphs.capture_all()
        if self.backbone is not None and self.backbone.kernels.attention is attention.attention_varlen_cudnn_long:
            text = self.backbone.config
            # on the worker thread, which answers requests: torch keeps cuDNN's plans per thread
            # records longer than a chunk run cuDNN's causal attention on at most a chunk and a step of tokens
            chunk = self.config.prefill_chunk_tokens
            warm_tokens = chunk + attention.CUDNN_LENGTH_STEP if chunk else LONG_ATTENTION_WARM_TOKENS
            self.scheduler.call(lambda: attention.warm_long_attention(
                self.device, self.dtype, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
                warm_tokens))
        request = {"state": "warm-up", "questions": {"q": {"type": "noul", "instructions": "warm-up"}}}
        self.decide(request)
        self.decide_many([dict(request, state="warm-up " * n) for n in (1, 40, 333, 1001)])
        # a long state twice: stored, then continued from the cache. On CUDA it is as long as a bulk batch, so that
        # the caching allocator holds blocks for the largest working set before a user's first long record needs
        # them (growing it there cost ~190 ms once per larger size, bench/results/2026-12-01-h200-diagnose.json)
        cache = self.state_cache
        caching = cache is not None and cache.enabled
        if self.config.cuda or caching:  # on the CPU without a cache it would warm nothing
            least = self.config.min_prefix_tokens + 64
            if self.config.cuda:  # and past one chunk, so that the chunked path has run too
                least = max(least, self.config.bulk_batch_tokens - 256, self.config.prefill_chunk_tokens + 256)
            long_state = "warm " * least
            for questions in (request["questions"], {"other": {"type": "noul", "instructions": "?"}}):
                self.decide(dict(request, state=long_state, questions=questions), overflow="truncate_state",
                            max_length=max(DEFAULT_MAX_LENGTH, least + 1024))
        if caching:
            cache.clear(reset_stats=True)
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    def close(self, wait: bool = False) -> None:
        self.scheduler.close(wait)


def load(source: str | os.PathLike, *, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, revision: str | None = None, packed: bool | None = None,
         allow_slow_kernels: bool | None = None, state_cache_bytes: int | None = None, precision: str | None = None,
         config: EngineConfig | None = None) -> Engine:
    """Load a release (folder, repo id, or 'clef' / 'clef-flash') and keep it resident.

    Options not given come from the environment, then the defaults (see config.py and the README's Configuration
    table): `packed` (default on) answers text records through the packed fast path, which on CUDA needs
    flash-linear-attention unless `allow_slow_kernels`; `state_cache_bytes` bounds the device tier of the state
    cache (0 turns it off); `precision` "fp8" runs the backbone's projections in W8A8 FP8 (fast/fp8.py; CUDA with
    compute capability 8.9 or newer), "bf16" (the default) in the model's dtype. A full `config` replaces all of
    them."""
    started = time.perf_counter()
    config = config or EngineConfig.resolve(device=device, dtype=dtype, packed=packed,
                                            allow_slow_kernels=allow_slow_kernels,
                                            state_cache_bytes=state_cache_bytes, precision=precision)
    check_fast_kernels(config)  # before minutes of loading
    path = release.resolve(source, revision)
    checked = release.check(path, source=str(source), revision=revision)
    if config.cuda:
        torch.cuda.reset_peak_memory_stats(config.device)
    model = release.load_backbone(checked, config.device, config.dtype)
    try:
        head = load_head(checked.head_config, release.load_head_state(checked), config.device, config.dtype)
    except RuntimeError as error:  # strict load: names or shapes differ
        raise release.ReleaseError(f"{checked.path / release.HEAD_WEIGHTS} does not match the head: {error}") from error
    encoder = Encoder(release.load_processor(checked))
    engine = Engine(checked, model, head, encoder, config=config, load_seconds=time.perf_counter() - started)
    if config.warm_up:
        engine.warm_up()
    return engine


__all__ = ["Engine", "EngineConfig", "load", "RequestError", "TokenBudgetError"]
