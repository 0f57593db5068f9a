"""The resident engine, the request side: validate, encode, submit, respond.

`Engine.decide` / `decide_many` / `submit` encode in the caller's thread (so a bad request fails fast, off the
GPU), then hand records to the scheduler, the one place that groups records into GPU batches within a token budget.
The scheduler's worker thread runs each batch on the model runner (runner.py), chosen once at load from the
`EngineConfig`; the engine turns the probabilities it returns into System One responses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from .config import EngineConfig
from .errors import ClefError, RequestError, TokenBudgetError
from .explain import submit_explanation as explanation_future
from .fast import kernels
from .fast.packed import longest_chunk
from .model import media, release
from .model.encoding import DEFAULT_MAX_LENGTH, EncodedRecord, Encoder
from .model.head import JointSchemaHead, load_head
from .protocol import Question, Response, ValidRequest, format_answer, prepare
from .runner import PackedRunner, PlainRunner, StateVariants
from .scheduler import JobTiming, Scheduler, device_turn
from .tiny import is_demo_release

log = logging.getLogger(__name__)
DECIDE_MANY_GROUP = 16  # requests encoded and queued together by decide_many
ERROR_MODES = ("raise", "return")  # of submit / decide_many: a bad request raises, or its slot holds its error


def check_fast_kernels(config: EngineConfig) -> None:
    """On CUDA, refuse to run on the per-record torch fallbacks unless told to (they are many times slower)."""
    if config.cuda and config.packed and not kernels.fla_importable() and not config.allow_slow_kernels:
        raise release.ReleaseError(
            "flash-linear-attention (package `fla`) is not importable, so the Gated DeltaNet layers would run on "
            "slow per-record PyTorch fallbacks. Install flash-linear-attention (and fla-core), or allow the slow "
            "path with allow_slow_kernels=True / CLEF_ALLOW_SLOW_KERNELS=1.")


def device_key(device: torch.device) -> str:
    """One name per physical device ("cuda" and "cuda:0" are the same GPU): engines on it share one GPU queue."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


