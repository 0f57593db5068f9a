"""State cache: what the backbone and the head need to continue a record after its state prefix.

A record's state prefix is tokens [0, state_end) — prefix + media + state, everything before the schema. For a
prefix we keep, per layer, the full-attention K/V or the Gated DeltaNet conv tail and recurrent state
(`packed.LayerState`), plus the head's memory projection of the prefix tokens. The head's normalized hidden states
of the prefix are not kept: the head reads them only at question spans, option spans and the last token, all of
which lie in the schema and suffix.

Entries are keyed by model, the prefix token ids and the media digest, bounded in bytes: first on the engine's
device, then (on CUDA, entries up to `SPILL_MAX_BYTES`) in host memory; least recently used entries move down a tier,
then out, and a record longer than the token budget first moves the whole device tier down (`make_room`). The copy
to host memory runs on its own thread and CUDA stream; an entry being copied is found in neither tier until its copy
is done. One GPU worker thread uses the cache; a lock keeps `stats()` readers safe. `PrefixCache` (at the end) is
the whole feature as the engine calls it.
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .graphs import bucket
from .packed import LayerState, chunked_head_inputs, runs_in_chunks
from .segments import make_segments

GiB = 2**30
# Entries larger than this are dropped when they leave the device tier instead of being copied to host memory.
# Copying gigabytes to the host, pinned (cudaHostAlloc) or pageable, holds the CUDA driver long enough to stall the
# kernel launches of the thread answering requests: a ~67k decide took 12.7 s with its predecessor's 4.4 GB state
# spilling and 7.4 s with the cache off, its GPU work 7.2 s (the long records' run 1 in bench/README.md's run history).
# A long state is stored on the device (views of the record's own K/V, no copy) and dropped when evicted.
SPILL_MAX_BYTES = 256 * 2**20


@dataclass(eq=False)  # compared and hashed by identity: graphs.py keys its continuation graphs by the entry object
class PrefixState:
    length: int
    layers: list[LayerState]
    memory: torch.Tensor  # [length, head width]: the head's memory projection of the prefix tokens
    reuses_alone: int = 0  # records continued from it one at a time (`PrefixCache.forward_after`)

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in layer.tensors()] + [self.memory]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixState:
        return PrefixState(self.length, [layer.to(device, non_blocking) for layer in self.layers],
                           self.memory.to(device, non_blocking=non_blocking))


def prefix_key(model_id: str, token_ids: list[int], media_digest: str = "") -> str:
    hasher = hashlib.blake2b(digest_size=20)
    for part in (model_id.encode(), b"\0", media_digest.encode(), b"\0",
                 torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()):
        hasher.update(part)
    return hasher.hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    moved_to_host: int = 0


@dataclass
class StateCache:
    device: torch.device
    device_bytes: int = 8 * GiB
    host_bytes: int = 32 * GiB
    min_prefix_tokens: int = 2048  # shorter prefixes are cheaper to recompute than to split the forward for
    enabled: bool = True
    _device_entries: OrderedDict = field(default_factory=OrderedDict)
    _host_entries: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stats: CacheStats = field(default_factory=CacheStats)
    _spills: queue.Queue = field(default_factory=queue.Queue)
    _spiller: threading.Thread | None = None
    _spilling: int = 0
    _generation: int = 0

    def get(self, key: str) -> PrefixState | None:
        with self._lock:
            entry = self._device_entries.get(key)
            if entry is not None:
                self._device_entries.move_to_end(key)
                self._stats.hits += 1
                return entry
            entry = self._host_entries.pop(key, None)
            if entry is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
        entry = entry.to(self.device, non_blocking=True)  # back to the device tier (a new object: no graphs)
        self._insert(key, entry)
        return entry

    def put(self, key: str, state: PrefixState) -> None:
        if state.nbytes > self.device_bytes:
            return  # larger than the device tier, and too large to copy to the host (SPILL_MAX_BYTES): not kept
        self._insert(key, state)
        with self._lock:
            self._stats.stored += 1

    def _insert(self, key: str, state: PrefixState) -> None:
        with self._lock:
            self._device_entries.pop(key, None)
            self._host_entries.pop(key, None)
            self._device_entries[key] = state
            while self._tier_bytes(self._device_entries) > self.device_bytes:  # least recently used first
                self._move_down(*self._device_entries.popitem(last=False))

    def make_room(self) -> None:
        """Move every entry of the device tier down a tier: called before a record longer than the token budget, so
        that its chunks' activations and its own state (stored after its answer) take the device tier's memory
        instead of adding to it; what a long record may peak at is then its weights, its keys/values and a bounded
        working set, whatever was answered before it."""
        with self._lock:
            while self._device_entries:  # least recently used first
                self._move_down(*self._device_entries.popitem(last=False))

    def _move_down(self, key: str, state: PrefixState) -> None:
        """An entry leaving the device tier (called with the lock held): copied to host memory if small, else out."""
        if self.device.type == "cuda" and state.nbytes <= min(self.host_bytes, SPILL_MAX_BYTES):
            self._spill_to_host(key, state)
        else:
            self._stats.evicted += 1

    def _spill_to_host(self, key: str, state: PrefixState) -> None:
        """Queue the entry's copy to host memory (called with the lock held). The event marks the point of the
        worker's stream after which the entry's tensors are complete."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        if self._spiller is None:
            self._spiller = threading.Thread(target=self._spill_worker, name="clef-state-cache-spill", daemon=True)
            self._spiller.start()
        self._spilling += 1
        self._spills.put((self._generation, key, state, ready))

    def _spill_worker(self) -> None:
        stream = torch.cuda.Stream(self.device)
        while True:
            generation, key, state, ready = self._spills.get()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                moved = state.to("cpu")  # blocking: done when it returns, the device tensors can go
            del state
            with self._lock:
                self._spilling -= 1
                if generation != self._generation:
                    continue  # cleared meanwhile
                self._host_entries[key] = moved
                self._stats.moved_to_host += 1
                while self._host_entries and self._tier_bytes(self._host_entries) > self.host_bytes:
                    self._host_entries.popitem(last=False)
                    self._stats.evicted += 1

    @staticmethod
    def _tier_bytes(entries: OrderedDict) -> int:
        return sum(state.nbytes for state in entries.values())

    def clear(self, *, reset_stats: bool = False) -> None:
        with self._lock:
            self._device_entries.clear()
            self._host_entries.clear()
            self._generation += 1  # copies to host in flight are dropped when they land
            if reset_stats:
                self._stats = CacheStats()

    def stats(self) -> dict:
        with self._lock:
            out = dict(vars(self._stats), device_bytes=self._tier_bytes(self._device_entries),
                       host_bytes=self._tier_bytes(self._host_entries),
                       entries=len(self._device_entries) + len(self._host_entries))
        out.update(enabled=self.enabled, device_limit=self.device_bytes, host_limit=self.host_bytes,
                   min_prefix_tokens=self.min_prefix_tokens, moving_to_host=self._spilling)
        return out


