"""CUDA graphs of the packed backbone, for one record at a time.

A short record is bound by the host launching the forward's kernels one by one; a graph replays the whole forward
with one launch. Two kinds, one owner:

- prefill graphs: one record of up to `max_tokens` tokens, right-padded to a bucket length (multiples of 32 up to
  1,024 tokens, of 128 up to 2,048, of 256 beyond). Padding after the last real token changes nothing before it
  (the backbone is causal). The engine's background warm-up captures every bucket, one `capture_bucket` at a time
  between requests, so that afterwards any record of any length replays a graph; the memory that costs is
  measured there and bounded by `memory_limit`. Until it is done (`capture_on_use` off) a record whose bucket is
  not captured yet runs eagerly instead of capturing it in the request's time; afterwards a bucket left out (the
  memory bound) is captured on first use.
- continuation graphs: one record continuing after a cached state prefix (fast/cache.py). A graph reads the
  entry's tensors by address, so its graphs live exactly as long as the entry object: they are kept in a
  WeakKeyDictionary keyed by it (an entry evicted, or moved to host memory and back as a new object, takes its
  graphs with it). They are captured when a prefix is reused, not when it is stored.

All graphs share one memory pool (one GPU worker thread: they never run at the same time), so the output of a
replay is valid until the next replay. If a capture fails, that kind of graph is switched off with the reason kept
and the eager path answers instead.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from itertools import chain, islice

import numpy as np
import torch

from .segments import Segments, make_segments


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture (and the eager run before it) uses on `device`. One, not one per capture: the
    caching allocator reuses a freed block only on the stream it was allocated on, so a new stream per capture
    would give every graph its own scratch memory."""
    return torch.cuda.Stream(device)