class Engine:
    def __init__(self, checked: release.Release, model: Any, head: JointSchemaHead, encoder: Encoder,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, *,
                 config: EngineConfig | None = None, load_seconds: float = 0.0, **options: Any) -> None:
        """`config` as resolved by `load`; without it, one is resolved from `device`, `dtype` and `options`
        (EngineConfig fields)."""
        config = config or EngineConfig.resolve(device=device, dtype=dtype, **options)
        config.apply_process_settings()
        check_fast_kernels(config)
        self.config = config
        self.release = checked
        self.encoder = encoder
        self.device = config.device
        self.load_seconds = load_seconds
        self.warm_up_seconds = 0.0
        self.warming = False  # see `state`
        self.model_id = checked.source
        self.token_budget = config.token_budget
        self.loaded_bytes = self._memory_stats().get("allocated", 0)
        # counted once: info() is polled by every open workbench page
        self.backbone_parameters = sum(p.numel() for p in model.parameters())
        self.head_parameters = sum(p.numel() for p in head.parameters())
        self.runner = (PackedRunner(model, head, config, encoder.pad_token_id, f"{self.model_id}@{checked.revision}")
                       if config.packed else PlainRunner(model, head, config, encoder.pad_token_id))
        self.scheduler = Scheduler(self.runner.forward, token_budget=config.token_budget,
                                   bulk_batch_tokens=config.bulk_batch_tokens,
                                   max_queued_records=config.max_queued_records,
                                   turn=device_turn(device_key(config.device)))

    # ---- requests ---------------------------------------------------------------------------------------------

    def validate(self, request: Any, *, max_length: int | None = None, overflow: str | None = None,
                 questions: tuple[Question, ...] | None = None) -> ValidRequest:
        """protocol.prepare: validated once (no tokenization, no media decode), as `submit` takes it."""
        return prepare(request, max_length=max_length, overflow=overflow, questions=questions)

    def encode(self, request: Any, *, max_length: int | None = None, overflow: str = "refuse") -> EncodedRecord:
        return self.encoder.encode(prepare(request, max_length=max_length, overflow=overflow))

    def count_tokens(self, request: Any, *, max_length: int | None = None) -> dict[str, int]:
        """Token count of each part and how many state tokens would be cut at `max_length` (for a budget bar)."""
        limit = DEFAULT_MAX_LENGTH if max_length is None else max_length
        counts = self.encoder.count_tokens(prepare(request))
        counts["max_length"] = limit
        fixed = counts["total"] - counts["state"]
        counts["state_tokens_over"] = max(0, min(counts["state"], counts["total"] - limit))
        counts["fixed_tokens_over"] = max(0, fixed - limit)
        return counts

    def submit(self, requests: Sequence[Any], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse", errors: str = "raise") -> Future:
        """Encode now (a plain dict validated here under `max_length` / `overflow`), run on the GPU worker later;
        the future resolves to one System One response per request. errors="raise": a bad request raises here, and
        a failure on the GPU fails the whole future. errors="return": each request's slot holds its response or its
        own error (from encoding, or what its batch raised with the record alone, see Scheduler), so one bad
        request costs the others nothing."""
        if errors not in ERROR_MODES:
            raise ValueError(f"errors must be one of {ERROR_MODES}, not {errors!r}")
        started = time.perf_counter()
        outcomes: list[Any] = [None] * len(requests)
        records: list[EncodedRecord] = []
        valids: list[ValidRequest] = []
        positions: list[int] = []
        for position, request in enumerate(requests):
            try:
                valid = prepare(request, max_length=max_length, overflow=overflow)
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

        return self.scheduler.submit(records, priority=priority, finalize=respond, per_record=errors == "return")

    def decide(self, request: Any, *, max_length: int | None = None, overflow: str = "refuse") -> Response:
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
        """Responses to requests over one state with different schemas (a schema sweep's variants) at the cost of
        one state: records sharing a state prefix have it prefilled once (or taken from the state cache) and every
        schema continued from it (`PackedRunner.forward_variants`), whatever the state's length (the cache's
        `min_prefix_tokens` weighs one reuse; here there are many). `x_state_cached`: true when a record continued
        from a state it did not compute itself. Records with media, or without the packed path, run as
        `decide_many` runs them. `probabilities`: unrounded probabilities (as `probabilities`) instead."""
        started = time.perf_counter()
        valids = [prepare(request, max_length=max_length, overflow=overflow) for request in requests]
        records = [self.encoder.encode(valid) for valid in valids]
        if isinstance(self.runner, PackedRunner) and not any(record.has_media for record in records):
            outcomes, computed = self.scheduler.submit([StateVariants(records)], priority=priority,
                                                       finalize=lambda results, _timing: results[0]).result()
        else:
            outcomes = self.scheduler.submit(records, priority=priority).result()
            computed = set(range(len(records)))
        if probabilities:
            return outcomes
        latency_ms = (time.perf_counter() - started) * 1000
        return [dict(self.response(valid, record, probs, latency_ms), x_state_cached=i not in computed)
                for i, (valid, record, probs) in enumerate(zip(valids, records, outcomes, strict=True))]

    def explain(self, request: Any, unit: str | None = None, *, max_length: int | None = None,
                overflow: str = "refuse") -> Response:
        """The response plus `x_explanations`: segments ranked by how much removing each moves the answer
        (explain.py)."""
        return self.submit_explanation(request, unit, max_length=max_length, overflow=overflow).result()[0]

    def submit_explanation(self, request: Any, unit: str | None = None, *, priority: str = "interactive",
                           max_length: int | None = None, overflow: str = "refuse",
                           max_tokens: int | None = None) -> Future:
        """`explain` as a future (what the HTTP server waits on within its deadline), within `max_tokens` in all."""
        return explanation_future(self, request, unit, priority=priority, max_length=max_length, overflow=overflow,
                                  max_tokens=max_tokens)

    def sample_video_frames(self, video: bytes) -> media.Video:
        """The frames of a video file the model reads (what the video processor samples), or MediaError."""
        return media.decode_video(media.video_bytes(video), self.encoder.video_sample_indices)

    def queue_position(self, future: Future) -> int | None:
        """Jobs ahead of `future` (from `submit`) in the GPU queue; None once it runs."""
        return self.scheduler.position(future)

    def response(self, request: ValidRequest, record: EncodedRecord, probabilities: list[list[float]],
                 latency_ms: float, *, compute_ms: float | None = None, queue_ms: float | None = None) -> Response:
        """One System One response: `x_latency_ms` from submission (queueing included), `x_compute_ms` the record's
        share of its batch (by tokens), `x_queue_ms` its job's wait before its first batch."""
        response: Response = {
            "model": request.model if isinstance(request.model, str) else self.model_id,
            "answers": {q.id: format_answer(q, probs) for q, probs in zip(record.questions, probabilities)},
            "usage": {"input_tokens": len(record), "output_tokens": 0},
            "x_latency_ms": round(latency_ms, 2),
        }
        if compute_ms is not None:
            response["x_compute_ms"] = round(compute_ms, 3)
        if queue_ms is not None:
            response["x_queue_ms"] = round(queue_ms, 2)
        response["x_token_counts"] = dict(record.token_counts)
        response["x_truncated_state_tokens"] = record.truncated_state_tokens
        return response

    def abandon(self, future: Future) -> None:
        """Its caller gives up on `future` (from `submit`): see Scheduler.abandon."""
        self.scheduler.abandon(future)

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def limit_queue(self, records: int) -> None:
        """Refuse (BusyError) a submission that would leave more than `records` records waiting; takes effect at
        once, since the scheduler reads the bound on every submit."""
        self.scheduler.max_queued_records = max(1, records)

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
            "dtype": str(self.config.dtype).removeprefix("torch."),
            "precision": "bf16",  # runs and sweeps record it; FP8 is a bench experiment (lengths_and_precision.py)
            "backbone_parameters": self.backbone_parameters,
            "head_parameters": self.head_parameters,
            "load_seconds": round(self.load_seconds, 2),
            "state": self.state,
            "warm_up_seconds": round(self.warm_up_seconds, 2),
            **self.runner.info(),  # "kernels", "state_cache" and "state_prefills"
            "memory": self.memory(),
            "queue_depth": self.queue_depth(),
            "scheduler": vars(self.scheduler.stats).copy(),
            "demo": is_demo_release(self.release.path),
            "random_weights": self.release.random_weights or is_demo_release(self.release.path),
        }

    @property
    def state(self) -> str:
        """"warming" while the background warm-up runs (requests are answered meanwhile, eagerly where a graph is
        not captured yet), then "ready"."""
        return "warming" if self.warming else "ready"

    def start_warm_up(self) -> None:
        """Warm up on a thread of its own (what `load` does): the engine answers meanwhile."""
        self.warming = True
        threading.Thread(target=self._warm_up_in_background, name=f"clef-warm-up-{self.model_id}",
                         daemon=True).start()

    def _warm_up_in_background(self) -> None:
        try:
            self.warm_up()
        except Exception:  # noqa: BLE001 — closed meanwhile, or a step failed: the engine answers all the same
            log.warning("warm-up of %s stopped", self.model_id, exc_info=True)

    def warm_up(self) -> float:
        """Compile the fast kernels and switch to them (until then requests run on the plain ones), then run
        `warm_up_steps` one after the other, requests answered between any two. Returns the seconds it took."""
        started = time.perf_counter()
        self.warming = True
        self.runner.capture_on_use(False)
        try:
            runner = self.runner
            if isinstance(runner, PackedRunner):  # compiled here, not on the worker: requests run meanwhile
                fast = runner.compile_fast_kernels()
                if fast is not None:
                    self.scheduler.call(partial(runner.use_kernels, fast), priority="bulk")
            for step in self.warm_up_steps():
                step()
        finally:
            self.runner.capture_on_use(True)
            self.warm_up_seconds = time.perf_counter() - started
            self.warming = False
        return self.warm_up_seconds

    def warm_up_steps(self) -> list[Callable[[], Any]]:
        """What the warm-up compiles, autotunes and captures, so that a user's first request of a length does not:
        one record alone, a pack of records of uneven lengths, the runner's own steps (`PackedRunner.warm_up_steps`:
        its CUDA graphs and cuDNN plans), and a long state twice (stored, then continued from the cache; on CUDA as
        long as a bulk batch and longer than a prefill chunk), the stored states emptied after it. Each step waits
        for its turn as bulk work (on the worker thread, or as requests), so the requests of users go first."""
        def on_worker(fn: Callable[[], Any]) -> Callable[[], Any]:
            return partial(self.scheduler.call, fn, priority="bulk")

        def answer(requests: list[dict[str, Any]], **options: Any) -> Callable[[], Any]:
            return partial(self.decide_many, requests, priority="bulk", **options)

        # first what every request runs (on a cold machine: the kernels' compiles), then the graphs
        request: dict[str, Any] = {"state": "warm-up", "questions": {"q": {"type": "noul", "instructions": "warm-up"}}}
        steps = [answer([request]), answer([dict(request, state="warm-up " * n) for n in (1, 40, 333, 1001)])]
        steps += [on_worker(step) for step in self.runner.warm_up_steps()]
        # a long state twice: stored, then continued from the cache. On CUDA it is as long as a bulk batch, so that
        # the caching allocator holds blocks for the largest working set before a user's first long record needs
        # them (growing it there cost ~190 ms once per larger size, bench/results/2026-12-01-h200-diagnose.json)
        caching = self.config.packed and self.config.state_cache_bytes > 0
        if self.config.cuda or caching:  # on the CPU without a cache it would warm nothing
            least = self.config.min_prefix_tokens + 64
            if self.config.cuda:  # and past the longest chunk, so that the chunked path has run too
                least = max(least, self.config.bulk_batch_tokens - 256,
                            longest_chunk(self.config.prefill_chunk_tokens) + 256)
            long_state = "warm " * least
            steps += [answer([dict(request, state=long_state, questions=questions)], overflow="truncate_state",
                             max_length=max(DEFAULT_MAX_LENGTH, least + 1024))
                      for questions in (request["questions"], {"other": {"type": "noul", "instructions": "?"}})]
        steps.append(on_worker(self.runner.clear_states))
        return steps

    def close(self, wait: bool = False) -> None:
        self.scheduler.close(wait)


def load(source: str | os.PathLike, *, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, revision: str | None = None, packed: bool | None = None,
         allow_slow_kernels: bool | None = None, state_cache_bytes: int | None = None,
         config: EngineConfig | None = None) -> Engine:
    """Load a release (folder, repo id, or 'clef' / 'clef-flash') and keep it resident.

    Options not given come from the environment, then the defaults (see config.py and the README's Configuration
    table): `packed` (default on) answers text records through the packed fast path, which on CUDA needs
    flash-linear-attention unless `allow_slow_kernels`; `state_cache_bytes` bounds the device tier of the state
    cache (0 turns it off). A full `config` replaces all of them."""
    started = time.perf_counter()
    config = config or EngineConfig.resolve(device=device, dtype=dtype, packed=packed,
                                            allow_slow_kernels=allow_slow_kernels,
                                            state_cache_bytes=state_cache_bytes)
    check_fast_kernels(config)  # before minutes of loading
    config.apply_process_settings()  # before the kernels' modules are imported: Triton reads its settings then
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
        engine.start_warm_up()
    return engine


__all__ = ["Engine", "EngineConfig", "load", "RequestError", "TokenBudgetError"]
