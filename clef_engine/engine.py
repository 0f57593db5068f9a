"""The resident engine: a loaded release, an encoder, and the GPU worker that runs batches.

`Engine.decide` / `decide_many` / `submit` encode in the caller's thread (so a bad request fails fast, off the
GPU), then hand records to the scheduler. The worker thread runs `forward_batch`: backbone, then the joint head
over the whole batch, one host sync per batch.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from .errors import RequestError, TokenBudgetError
from .fast import kernels
from .fast.cache import PrefixState, StateCache, prefix_key
from .fast.packed import FastBackbone, GraphedPrefill, pack_ids
from .model import backbone, release
from .model.encoding import DEFAULT_MAX_LENGTH, EncodedRecord, Encoder
from .model.head import JointSchemaHead, layout, load_head, option_probabilities
from .protocol import format_answer, parse_questions
from .serve.scheduler import Scheduler
from .tiny import is_demo_release

GiB = 2**30


def fast_kernels_available() -> dict[str, bool]:
    """Which optional fast kernels can be imported here (they are used only on CUDA)."""
    return {name: importlib.util.find_spec(module) is not None
            for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}


def slow_kernels_allowed(allow_slow_kernels: bool | None) -> bool:
    if allow_slow_kernels is not None:
        return allow_slow_kernels
    return os.environ.get("CLEF_ALLOW_SLOW_KERNELS", "").lower() in ("1", "true", "yes")


def check_fast_kernels(device: torch.device, allow_slow_kernels: bool | None) -> None:
    """On CUDA, refuse to run on the per-record torch fallbacks unless told to (they are many times slower)."""
    if device.type == "cuda" and not kernels.fla_importable() and not slow_kernels_allowed(allow_slow_kernels):
        raise release.ReleaseError(
            "flash-linear-attention (package `fla`) is not importable, so the Gated DeltaNet layers would run on "
            "slow per-record PyTorch fallbacks. Install flash-linear-attention (and fla-core), or allow the slow "
            "path with allow_slow_kernels=True / CLEF_ALLOW_SLOW_KERNELS=1.")


def memory_stats(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


def padded_chunks(records: list[EncodedRecord], indices, token_budget: int) -> list[list[int]]:
    """Indices grouped into padded batches: text apart from media, similar lengths together (sorted), each batch's
    padded size (count × longest) within the token budget; a record longer than the budget goes alone."""
    chunks: list[list[int]] = []
    for index in sorted(indices, key=lambda i: (records[i].has_media, len(records[i]))):
        chunk = chunks[-1] if chunks else None
        if (chunk and records[chunk[0]].has_media == records[index].has_media
                and (len(chunk) + 1) * len(records[index]) <= token_budget):
            chunk.append(index)
        else:
            chunks.append([index])
    return chunks


class Engine:
    def __init__(self, checked: release.Release, model, head: JointSchemaHead, encoder: Encoder,
                 device: torch.device, dtype: torch.dtype, *, load_seconds: float = 0.0,
                 token_budget: int | None = None, packed: bool = True, allow_slow_kernels: bool | None = None,
                 state_cache_bytes: int | None = None):
        self.release = checked
        self.model = model
        self.head = head
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self.load_seconds = load_seconds
        self.warm_up_seconds = 0.0
        self.model_id = checked.source
        self.output_embeddings = model.lm_head.weight  # the head reads it as a table (untied in Clef)
        self.loaded_bytes = memory_stats(device).get("allocated", 0)
        # counted once: info() is polled by every open workbench page
        self.backbone_parameters = sum(p.numel() for p in model.parameters())
        self.head_parameters = sum(p.numel() for p in head.parameters())
        if token_budget is None:
            token_budget = 65_536 if device.type == "cuda" else 16_384
        self.token_budget = token_budget
        self.forward_batch: Callable[[list[EncodedRecord]], list[list[list[float]]]] = self.forward_plain
        self.fast: FastBackbone | None = None
        self.graphs: GraphedPrefill | None = None
        self.state_cache: StateCache | None = None
        if packed:  # text records packed through our layer loop; media records stay on the padded path
            check_fast_kernels(device, allow_slow_kernels)
            self.fast = FastBackbone(model)
            self.forward_batch = self.forward_packed
            if device.type == "cuda" and os.environ.get("CLEF_CUDA_GRAPHS", "1") != "0":
                self.graphs = GraphedPrefill(self.fast)
            cache_bytes = state_cache_bytes if state_cache_bytes is not None else (
                8 * GiB if device.type == "cuda" else GiB // 4)
            self.state_cache = StateCache(device, device_bytes=cache_bytes,
                                          host_bytes=4 * cache_bytes if device.type == "cuda" else 0,
                                          enabled=cache_bytes > 0)
        self.scheduler = Scheduler(self._run_batch, token_budget=token_budget)

    # ---- requests ---------------------------------------------------------------------------------------------

    def validate(self, request: Any) -> None:
        """Raise RequestError if `request` breaks the System One contract (no tokenization, no media decode)."""
        parse_questions(request)

    def encode(self, request: Any, *, max_length: int | None = None, overflow: str = "refuse") -> EncodedRecord:
        return self.encoder.encode(request, max_length=max_length, overflow=overflow)

    def count_tokens(self, request: Any, *, max_length: int | None = None) -> dict[str, int]:
        """Token count of each part and how many state tokens would be cut at `max_length` (for a budget bar)."""
        limit = DEFAULT_MAX_LENGTH if max_length is None else max_length
        record = self.encoder.encode(request, max_length=2**31 - 1)
        counts = dict(record.token_counts)
        counts["max_length"] = limit
        fixed = counts["total"] - counts["state"]
        counts["state_tokens_over"] = max(0, min(counts["state"], counts["total"] - limit))
        counts["fixed_tokens_over"] = max(0, fixed - limit)
        return counts

    def submit(self, requests: list[dict], *, priority: str = "interactive", max_length: int | None = None,
               overflow: str = "refuse") -> Future:
        """Encode now (raising RequestError / TokenBudgetError for a bad request), run on the GPU worker later.
        The future resolves to one System One response per request."""
        started = time.perf_counter()
        records = [self.encode(r, max_length=max_length, overflow=overflow) for r in requests]

        def respond(probabilities: list) -> list[dict]:
            latency_ms = (time.perf_counter() - started) * 1000
            return [self.response(request, record, probs, latency_ms)
                    for request, record, probs in zip(requests, records, probabilities)]

        return self.scheduler.submit(records, priority=priority, finalize=respond)

    def decide(self, request: dict, *, max_length: int | None = None, overflow: str = "refuse") -> dict:
        return self.submit([request], priority="interactive", max_length=max_length, overflow=overflow).result()[0]

    def decide_many(self, requests: list[dict], *, max_length: int | None = None, overflow: str = "refuse",
                    priority: str = "bulk") -> list[dict]:
        if not requests:
            return []
        return self.submit(requests, priority=priority, max_length=max_length, overflow=overflow).result()

    def response(self, request: dict, record: EncodedRecord, probabilities: list[list[float]],
                 latency_ms: float) -> dict:
        answers = {q.id: format_answer(q, probs) for q, probs in zip(record.questions, probabilities)}
        return {
            "model": request.get("model") if isinstance(request.get("model"), str) else self.model_id,
            "answers": answers,
            "usage": {"input_tokens": len(record), "output_tokens": 0},
            "x_latency_ms": round(latency_ms, 2),
            "x_token_counts": dict(record.token_counts),
            "x_truncated_state_tokens": record.truncated_state_tokens,
        }

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    # ---- the GPU worker ---------------------------------------------------------------------------------------

    def _run_batch(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        return self.forward_batch(records)

    def forward_plain(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The plain path for a whole scheduler batch: padded backbone batches of similar length."""
        results: dict[int, list[list[float]]] = {}
        for chunk in padded_chunks(records, range(len(records)), self.token_budget):
            for i, probs in zip(chunk, self.forward_padded([records[i] for i in chunk])):
                results[i] = probs
        return [results[i] for i in range(len(records))]

    @torch.inference_mode()
    def forward_packed(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The fast path: text records packed (no padding) up to the token budget; a record whose long state
        prefix is cached (or, alone in its batch, worth caching) continues from the cache; media records go to
        the padded path."""
        results: dict[int, list[list[float]]] = {}
        media = [i for i, r in enumerate(records) if r.has_media]
        text = [i for i, r in enumerate(records) if not r.has_media]
        cache = self.state_cache
        packable = []
        for i in text:
            record = records[i]
            if cache is not None and cache.eligible(record.state_end) and record.state_end < len(record):
                cached = self._cached_prefix(record, store=len(records) == 1)
                if cached is not None:
                    results[i] = self.forward_after_prefix(record, cached)
                    continue
            packable.append(i)
        pack: list[int] = []
        tokens = 0
        for i in packable + [None]:
            if i is not None and (not pack or tokens + len(records[i]) <= self.token_budget):
                pack.append(i)
                tokens += len(records[i])
                continue
            if pack:
                chosen = [records[j] for j in pack]
                lengths = [len(r) for r in chosen]
                segments = kernels.make_segments(lengths, self.device)
                ids = pack_ids(chosen, self.device)
                hidden = None
                if len(chosen) == 1 and self.graphs is not None and self.graphs.usable(lengths[0]):
                    hidden = self.graphs.run(ids)
                if hidden is None:
                    hidden, _ = self.fast.forward(ids, segments)
                for j, probs in zip(pack, self.head_probabilities(hidden, chosen, segments.starts, lengths)):
                    results[j] = probs
            pack, tokens = ([i], len(records[i])) if i is not None else ([], 0)
        for chunk in padded_chunks(records, media, self.token_budget):  # as the plain path does
            for j, probs in zip(chunk, self.forward_padded([records[j] for j in chunk])):
                results[j] = probs
        return [results[i] for i in range(len(records))]

    def _cached_prefix(self, record: EncodedRecord, *, store: bool) -> PrefixState | None:
        """The cached state of the record's prefix; on a miss, compute and store it if `store`."""
        key = prefix_key(f"{self.model_id}@{self.release.revision}", record.input_ids[: record.state_end],
                         record.media_digest)
        state = self.state_cache.get(key)
        if state is not None or not store:
            return state
        length = record.state_end
        segments = kernels.make_segments([length], self.device)
        ids = torch.tensor(record.input_ids[:length], dtype=torch.long).to(self.device, non_blocking=True)
        hidden, layers = self.fast.forward(ids, segments, collect=True)
        _, memory = self.head.token_memory(hidden.to(self.dtype))
        state = PrefixState(length, layers, memory)
        self.state_cache.put(key, state)
        return state

    def forward_after_prefix(self, record: EncodedRecord, state: PrefixState) -> list[list[float]]:
        """Backbone over the schema + suffix tokens only, continuing from the cached prefix; then the head over the
        cached + new memory."""
        start, new = state.length, len(record) - state.length
        # right-padded to a bucket length: GEMMs of odd row counts measured ~2x slower per token on the H200, and
        # padding after the last real token changes nothing before it (the backbone is causal)
        padded = GraphedPrefill.bucket(new)
        ids = record.input_ids[start:] + [self.encoder.pad_token_id] * (padded - new)
        ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = None
        if self.graphs is not None and state.device.type == "cuda":
            hidden = self.graphs.run_after_prefix(ids, state)
        if hidden is None:
            segments = kernels.make_segments([padded], self.device, first_position=start)
            hidden, _ = self.fast.forward(ids, segments, prefix=state.layers, prefix_length=start)
        hidden = hidden[:new]
        normed_new, memory_new = self.head.token_memory(hidden.to(self.dtype))
        normed = normed_new.new_zeros(len(record), normed_new.shape[-1])  # prefix rows: never read by the head
        normed[start:] = normed_new
        memory = torch.cat([state.memory.to(memory_new.dtype), memory_new])
        batch = layout([record], [0], [len(record)]).to(self.device)
        logits = self.head.decide_from_memory(normed, memory, self.output_embeddings, batch)
        return self._split_probabilities(logits, batch, [record])[0]

    @torch.inference_mode()
    def forward_padded(self, records: list[EncodedRecord]) -> list[list[list[float]]]:
        """The plain path: padded backbone batch, then the batched head."""
        hidden = backbone.run_padded(self.model, records, self.encoder.pad_token_id)
        batch_size, padded_length, width = hidden.shape
        lengths = [len(r) for r in records]
        offsets = [b * padded_length for b in range(batch_size)]
        return self.head_probabilities(hidden.reshape(-1, width), records, offsets, lengths)

    def head_probabilities(self, hidden_flat: torch.Tensor, records: list[EncodedRecord], offsets: list[int],
                           lengths: list[int]) -> list[list[list[float]]]:
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

    def memory(self) -> dict[str, int]:
        stats = memory_stats(self.device)
        if stats:
            stats["loaded"] = self.loaded_bytes
        return stats

    def info(self) -> dict:
        return {
            "model": self.model_id,
            "revision": self.release.revision,
            "path": str(self.release.path),
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU",
            "dtype": str(self.dtype).removeprefix("torch."),
            "backbone_parameters": self.backbone_parameters,
            "head_parameters": self.head_parameters,
            "load_seconds": round(self.load_seconds, 2),
            "warm_up_seconds": round(self.warm_up_seconds, 2),
            "kernels": self.kernel_info(),
            "memory": self.memory(),
            "queue_depth": self.queue_depth(),
            "scheduler": vars(self.scheduler.stats).copy(),
            "demo": is_demo_release(self.release.path),
            "state_cache": self.state_cache.stats() if self.state_cache is not None else None,
        }

    def kernel_info(self) -> dict:
        """Which path and which kernels answer requests here."""
        info: dict[str, Any] = {"available": fast_kernels_available(), "path": self.forward_batch.__name__}
        if self.fast is not None:
            info["packed"] = self.fast.kernels.describe()
            info["slow_fallbacks"] = self.fast.kernels.slow if self.device.type == "cuda" else []
            info["fused_projections"] = True
            info["media_records"] = "forward_padded (multimodal model, padded batch)"
            info["cuda_graphs"] = self.graphs.describe() if self.graphs is not None else None
        return info

    def warm_up(self) -> float:
        """Run each path once so Triton's compile and autotune (minutes on a fresh H200 process, seen in the
        benchmark) happen while loading, not in a user's first request: one record alone (a CUDA graph), a pack of
        records of uneven lengths, and a long state twice (stored in the state cache, then continued from it; the
        entry is dropped afterwards). Returns the seconds it took."""
        started = time.perf_counter()
        request = {"state": "warm-up", "questions": {"q": {"type": "noul", "instructions": "warm-up"}}}
        self.decide(request)
        self.decide_many([dict(request, state="warm-up " * n) for n in (1, 40, 333, 1001)])
        cache = self.state_cache
        if cache is not None and cache.enabled:
            long_state = "warm " * (cache.min_prefix_tokens + 64)
            self.decide(dict(request, state=long_state))
            self.decide(dict(request, state=long_state, questions={"other": {"type": "noul", "instructions": "?"}}))
            cache.clear(reset_stats=True)
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    def close(self) -> None:
        self.scheduler.close()


def load(source: str | os.PathLike, *, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, revision: str | None = None, packed: bool = True,
         allow_slow_kernels: bool | None = None, state_cache_bytes: int | None = None) -> Engine:
    """Load a release (folder, repo id, or 'clef' / 'clef-flash') and keep it resident on `device`.

    `packed` (default) answers text records through the packed fast path (fast/packed.py); on CUDA that needs
    flash-linear-attention unless `allow_slow_kernels` (or CLEF_ALLOW_SLOW_KERNELS=1). `state_cache_bytes` bounds
    the device tier of the state cache (0 turns it off)."""
    started = time.perf_counter()
    path = release.resolve(source, revision)
    checked = release.check(path, source=str(source), revision=revision)
    device = torch.device(device) if device is not None else release.default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise release.ReleaseError("device cuda was asked for but no CUDA GPU is visible")
    dtype = release.parse_dtype(dtype, device)
    if packed:
        check_fast_kernels(device, allow_slow_kernels)  # before minutes of loading
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = release.load_backbone(checked, device, dtype)
    try:
        head = load_head(checked.head_config, release.load_head_state(checked), device, dtype)
    except RuntimeError as error:  # strict load: names or shapes differ
        raise release.ReleaseError(f"{checked.path / release.HEAD_WEIGHTS} does not match the head: {error}") from error
    encoder = Encoder(release.load_processor(checked))
    engine = Engine(checked, model, head, encoder, device, dtype, load_seconds=time.perf_counter() - started,
                    packed=packed, allow_slow_kernels=allow_slow_kernels, state_cache_bytes=state_cache_bytes)
    if device.type == "cuda":
        engine.warm_up()
    return engine


__all__ = ["Engine", "load", "RequestError", "TokenBudgetError"]