class PrefixCache:
    """The long-state feature in one place: which records it takes (a state of at least `min_prefix_tokens`
    tokens, followed by a schema), storing a state by the forward that answers the record (no second pass), and
    continuing a record from a stored state (the schema and suffix tokens only, from a CUDA graph once the state is
    reused). Both return the head's inputs, (normed hidden states, memory) of the whole record; the engine runs the
    head."""

    def __init__(self, store: StateCache, backbone, head, graphs, *, model_key: str, pad_token_id: int,
                 dtype: torch.dtype):
        self.store = store
        self.backbone = backbone
        self.head = head
        self.graphs = graphs
        self.model_key = model_key
        self.pad_token_id = pad_token_id
        self.dtype = dtype

    def key(self, record) -> str | None:
        """The cache key of the record's state prefix, or None when the cache does not take the record."""
        if not self.store.enabled or not self.store.min_prefix_tokens <= record.state_end < len(record):
            return None
        return prefix_key(self.model_key, record.input_ids[: record.state_end], record.media_digest)

    def lookup(self, record) -> PrefixState | None:
        key = self.key(record)
        return self.store.get(key) if key is not None else None

    def forward_for_store(self, record, between_layers=None,
                          chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, PrefixState]:
        """One forward over the whole record that also returns every layer's state at the end of the state, in
        chunks of `chunk_tokens` if the record is longer (0: whole): the head's inputs and the state, to put in
        the cache once the record is answered (the chunked forward's K/V buffers themselves: no copy)."""
        length = record.state_end
        device = self.backbone.device
        ids = torch.tensor(record.input_ids, dtype=torch.long).to(device, non_blocking=True)
        if runs_in_chunks(len(record), chunk_tokens):
            normed, memory, layers = chunked_head_inputs(self.backbone, ids, self.head.token_memory, self.dtype,
                                                         chunk_tokens, split_at=length, between_layers=between_layers)
        else:
            hidden, layers = self.backbone.forward(ids, make_segments([len(record)], device), split_at=length,
                                                   between_layers=between_layers)
            normed, memory = self.head.token_memory(hidden.to(self.dtype))
        # a view: the schema's few rows more than a copy would keep, and no second copy of a long state's memory
        return normed, memory, PrefixState(length, layers, memory[:length])

    def forward_after(self, records, states: list[PrefixState], *, alone: bool = False, graph: bool = False,
                      between_layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone over the tokens after each record's stored state only (the schema + suffix), continuing
        from it, the records as one pack (a sweep's variants over one state, a re-run's records over theirs: one
        backbone forward); then the head's inputs of the whole records, one after another as the head's packed
        layout reads them (rows of a state's tokens are zero in `normed`: the head reads them only through the
        stored memory). `alone`: one record, right-padded to a bucket length (a graph per bucket, and GEMMs of odd
        row counts run slower per token; padding after the last real token changes nothing before it: the backbone
        is causal); `graph`: it replays the state's continuation graph, captured on the state's second reuse alone,
        not its first: a capture costs about three eager runs, and a plain run over cached states reuses each once;
        off for a state used once (Why)."""
        device = self.backbone.device
        lengths = [len(record) - state.length for record, state in zip(records, states, strict=True)]
        ids = [token for record, state in zip(records, states) for token in record.input_ids[state.length:]]
        if alone:
            ids += [self.pad_token_id] * (bucket(lengths[0]) - lengths[0])
            states[0].reuses_alone += 1
        tokens = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
        graph = alone and graph and states[0].reuses_alone > 1 and self.graphs is not None
        hidden = self.graphs.run_after_prefix(tokens, states[0]) if graph else None
        if hidden is None:
            segments = make_segments([len(ids)] if alone else lengths, device,
                                     first_position=[state.length for state in states])
            hidden, _ = self.backbone.forward(tokens, segments, prefixes=[state.layers for state in states],
                                              between_layers=between_layers)
        normed_new, memory_new = self.head.token_memory(hidden[: sum(lengths)].to(self.dtype))
        normed = normed_new.new_zeros(sum(len(record) for record in records), normed_new.shape[-1])
        memory = []
        for record, state, start, new, n in zip(records, states, itertools.accumulate([0, *map(len, records)]),
                                                itertools.accumulate([0, *lengths]), lengths):
            normed[start + state.length: start + len(record)] = normed_new[new: new + n]
            memory += [state.memory.to(memory_new.dtype), memory_new[new: new + n]]
        return normed, torch.cat(memory)
