"""CUDA graphs of the packed backbone, for one record at a time.

A short record is bound by the host launching the forward's kernels one by one; a graph replays the whole forward
with one launch. Two kinds, one owner:

- prefill graphs: one record of up to `max_tokens` tokens, right-padded to a bucket length (multiples of 32 up to
  1,024 tokens, of 128 up to 2,048, of 256 beyond). Padding after the last real token changes nothing before it
  (the backbone is causal). `capture_all` captures every bucket while the engine warms up, so any record of any
  length replays a graph; the memory that costs is measured there and bounded by `memory_limit`.
- continuation graphs: one record continuing after a cached state prefix (fast/cache.py). A graph reads the
  entry's tensors by address, so its graphs live exactly as long as the entry object: they are kept in a
  WeakKeyDictionary keyed by it (an entry evicted, or moved to host memory and back as a new object, takes its
  graphs with it). They are captured when a prefix is reused, not when it is stored.

All graphs share one memory pool (one GPU worker thread: they never run at the same time), so the output of a
replay is valid until the next replay. If a capture fails, that kind of graph is switched off with the reason kept
and the eager path answers instead.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
import torch

from . import kernels as K

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture (and the eager run before it) uses on `device`. One, not one per capture: the
    caching allocator reuses a freed block only on the stream it was allocated on, so a new stream per capture
    would give every graph its own scratch memory."""
    device = torch.device(device)
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def capture(graph: torch.cuda.CUDAGraph, body, device: torch.device, pool=None):
    """Capture `body()` into `graph` on the side stream and return its output. As torch.cuda.graph does, minus its
    gc.collect() and empty_cache() before every capture: in a process holding a whole model they are slow, and the
    request that first meets a new shape would pay for them."""
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = body()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def bucket(n: int) -> int:
    """The padded length a record of `n` tokens runs at."""
    step = 32 if n <= 1024 else 128 if n <= 2048 else 256
    return -(-n // step) * step


def buckets(max_tokens: int) -> list[int]:
    """Every bucket length up to `max_tokens`."""
    out, n = [], 1
    while n <= max_tokens:
        out.append(bucket(n))
        n = out[-1] + 1
    return out


class Graph:
    """One captured forward: its static input ids and its output view."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ids: torch.Tensor, hidden: torch.Tensor, segments: K.Segments):
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
        self.memory_bytes = 0  # device memory the captured prefill graphs hold (measured by capture_all)

    def _capture(self, length: int) -> Graph:
        return self._capture_with(torch.zeros(length, dtype=torch.long, device=self.backbone.device))[0]

    def _capture_with(self, ids: torch.Tensor, prefix=None) -> tuple[Graph, torch.Tensor]:
        """Capture the forward of `ids` (after `prefix`, a cached PrefixState, if given). Returns the graph and the
        output of the eager run made just before capturing: that run compiles and autotunes every kernel for these
        shapes, and on real ids it is a real answer."""
        device = self.backbone.device
        length = ids.shape[0]
        first = prefix.length if prefix is not None else 0
        segments = K.make_segments([length], device, first_position=first)
        arguments = {"prefix": prefix.layers, "prefix_length": first} if prefix is not None else {}
        static_ids = ids.clone()
        side = side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            eager, _ = self.backbone.forward(static_ids, segments, **arguments)
            eager = eager.clone()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        hidden, _ = capture(graph, lambda: self.backbone.forward(static_ids, segments, **arguments), device,
                            self.pool)
        self.pool = graph.pool()
        self.captures += 1
        return Graph(graph, static_ids, hidden, segments), eager

    def usable(self, n: int) -> bool:
        return self.disabled is None and n <= self.max_tokens

    def capture_all(self) -> dict:
        """Capture every bucket up to max_tokens (longest first, so the pool is sized once by the largest), stopping
        where the pool would outgrow `memory_limit`. Returns what it captured and the memory it took."""
        device = self.backbone.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what stays reserved afterwards is what the graphs hold
        before = torch.cuda.memory_reserved(device)
        for length in sorted(buckets(self.max_tokens), reverse=True):
            if self.disabled is not None:
                break
            if length in self.prefill:
                continue
            torch.cuda.empty_cache()  # count what the graphs hold, not the eager runs' freed scratch
            if torch.cuda.memory_reserved(device) - before > self.memory_limit:
                break  # the buckets left are captured on first use, within the same pool
            try:
                self.prefill[length] = self._capture(length)
            except Exception as error:  # noqa: BLE001 — fall back to eager, and say why
                self.disabled = f"{type(error).__name__}: {error}"[:500]
                torch.cuda.synchronize(device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        return {"buckets": len(self.prefill), "memory_bytes": self.memory_bytes, "disabled": self.disabled}

    def run(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [n, hidden] of one record from its bucket's graph (captured now if warm-up did not), or
        None if graphs are off for it. The result is a view into the graph's output: read it before the next call."""
        n = input_ids.shape[0]
        if not self.usable(n):
            return None
        length = bucket(n)
        graph = self.prefill.get(length)
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

INDEX_FIELDS = ("record_rows", "last_rows", "question_rows", "question_chunk", "question_count", "question_record",
                "question_slot", "question_type", "record_questions", "option_rows", "option_token_ids",
                "option_chunk", "option_count", "option_question", "option_record", "option_record_slot",
                "option_question_slot", "record_options", "question_options")
MASK_FIELDS = ("memory_padding", "question_keep", "field_padding", "option_keep", "question_option_padding")


def _size(n: int, least: int = 1) -> int:
    """`n` rounded up to a power of two up to 16, then to a multiple of an eighth of its power of two (at most
    12.5% over): few shapes, little padding."""
    n = max(n, least)
    if n <= 16:
        return 1 << max(0, n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _padded(array: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def head_shape(batch, tokens: int) -> tuple[int, ...]:
    """The bucket of one record's head call: (memory tokens, questions, options per question, question-span grid
    rows and width, option-span grid rows and width), each rounded up by `_size`. One spare question always: it
    holds the padding options, so that no padding slot joins a real question."""
    per_question = np.bincount(batch.option_question.numpy(), minlength=len(batch.question_count))
    return (_size(tokens, 1024), _size(len(batch.question_count) + 1), _size(int(per_question.max())),
            _size(batch.question_rows.shape[0]), _size(batch.question_rows.shape[1]),
            _size(batch.option_rows.shape[0]), _size(batch.option_rows.shape[1]))


def padded_head_arrays(batch, tokens: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The index arrays of a one-record `layout` (model/head.py) padded to `shape`, in the head's multi-record form
    (memory, field and option masks), so that the padding changes no real answer: padding memory rows, questions and
    options are masked out of every attention and softmax; padding spans have no kept tokens (zero means, count 1,
    so nothing divides by zero); every padding question owns one unmasked padding option (its softmax stays finite).
    Options sit on a [questions, options per question] grid: option k of question j is slot j * K + k."""
    t_b, q_b, k_b, cq_b, lq_b, co_b, lo_b = shape
    a = {name: getattr(batch, name).numpy() for name in ("question_rows", "question_keep", "question_count",
                                                         "question_type", "option_rows", "option_token_ids",
                                                         "option_keep", "option_count", "option_question",
                                                         "option_question_slot")}
    questions, options = len(a["question_count"]), len(a["option_count"])
    slots = q_b * k_b
    real_slot = a["option_question"] * k_b + a["option_question_slot"]
    question_chunk = (batch.question_chunk.numpy() if batch.question_chunk is not None
                      else np.arange(questions, dtype=np.int64))
    option_chunk = batch.option_chunk.numpy() if batch.option_chunk is not None else np.arange(options, dtype=np.int64)
    position = np.arange(t_b, dtype=np.int64)
    option_count = np.ones(slots, dtype=np.int64)
    option_count[real_slot] = a["option_count"]
    padding = np.ones((q_b, k_b), dtype=bool)
    padding.reshape(-1)[real_slot] = False
    padding[questions:, 0] = False
    grid = np.arange(slots, dtype=np.int64)
    return {
        "record_rows": np.where(position < tokens, position, 0)[None], "memory_padding": (position >= tokens)[None],
        "last_rows": np.array([tokens - 1], dtype=np.int64),
        "question_rows": _padded(a["question_rows"], (cq_b, lq_b), 0),
        "question_keep": _padded(a["question_keep"], (cq_b, lq_b), False),
        "question_chunk": _padded(question_chunk, (cq_b,), q_b - 1),
        "question_count": _padded(a["question_count"], (q_b,), 1),
        "question_record": np.zeros(q_b, dtype=np.int64), "question_slot": np.arange(q_b, dtype=np.int64),
        "question_type": _padded(a["question_type"], (q_b,), 0),
        "record_questions": np.arange(q_b, dtype=np.int64)[None],
        "field_padding": (np.arange(q_b) >= questions)[None],
        "option_rows": _padded(a["option_rows"], (co_b, lo_b), 0),
        "option_token_ids": _padded(a["option_token_ids"], (co_b, lo_b), 0),
        "option_keep": _padded(a["option_keep"], (co_b, lo_b), False),
        "option_chunk": _padded(real_slot[option_chunk], (co_b,), slots - 1),
        "option_count": option_count, "option_question": grid // k_b, "option_record": np.zeros(slots, dtype=np.int64),
        "option_record_slot": grid, "option_question_slot": grid % k_b, "record_options": grid[None],
        "question_options": grid.reshape(q_b, k_b), "question_option_padding": padding,
    }


class HeadGraph:
    """The head for one shape bucket: static index buffer, static inputs (views of shared buffers), the output."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        self.shape = shape
        arrays = padded_head_arrays_template(shape)
        self.layout = [(name, arrays[name].shape) for name in INDEX_FIELDS + MASK_FIELDS]
        size = sum(int(np.prod(s)) for _, s in self.layout)
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.probabilities: torch.Tensor | None = None

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Write the arrays into the static device buffer (one host-to-device copy)."""
        np.concatenate([arrays[name].reshape(-1).astype(np.int64) for name, _ in self.layout],
                       out=self.host.numpy())
        self.device_buffer.copy_(self.host, non_blocking=True)

    def batch(self):
        from ..model.head import HeadBatch

        views, start = {}, 0
        for name, shape in self.layout:
            count = int(np.prod(shape))
            view = self.device_buffer[start: start + count].view(shape)
            views[name] = view.bool() if name in MASK_FIELDS else view
            start += count
        return HeadBatch(buffer=self.device_buffer, memory_start=0, memory_length=self.shape[0],
                         **{name: views.get(name) for name in INDEX_FIELDS + MASK_FIELDS})


def padded_head_arrays_template(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Arrays of the right shapes for `shape` (their values do not matter: they size the static buffer)."""
    t_b, q_b, k_b, cq_b, lq_b, co_b, lo_b = shape
    return {name: np.zeros(s, dtype=np.int64) for name, s in (
        ("record_rows", (1, t_b)), ("memory_padding", (1, t_b)), ("last_rows", (1,)),
        ("question_rows", (cq_b, lq_b)), ("question_keep", (cq_b, lq_b)), ("question_chunk", (cq_b,)),
        ("question_count", (q_b,)), ("question_record", (q_b,)), ("question_slot", (q_b,)), ("question_type", (q_b,)),
        ("record_questions", (1, q_b)), ("field_padding", (1, q_b)),
        ("option_rows", (co_b, lo_b)), ("option_token_ids", (co_b, lo_b)), ("option_keep", (co_b, lo_b)),
        ("option_chunk", (co_b,)), ("option_count", (q_b * k_b,)), ("option_question", (q_b * k_b,)),
        ("option_record", (q_b * k_b,)), ("option_record_slot", (q_b * k_b,)), ("option_question_slot", (q_b * k_b,)),
        ("record_options", (1, q_b * k_b)), ("question_options", (q_b, k_b)), ("question_option_padding", (q_b, k_b)))}


class HeadGraphs:
    """The joint head of one record from a CUDA graph per shape bucket (`head_shape`): with no backbone running to
    hide them, the head's few hundred small kernels are bound by the host launching them. A new bucket is captured on
    first use (the eager run before the capture answers that call); at most `max_graphs` are kept, least recently
    used out. Records longer than `max_tokens` run the head eagerly. On the CPU, `capture=False` runs the same padded
    call eagerly, which is how tests check that the padding changes no answer."""

    def __init__(self, head, output_embeddings: torch.Tensor, *, max_tokens: int = 32_768, max_graphs: int = 64,
                 capture: bool = True):
        self.head = head
        self.output_embeddings = output_embeddings
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self.device = output_embeddings.device
        self.graphs: OrderedDict[tuple, HeadGraph] = OrderedDict()
        self.normed: torch.Tensor | None = None  # [max_tokens, hidden], shared by every graph
        self.memory: torch.Tensor | None = None  # [max_tokens, width]
        self.pool = None
        self.disabled: str | None = None
        self.captures = 0
        self.replays = 0

    def usable(self, tokens: int) -> bool:
        return self.disabled is None and tokens <= self.max_tokens

    def _body(self, entry: HeadGraph) -> torch.Tensor:
        from ..model.head import option_probabilities

        tokens = entry.shape[0]
        batch = entry.batch()
        logits = self.head.decide_from_memory(self.normed[:tokens], self.memory[:tokens], self.output_embeddings,
                                              batch)
        return option_probabilities(logits, batch)

    def probabilities(self, normed: torch.Tensor, memory: torch.Tensor, record, batch) -> list[list[float]] | None:
        """Per question, the option probabilities of `record` (its one-record `layout` is `batch`, on the CPU), or
        None if the head graphs are off."""
        tokens = normed.shape[0]
        if not self.usable(tokens):
            return None
        shape = head_shape(batch, tokens)
        if self.normed is None:
            self.normed = normed.new_zeros(self.max_tokens, normed.shape[1])
            self.memory = memory.new_zeros(self.max_tokens, memory.shape[1])
        self.normed[:tokens].copy_(normed)
        self.memory[:tokens].copy_(memory)
        entry = self.graphs.get(shape)
        fresh = entry is None
        if fresh:
            entry = HeadGraph(shape, self.device)
        entry.load(padded_head_arrays(batch, tokens, shape))
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
        values = flat.cpu().tolist()  # the one host sync of the call
        k_b = shape[2]
        return [[values[j * k_b + k] for k in range(len(spans))] for j, spans in enumerate(record.option_spans)]

    def _capture(self, entry: HeadGraph) -> torch.Tensor:
        side = side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            eager = self._body(entry).clone()  # compiles for these shapes; answers this call
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        entry.probabilities = capture(graph, lambda: self._body(entry), self.device, self.pool)
        self.pool = graph.pool()
        entry.graph = graph
        self.captures += 1
        return eager

    def describe(self) -> dict:
        return {"max_tokens": self.max_tokens, "graphs": len(self.graphs), "captures": self.captures,
                "replays": self.replays, "disabled": self.disabled}