def capture(body, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A graph of `body()` (returning a tensor) captured on the side stream after one eager run of it there: that
    run compiles and autotunes every kernel for these shapes, and its output is a real answer. Returns (the graph, a
    copy of the eager output, the graph's output). As torch.cuda.graph does, minus its gc.collect() and
    empty_cache() before every capture: in a process holding a whole model they are slow, and the request that
    first meets a new shape would pay for them."""
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        eager = body().clone()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = body()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, eager, out


def bucket(n: int) -> int:
    """The padded length a record of `n` tokens runs at."""
    step = 32 if n <= 1024 else 128 if n <= 2048 else 256
    return -(-n // step) * step


def buckets(max_tokens: int) -> list[int]:
    """Every bucket length up to `max_tokens`."""
    return sorted({bucket(n) for n in range(1, max_tokens + 1)})


class Graph:
    """One captured forward: its static input ids and its output view."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ids: torch.Tensor, hidden: torch.Tensor, segments: Segments):
        self.graph, self.ids, self.hidden, self.segments = graph, ids, hidden, segments

    def replay(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)  # the slots after n keep older ids: padding, which no real token reads
        self.graph.replay()
        return self.hidden[:n]


class PrefillGraphs:
    def __init__(self, backbone, max_tokens: int = 4096, memory_limit: int = 8 * 2**30):
        self.backbone = backbone
        self.max_tokens = max_tokens
        self.memory_limit = memory_limit
        self.prefill: dict[int, Graph] = {}
        self.continuations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # entry -> {bucket: Graph}
        self.pool = None
        self.disabled: str | None = None
        self.continuation_disabled: str | None = None
        self.captures = 0
        self.replays = 0
        self.continuation_replays = 0
        self.memory_bytes = 0  # device memory the captured prefill graphs hold (measured by capture_bucket)
        self.capture_on_use = True  # off while the warm-up captures: a missing bucket runs eagerly meanwhile

    def _capture(self, length: int) -> Graph:
        return self._capture_with(torch.zeros(length, dtype=torch.long, device=self.backbone.device))[0]

    def _capture_with(self, ids: torch.Tensor, prefix=None) -> tuple[Graph, torch.Tensor]:
        """Capture the forward of `ids` (after `prefix`, a cached PrefixState, if given). Returns the graph and the
        output of the eager run made just before capturing (on real ids a real answer)."""
        device = self.backbone.device
        first = prefix.length if prefix is not None else 0
        segments = make_segments([ids.shape[0]], device, first_position=first)
        arguments = {"prefixes": [prefix.layers]} if prefix is not None else {}
        static_ids = ids.clone()
        graph, eager, hidden = capture(lambda: self.backbone.forward(static_ids, segments, **arguments)[0], device,
                                       self.pool)
        self.pool = graph.pool()
        self.captures += 1
        return Graph(graph, static_ids, hidden, segments), eager

    def forget(self) -> None:
        """Drop every graph and their memory pool: a graph replays the kernels it was captured with, so after the
        backbone's kernels change (a benchmark swapping one for its plain version) they are captured again on use."""
        self.prefill.clear()
        self.continuations.clear()
        self.pool = None

    def lengths_to_capture(self) -> list[int]:
        """Every bucket up to max_tokens, longest first (so that the pool is sized once, by the largest)."""
        return sorted(buckets(self.max_tokens), reverse=True)

    def capture_bucket(self, length: int) -> None:
        """Capture one bucket (a warm-up step, on the worker thread), measuring the memory it adds; nothing once
        graphs are off, the bucket is there, or the graphs hold `memory_limit` (the buckets left are captured on
        first use, within the same pool)."""
        if self.disabled is not None or length in self.prefill or self.memory_bytes > self.memory_limit:
            return
        device = self.backbone.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # count what the graph holds, not freed scratch
        before = torch.cuda.memory_reserved(device)
        try:
            self.prefill[length] = self._capture(length)
        except Exception as error:  # noqa: BLE001 — fall back to eager, and say why
            self.disabled = f"{type(error).__name__}: {error}"[:500]
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.memory_bytes += torch.cuda.memory_reserved(device) - before

    def run(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [n, hidden] of one record from its bucket's graph (captured now if warm-up did not, once
        it is done), or None if graphs are off for it or its bucket waits for the warm-up. The result is a view into
        the graph's output: read it before the next call."""
        n = input_ids.shape[0]
        if self.disabled is not None or n > self.max_tokens:
            return None
        length = bucket(n)
        graph = self.prefill.get(length)
        if graph is None and not self.capture_on_use:
            return None
        if graph is None:
            try:
                graph = self._capture(length)
            except Exception as error:  # noqa: BLE001
                self.disabled = f"{type(error).__name__}: {error}"[:500]
                torch.cuda.synchronize()
                return None
            self.prefill[length] = graph
        self.replays += 1
        return graph.replay(input_ids)

    def run_after_prefix(self, input_ids: torch.Tensor, prefix) -> torch.Tensor | None:
        """The continuation of one record after the cached `prefix` (`input_ids` already padded to a bucket), from
        the entry's graph of that bucket; on the entry's first reuse at this bucket the graph is captured and the
        eager run made before the capture gives the answer. None if continuation graphs are off."""
        length = input_ids.shape[0]
        if self.continuation_disabled is not None or length > self.max_tokens:
            return None
        graphs = self.continuations.setdefault(prefix, {})
        graph = graphs.get(length)
        if graph is not None:
            self.continuation_replays += 1
            return graph.replay(input_ids)
        try:
            graphs[length], eager = self._capture_with(input_ids, prefix)
        except Exception as error:  # noqa: BLE001
            self.continuation_disabled = f"{type(error).__name__}: {error}"[:500]
            torch.cuda.synchronize()
            return None
        return eager

    def describe(self) -> dict:
        return {"max_tokens": self.max_tokens, "buckets": len(self.prefill), "captures": self.captures,
                "replays": self.replays, "memory_bytes": self.memory_bytes, "disabled": self.disabled,
                "continuation_entries": len(self.continuations), "continuation_replays": self.continuation_replays,
                "continuation_disabled": self.continuation_disabled}


# ---- the joint head ------------------------------------------------------------------------------------------------

# The arrays of a head graph's static index buffer (`head_shapes`) that are masks: kept as int64 in the buffer,
# turned to bool inside the graph.
HEAD_MASKS = frozenset({"memory_padding", "field_padding", "question_option_padding"})


def _size(n: int, least: int = 1) -> int:
    """`n` rounded up to a power of two up to 16, then to a multiple of an eighth of its power of two (at most
    12.5% over): few shapes, little padding."""
    n = max(n, least)
    if n <= 16:
        return 1 << max(0, n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _spans(record) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The record's question spans [Q, 2], option spans [O, 2] and options per question [Q], as int64 arrays."""
    from ..model.head import _pairs

    questions = record.question_spans
    per_question = np.fromiter((len(spans) for spans in record.option_spans), dtype=np.int64, count=len(questions))
    return _pairs(questions), _pairs(chain.from_iterable(record.option_spans)), per_question


def _slab(rows: int) -> int:
    """Rows of a pooling slab: powers of two from 64 up to 512 (coarse on purpose: schemas of one size share a graph
    rather than each capturing its own), then `_size` (at most 12.5% over: fewer padding rows to copy)."""
    return max(64, 1 << max(0, rows - 1).bit_length()) if rows <= 512 else _size(rows)


def _pool_groups(counts: np.ndarray) -> tuple[int, int]:
    """(groups, slab) for pooling spans of `counts` rows: the spans in `groups` equal runs, each run's rows in a slab
    of `slab` rows, so that pooling is a batch of small GEMMs ([groups, spans / groups, slab]) rather than one
    [spans, rows] GEMM as many times larger. The most groups (up to 16) whose slabs hold at most twice the rows (or
    256)."""
    total = int(counts.sum())
    for groups in (16, 8, 4, 2):
        per_group = -(-len(counts) // groups)
        padded = np.zeros(groups * per_group, dtype=np.int64)
        padded[: len(counts)] = counts
        slab = _slab(int(padded.reshape(groups, per_group).sum(1).max()))
        if groups * slab <= max(2 * total, 256):
            return groups, slab
    return 1, _slab(total)


def _pool_layout(first: np.ndarray, counts: np.ndarray, groups: int, slab: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each span's rows go in the [groups * slab] pooling layout of `_pool_groups`: (source row of each slot,
    0 where empty; span of each slot, counted within its group, -1 where empty)."""
    spans = len(counts)
    per_group = -(-spans // groups)
    group = np.arange(spans, dtype=np.int64) // per_group
    group_rows = np.bincount(group, weights=counts, minlength=groups).astype(np.int64)
    offset = np.cumsum(counts) - counts - (np.cumsum(group_rows) - group_rows)[group]  # first row within the group
    span_of_row = np.repeat(np.arange(spans, dtype=np.int64), counts)
    within = np.arange(len(span_of_row), dtype=np.int64) - (np.cumsum(counts) - counts)[span_of_row]
    slot = group[span_of_row] * slab + offset[span_of_row] + within
    rows, local = np.zeros(groups * slab, dtype=np.int64), np.full(groups * slab, -1, dtype=np.int64)
    rows[slot] = first[span_of_row] + within
    local[slot] = span_of_row - group[span_of_row] * per_group
    return rows, local


def head_shape(spans: tuple[np.ndarray, np.ndarray, np.ndarray], tokens: int) -> tuple[int, ...]:
    """The bucket of one record's head call: (memory tokens, questions, options per question, options, then the
    (groups, slab) of `_pool_groups` for the question and option spans and for the option tokens' lexical mean).
    Counts are rounded up by `_size`. One spare question and one spare option always: the padding options belong
    to the spare question, so that no padding slot joins a real question's softmax. `spans`: `_spans(record)`."""
    question_spans, option_spans, per_question = spans
    q_b, o_b = _size(len(question_spans) + 1), _size(len(option_spans) + 1)
    question_counts = question_spans[:, 1] - question_spans[:, 0]
    option_counts = np.zeros(o_b, dtype=np.int64)
    option_counts[: len(option_spans)] = option_spans[:, 1] - option_spans[:, 0]
    span_counts = np.concatenate([question_counts, np.zeros(q_b - len(question_spans), dtype=np.int64), option_counts])
    return (_size(tokens, 1024), q_b, _size(int(per_question.max(initial=1))), o_b,
            *_pool_groups(span_counts), *_pool_groups(option_counts))


def head_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The shape of every array of a head graph's static index buffer, in buffer order (`pooled_rows` first)."""
    t_b, q_b, k_b, o_b, groups, slab, lexical_groups, lexical_slab = shape
    return {"pooled_rows": (groups * slab + 1,), "segment": (groups, slab), "pool_count": (q_b + o_b,),
            "lexical_ids": (lexical_groups * lexical_slab,), "lexical_segment": (lexical_groups, lexical_slab),
            "question_type": (q_b,), "option_question": (o_b,), "option_question_slot": (o_b,),
            "question_options": (q_b, k_b), "memory_padding": (1, t_b), "field_padding": (1, q_b),
            "question_option_padding": (q_b, k_b)}


def head_arrays(record, spans: tuple[np.ndarray, np.ndarray, np.ndarray], tokens: int,
                shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """One record's index arrays padded to `shape`, built with numpy from its spans (no Python work per token or
    option). The graph pools spans from a compact copy of the normed rows it reads (`pooled_rows`: every
    question-span and option-span row in the layout of `_pool_layout`, then the last token); `segment` says which
    span each compact row adds to within its group (question slots 0..q_b-1, then option slots), `lexical_ids` and
    `lexical_segment` the same for the option tokens' ids. Padding changes no real answer: padding memory rows and
    fields are masked out of every attention; padding spans pool nothing (count 1, so nothing divides by zero);
    padding options belong to the spare question Q, which keeps one unmasked option so its softmax stays finite."""
    from ..model.head import QUESTION_TYPE_INDEX, _first_index

    t_b, q_b, k_b, o_b, groups, slab, lexical_groups, lexical_slab = shape
    question_spans, option_spans, per_question = spans
    questions, options = len(question_spans), len(option_spans)
    first = np.zeros(q_b + o_b, dtype=np.int64)
    counts = np.zeros(q_b + o_b, dtype=np.int64)
    first[:questions], first[q_b: q_b + options] = question_spans[:, 0], option_spans[:, 0]
    counts[:questions] = question_spans[:, 1] - question_spans[:, 0]
    counts[q_b: q_b + options] = option_spans[:, 1] - option_spans[:, 0]

    out = {name: np.zeros(size, dtype=np.int64) for name, size in head_shapes(shape).items()}
    rows, local = _pool_layout(first, counts, groups, slab)
    out["pooled_rows"][:-1], out["pooled_rows"][-1] = rows, tokens - 1
    out["segment"].reshape(-1)[:] = local
    out["pool_count"][:] = np.maximum(counts, 1)
    token_rows, token_local = _pool_layout(first[q_b:], counts[q_b:], lexical_groups, lexical_slab)
    if options:  # the ids of the schema's part of the record only, not of the whole state
        start, end = int(option_spans[:, 0].min()), int(option_spans[:, 1].max())
        ids = np.fromiter(record.input_ids[start:end], dtype=np.int64, count=end - start)
        out["lexical_ids"][:] = np.where(token_local >= 0, ids[np.maximum(token_rows - start, 0)], 0)
    out["lexical_segment"].reshape(-1)[:] = token_local
    out["question_type"][:questions] = [QUESTION_TYPE_INDEX[t] for t in record.question_types[:questions]]
    option_question = np.repeat(np.arange(questions, dtype=np.int64), per_question)
    option_first = _first_index(per_question)
    out["option_question"][:] = questions
    out["option_question"][:options] = option_question
    out["option_question_slot"][:options] = np.arange(options, dtype=np.int64) - option_first[option_question]
    slot = np.arange(k_b, dtype=np.int64)
    keep = slot[None, :] < per_question[:, None]
    out["question_options"][:] = options
    out["question_options"][:questions] = np.where(keep, option_first[:, None] + slot, options)
    out["memory_padding"][0] = np.arange(t_b) >= tokens
    out["field_padding"][0] = np.arange(q_b) >= questions
    out["question_option_padding"][:] = 1
    out["question_option_padding"][:questions] = ~keep
    out["question_option_padding"][questions:, 0] = 0
    return out


class HeadGraph:
    """The head for one shape bucket: its static index buffer (host copy pinned), its graph and its output."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        self.shape = shape
        self.layout = list(head_shapes(shape).items())
        size = sum(int(np.prod(s)) for _, s in self.layout)
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.probabilities: torch.Tensor | None = None

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Write the arrays into the static device buffer (one host-to-device copy)."""
        np.concatenate([arrays[name].reshape(-1) for name, _ in self.layout], out=self.host.numpy())
        self.device_buffer.copy_(self.host, non_blocking=True)

    def views(self) -> dict[str, torch.Tensor]:
        """The arrays as views of the device buffer (masks converted to bool: inside a graph body, on every replay)."""
        views, start = {}, 0
        for name, shape in self.layout:
            count = int(np.prod(shape))
            view = self.device_buffer[start: start + count].view(shape)
            views[name] = view.bool() if name in HEAD_MASKS else view
            start += count
        return views


class HeadGraphs:
    """The joint head of one record from a CUDA graph per shape bucket (`head_shape`): with no backbone running to
    hide them, the head's few hundred small kernels are bound by the host launching them. Outside the graph, each
    call copies into static buffers only what the head reads: the record's memory and the normed rows of its spans
    and last token (the head attends over the whole memory, but reads normed states only there). A new bucket is
    captured on first use (the eager run before the capture answers that call); at most `max_graphs` are kept,
    least recently used out. Records longer than `max_tokens` run the head eagerly. On the CPU, `capture=False` runs
    the same padded call eagerly, which is how tests check that the padding changes no answer."""

    def __init__(self, head, output_embeddings: torch.Tensor, *, max_tokens: int = 32_768, max_graphs: int = 64,
                 capture: bool = True):
        self.head = head
        self.output_embeddings = output_embeddings
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self.device = output_embeddings.device
        self.graphs: OrderedDict[tuple, HeadGraph] = OrderedDict()
        self.rows: torch.Tensor | None = None  # [rows, hidden]: the normed rows a call pools, shared by every graph
        self.memory: torch.Tensor | None = None  # [memory tokens, width]
        self.pool = None
        self.disabled: str | None = None
        self.captures = 0
        self.replays = 0

    def _body(self, entry: HeadGraph) -> torch.Tensor:
        from ..model.head import HeadBatch, key_counts, option_probabilities, pooled_sums, pooling_matrix

        t_b, q_b, k_b, o_b, groups, slab, lexical_groups, lexical_slab = entry.shape
        a = entry.views()
        rows = self.rows[: groups * slab].view(groups, slab, -1)
        spans = -(-(q_b + o_b) // groups)
        sums = pooled_sums(pooling_matrix(a["segment"], spans, rows.dtype), rows).view(groups * spans, -1)
        means = sums[: q_b + o_b] / a["pool_count"][:, None]
        table = self.output_embeddings
        tokens = table[a["lexical_ids"]].view(lexical_groups, lexical_slab, -1)
        spans = -(-o_b // lexical_groups)
        sums = pooled_sums(pooling_matrix(a["lexical_segment"], spans, table.dtype), tokens)
        lexical = sums.view(lexical_groups * spans, -1)[:o_b] / a["pool_count"][q_b:, None]
        last = self.rows[groups * slab: groups * slab + 1]
        memory = self.memory[:t_b][None]
        batch = HeadBatch(buffer=entry.device_buffer, memory_start=0, memory_length=t_b, record_rows=None,
                          memory_padding=a["memory_padding"], last_rows=a["pooled_rows"][-1:], question_rows=None,
                          question_keep=None, question_chunk=None, question_count=a["pool_count"][:q_b],
                          question_record=None, question_slot=None, question_type=a["question_type"],
                          record_questions=None, field_padding=a["field_padding"], option_rows=None,
                          option_token_ids=None, option_keep=None, option_chunk=None,
                          option_count=a["pool_count"][q_b:], option_question=a["option_question"],
                          option_record=None, option_record_slot=None, option_question_slot=a["option_question_slot"],
                          record_options=None, question_options=a["question_options"],
                          question_option_padding=a["question_option_padding"])
        logits = self.head.decide_from_means(means[:q_b], means[q_b:], lexical, last, memory,
                                             key_counts(a["memory_padding"]), batch)
        return option_probabilities(logits, batch)

    def probabilities(self, normed: torch.Tensor, memory: torch.Tensor, record) -> list[list[float]] | None:
        """Per question, the option probabilities of `record` from its normed states and memory, or None if the
        head graphs are off."""
        tokens = normed.shape[0]
        if self.disabled is not None or tokens > self.max_tokens:
            return None
        spans = _spans(record)
        shape = head_shape(spans, tokens)
        pooled = shape[4] * shape[5] + 1  # pooled_rows, the first array of the buffer
        if self.memory is None:
            self.memory = memory.new_zeros(_size(self.max_tokens, 1024), memory.shape[1])
        if self.rows is None or self.rows.shape[0] < pooled:
            self._grow_rows(normed, pooled)
        entry = self.graphs.get(shape)
        fresh = entry is None
        if fresh:
            entry = HeadGraph(shape, self.device)
        entry.load(head_arrays(record, spans, tokens, shape))
        torch.index_select(normed, 0, entry.device_buffer[:pooled], out=self.rows[:pooled])
        self.memory[:tokens].copy_(memory)
        if not self.capture:
            flat = self._body(entry)
        elif not fresh:
            self.graphs.move_to_end(shape)
            entry.graph.replay()
            self.replays += 1
            flat = entry.probabilities
        else:
            try:
                flat = self._capture(entry)
            except Exception as error:  # noqa: BLE001 — fall back to eager, and say why
                self.disabled = f"{type(error).__name__}: {error}"[:500]
                torch.cuda.synchronize(self.device)
                return None
            self.graphs[shape] = entry
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        per_question = [len(spans) for spans in record.option_spans]
        values = iter(flat[: sum(per_question)].cpu().tolist())  # the one host sync of the call; real options first
        return [list(islice(values, n)) for n in per_question]

    def _grow_rows(self, normed: torch.Tensor, pooled: int) -> None:
        """Size the pooled-rows buffer: first for a record of `max_tokens` (the common case never grows it), then at
        least twice over for a schema whose spans need more. The old graphs read the old buffer, so they go, and with
        them their memory pool: a capture into the pool of graphs that no longer exist fails in the allocator."""
        least = 2 * self.rows.shape[0] if self.rows is not None else self.max_tokens + 1
        self.rows = normed.new_zeros(_size(max(pooled, least)), normed.shape[1])
        self.graphs.clear()
        self.pool = None

    def _capture(self, entry: HeadGraph) -> torch.Tensor:
        """The graph of `entry`'s bucket; returns the answer of the eager run before the capture."""
        graph, eager, entry.probabilities = capture(lambda: self._body(entry), self.device, self.pool)
        self.pool = graph.pool()
        entry.graph = graph
        self.captures += 1
        return eager

    def describe(self) -> dict:
        return {"max_tokens": self.max_tokens, "graphs": len(self.graphs), "captures": self.captures,
                "replays": self.replays, "disabled": self.disabled}
