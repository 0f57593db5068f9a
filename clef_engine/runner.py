"""The model runner: encoded records in, per record per question the options' probabilities out, with one host sync
per batch. It knows nothing of requests or of the queue: the engine picks one runner at load (`PlainRunner` for
packed=False, else `PackedRunner`) and the scheduler calls its `forward` with each batch and the batch's
`BatchSteps`, its one way to reach the scheduler. A batch holds encoded records and, on the packed path, items that
stand for several records decided as one: Why's `SharedPrefixes` (a record and its variants) and a schema sweep's
`StateVariants` (records over one state, or a few)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from .config import EngineConfig
from .fast import attention, kernels
from .fast.cache import PrefixCache, PrefixState, StateCache, prefix_key
from .fast.graphs import HeadGraphs, PrefillGraphs
from .fast.head_kernels import head_attention_kernel
from .fast.packed import PackedBackbone, chunked_head_inputs, longest_chunk, pack_ids, runs_in_chunks
from .fast.segments import make_segments
from .model import backbone
from .model.encoding import DEFAULT_MAX_LENGTH, EncodedRecord
from .model.head import HeadBatch, JointSchemaHead, layout, option_probabilities
from .scheduler import BatchSteps

LAYERS_AHEAD = 1  # in a bulk batch, how many layers the host may launch ahead of the GPU
SHARED_SPLITS = 4  # at most so many points where a Why record's variants continue from its states
LONG_ATTENTION_WARM_TOKENS = 2 * DEFAULT_MAX_LENGTH  # warm-up builds cuDNN's attention plans up to this length
UNCHECKED = BatchSteps()  # a batch run outside the scheduler (tests, benchmarks): nothing to stop or let in

Probabilities = list[list[float]]  # one record's: per question, the options' probabilities in model order


def fast_kernels_available() -> dict[str, bool]:
    """Which optional fast kernels can be imported here (they are used only on CUDA)."""
    return {name: importlib.util.find_spec(module) is not None
            for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}


class PlainRunner:
    """The release's own padded call for a whole scheduler batch: padded backbone batches of similar length, then
    the batched head."""

    path = "forward_plain"

    def __init__(self, model: Any, head: JointSchemaHead, config: EngineConfig, pad_token_id: int) -> None:
        self.model, self.head, self.config, self.pad_token_id = model, head, config, pad_token_id
        self.device, self.dtype = config.device, config.dtype
        self.output_embeddings = model.lm_head.weight  # the head reads it as a table (untied in Clef)
        # chosen (and checked on the device) here, on the loading thread: not first inside a CUDA graph capture
        head.attention = head_attention_kernel(self.device, self.dtype, head.config.width // head.config.heads)
        self.state_prefills = 0  # records whose state the backbone computed, rather than continued from a kept one

    @torch.inference_mode()
    def forward(self, records: list[EncodedRecord], steps: BatchSteps = UNCHECKED) -> list[Probabilities]:
        results: dict[int, Probabilities] = {}
        self._forward_padded(records, range(len(records)), results, steps)
        return [results[i] for i in range(len(records))]

    def _forward_padded(self, records: list[EncodedRecord], indices: Iterable[int],
                        results: dict[int, Probabilities], steps: BatchSteps) -> None:
        """Records `indices` in padded batches: text apart from media, similar lengths together (sorted), each
        batch's padded size (count × longest) within the token budget, a record longer than the budget alone (the
        padded call pays for padding, so it regroups the scheduler's batch by length)."""
        chunks: list[list[int]] = []
        for index in sorted(indices, key=lambda i: (records[i].has_media, len(records[i]))):
            chunk = chunks[-1] if chunks else None
            if (chunk and records[chunk[0]].has_media == records[index].has_media
                    and (len(chunk) + 1) * len(records[index]) <= self.config.token_budget):
                chunk.append(index)
            else:
                chunks.append([index])
        for chunk in chunks:
            for i, probs in zip(chunk, self.forward_padded([records[i] for i in chunk], steps)):
                results[i] = probs

    @torch.inference_mode()
    def forward_padded(self, records: list[EncodedRecord], steps: BatchSteps = UNCHECKED) -> list[Probabilities]:
        """One padded backbone batch, then the batched head."""
        steps.stop_if_abandoned()
        hidden = backbone.run_padded(self.model, records, self.pad_token_id)
        self.state_prefills += len(records)
        batch_size, padded_length, width = hidden.shape
        lengths = [len(r) for r in records]
        offsets = [b * padded_length for b in range(batch_size)]
        return self.head_probabilities(hidden.reshape(-1, width), records, offsets, lengths, steps)

    def head_one(self, normed: torch.Tensor, memory: torch.Tensor, record: EncodedRecord,
                 steps: BatchSteps = UNCHECKED) -> Probabilities:
        """The head over one record's normed hidden states and memory."""
        steps.stop_if_abandoned()
        return self.head_from_memory(normed, memory, [record], [0], [len(record)])[0]

    def head_probabilities(self, hidden_flat: torch.Tensor, records: list[EncodedRecord], offsets: list[int],
                           lengths: list[int], steps: BatchSteps = UNCHECKED) -> list[Probabilities]:
        steps.stop_if_abandoned()
        if len(records) == 1:
            normed, memory = self.head.token_memory(hidden_flat[offsets[0]: offsets[0] + lengths[0]].to(self.dtype))
            return [self.head_one(normed, memory, records[0], steps)]
        return self.head_from_memory(*self.head.token_memory(hidden_flat.to(self.dtype)), records, offsets, lengths)

    def head_from_memory(self, normed: torch.Tensor, memory: torch.Tensor, records: list[EncodedRecord],
                         offsets: list[int], lengths: list[int]) -> list[Probabilities]:
        """The head over records whose normed hidden states and memory start at flat rows `offsets`: one host
        sync for them all."""
        batch = layout(records, offsets, lengths).to(self.device)
        logits = self.head.decide_from_memory(normed, memory, self.output_embeddings, batch)
        return split_probabilities(logits, batch, records)

    def warm_up_steps(self) -> list[Callable[[], Any]]:
        """What to compile and capture before a user's first request needs it (the engine's warm-up runs each step
        on the worker thread, as bulk work): nothing here."""
        return []

    def capture_on_use(self, on: bool) -> None:
        """Whether a graph not captured yet is captured when a record first needs it (off while warming up): no
        graphs here."""

    def clear_states(self) -> None:
        """Forget every stored state."""

    def info(self) -> dict[str, Any]:
        """Which path and which kernels answer requests here, and the state cache's counts (None: no cache)."""
        return {"kernels": {"available": fast_kernels_available(), "path": self.path,
                            "head_attention": self.head.attention.__name__},
                "state_cache": None, "state_prefills": self.state_prefills}


class PackedRunner(PlainRunner):
    """The fast path: records with media take the padded multimodal call; text records run through our packed layer
    loop (fast/packed.py): several records as one pack with no padding; a record alone in its batch replays a CUDA
    graph of its length bucket (fast/graphs.py; with CUDA graphs off they hold no bucket), or, when its state is long
    enough to keep, runs once over the whole record and keeps the state's layer states (fast/cache.py) so that a new
    schema on the same state later runs only the schema's tokens (`continue_from`). A record alone longer than
    `prefill_chunk_tokens` runs in chunks of about that many tokens (bounded activations, `chunk_bounds`)."""

    path = "forward_packed"

    def __init__(self, model: Any, head: JointSchemaHead, config: EngineConfig, pad_token_id: int,
                 model_key: str) -> None:
        super().__init__(model, head, config, pad_token_id)
        # With a warm-up to come, the engine answers at once on the plain PyTorch kernels (nothing to compile) and
        # the warm-up compiles and checks the fast ones (`compile_fast_kernels`) before switching to them: on a
        # cold machine their compiles and autotuning take longer than loading the weights.
        self.plain_until_warm = config.warm_up
        self.backbone = PackedBackbone(model, kernels.Kernels() if self.plain_until_warm else None)
        self.graphs = PrefillGraphs(self.backbone, 0)
        self.head_graphs = HeadGraphs(head, self.output_embeddings, max_tokens=0)
        if not self.plain_until_warm:
            self.enable_graphs()
        self.state_cache = StateCache(config.device, device_bytes=config.state_cache_bytes,
                                      host_bytes=config.state_cache_host_bytes,
                                      min_prefix_tokens=config.min_prefix_tokens,
                                      enabled=config.state_cache_bytes > 0)
        self.prefix = PrefixCache(self.state_cache, self.backbone, head, self.graphs, model_key=model_key,
                                  pad_token_id=pad_token_id, dtype=config.dtype)

    @torch.inference_mode()
    def forward(self, batch: Sequence[EncodedRecord | SharedPrefixes | StateVariants],
                steps: BatchSteps = UNCHECKED) -> list[Any]:
        """A whole scheduler batch: an explanation's record and variants as one item (`forward_shared`, its result
        the list of theirs), a sweep's variants as one (`forward_variants`); the records as `forward_records` runs
        them."""
        whole = {i: self.forward_shared(item, steps) if isinstance(item, SharedPrefixes)
                 else self.forward_variants(item.records, steps)
                 for i, item in enumerate(batch) if not isinstance(item, EncodedRecord)}
        answers = iter(self.forward_records([item for item in batch if isinstance(item, EncodedRecord)], steps))
        return [whole[i] if i in whole else next(answers) for i in range(len(batch))]

    def forward_records(self, records: list[EncodedRecord], steps: BatchSteps = UNCHECKED) -> list[Probabilities]:
        """Media records padded; the text records whose states are cached continue from them, together; a text
        record alone runs by itself (`forward_one`); the other text records run as one pack."""
        results: dict[int, Probabilities] = {}
        text = [i for i, r in enumerate(records) if not r.has_media]
        pack, continued, states = [], [], []
        for i in text:
            cached = self.prefix.lookup(records[i]) if len(text) > 1 else None
            if cached is not None:
                continued.append(i)
                states.append(cached)
            else:
                pack.append(i)
        if continued:
            results.update(zip(continued, self.continue_from([records[i] for i in continued], states, steps)))
        if len(pack) == 1:
            results[pack[0]] = self.forward_one(records[pack[0]], steps)
        elif pack:
            chosen = [records[i] for i in pack]
            self.state_prefills += len(chosen)
            lengths = [len(r) for r in chosen]
            segments = make_segments(lengths, self.device)
            hidden, _ = self.backbone.forward(pack_ids(chosen, self.device), segments,
                                              between_layers=self.between_layers(steps))
            for i, probs in zip(pack, self.head_probabilities(hidden, chosen, segments.starts, lengths, steps)):
                results[i] = probs
        self._forward_padded(records, [i for i, r in enumerate(records) if r.has_media], results, steps)
        return [results[i] for i in range(len(records))]

    def continue_from(self, records: list[EncodedRecord], states: list[PrefixState],
                      steps: BatchSteps = UNCHECKED, *, graph: bool = True) -> list[Probabilities]:
        """Text records whose first tokens are their state's (`prefix.lookup(record)`; a sweep's or Why's variants
        share one): the backbone over each one's tokens after its state only, continuing from it, then the head.
        One record runs from a CUDA graph once a stored state is reused (`graph` off for a state used once);
        several run as packs of up to `bulk_batch_tokens` new tokens, one backbone forward each: twenty forwards
        of a few hundred tokens would leave the GPU mostly idle, the host launching kernels, and so would a head
        and its host sync per record: each pack's records go through the head at once."""
        new_tokens = [len(r) - s.length for r, s in zip(records, states, strict=True)]
        if len(records) == 1:
            normed, memory = self.prefix.forward_after(records, states, alone=True, graph=graph,
                                                       between_layers=self.between_layers(steps))
            return [self.head_one(normed, memory, records[0], steps)]
        answers: list[Probabilities] = []
        between = self.between_layers(steps)
        for pack in packs_after(new_tokens, self.config.bulk_batch_tokens):
            chosen = [records[i] for i in pack]
            normed, memory = self.prefix.forward_after(chosen, [states[i] for i in pack], between_layers=between)
            steps.stop_if_abandoned()
            lengths = [len(record) for record in chosen]
            answers += self.head_from_memory(normed, memory, chosen, list(itertools.accumulate([0, *lengths[:-1]])),
                                             lengths)
        return answers

    def forward_shared(self, item: SharedPrefixes, steps: BatchSteps = UNCHECKED) -> list[Probabilities]:
        """Per member of `item`, the record first, its probabilities: the record runs once, in up to
        `SHARED_SPLITS` + 1 chunks, and each variant continues from the record's layer states at the last chunk end
        before its first change (as from a stored state), with the other variants continuing from there as one
        pack. A chunk end at every variant's change would recompute nothing twice but run a forward of a few dozen
        tokens per variant, which on the H200 took longer than one pack of every variant whole."""
        record = item.records[0]
        variants_at = continuation_points(item.shared)
        results: dict[int, Probabilities] = {}
        self.state_prefills += 1  # the record's; its variants continue from its states

        def continue_variants(end: int, layers: list[Any], memory: torch.Tensor) -> None:
            indices = variants_at[end]
            answers = self.continue_from([item.records[i] for i in indices],
                                         [PrefixState(end, layers, memory)] * len(indices), steps, graph=False)
            results.update(zip(indices, answers))

        ids = torch.tensor(record.input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        normed, memory, _ = chunked_head_inputs(self.backbone, ids, self.head.token_memory, self.dtype,
                                                self.config.prefill_chunk_tokens,
                                                splits=sorted(variants_at), on_split=continue_variants,
                                                between_layers=self.between_layers(steps))
        results[0] = self.head_one(normed, memory, record, steps)
        return [results[i] for i in range(len(item.records))]

    def forward_one(self, record: EncodedRecord, steps: BatchSteps = UNCHECKED) -> Probabilities:
        """One text record: continued from its cached state; or, with a state long enough to keep, one forward that
        also returns the state, stored once the record is answered; or its length bucket's CUDA graph; or eager. A
        record longer than `prefill_chunk_tokens` runs in chunks (bounded activations, fast/packed.py)."""
        chunk = self.config.prefill_chunk_tokens
        key = self.prefix.key(record)
        cached = self.state_cache.get(key) if key is not None else None
        if cached is not None:
            return self.continue_from([record], [cached], steps)[0]
        if key is not None:
            return self.prefill_and_keep(record, key, steps)[0]
        self.start_prefill(record)
        ids = torch.tensor(record.input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        if runs_in_chunks(len(record), chunk):
            normed, memory, _ = chunked_head_inputs(self.backbone, ids, self.head.token_memory, self.dtype, chunk,
                                                    between_layers=self.between_layers(steps))
            return self.head_one(normed, memory, record, steps)
        hidden = self.graphs.run(ids)
        if hidden is None:
            hidden, _ = self.backbone.forward(ids, make_segments([len(record)], self.device),
                                              between_layers=self.between_layers(steps))
        normed, memory = self.head.token_memory(hidden.to(self.dtype))
        return self.head_one(normed, memory, record, steps)

    def start_prefill(self, record: EncodedRecord) -> None:
        """Count a record computing its state alone. One longer than the token budget first makes room in the state
        cache: the memory check at load (memory.py) sets aside the device tier and a batch of `token_budget` tokens'
        activations, not its keys/values. A shorter one leaves the cache be: moving states to the host stalls this
        thread's launches (fast/cache.py; the Clef-Flash 16k user path, bench/README.md)."""
        self.state_prefills += 1
        if runs_in_chunks(len(record), self.config.prefill_chunk_tokens) and len(record) > self.config.token_budget:
            self.state_cache.make_room()

    def prefill_and_keep(self, record: EncodedRecord, key: str,
                         steps: BatchSteps = UNCHECKED) -> tuple[Probabilities, PrefixState]:
        """One text record computed whole, and its state, kept under `key` in the state cache once it is answered."""
        self.start_prefill(record)
        normed, memory, state = self.prefix.forward_for_store(record, self.between_layers(steps),
                                                              self.config.prefill_chunk_tokens)
        answer = self.head_one(normed, memory, record, steps)  # the answer's host sync first: storing after
        self.state_cache.put(key, state)
        return answer, state

    def forward_variants(self, records: list[EncodedRecord],
                         steps: BatchSteps = UNCHECKED) -> tuple[list[Probabilities], set[int]]:
        """Text records grouped by their state (its tokens before the schema, and media), whatever its length
        (`min_prefix_tokens` weighs one reuse; a schema sweep's variants are many): per group the state comes from
        the cache, or the group's first record computes it (`prefill_and_keep`); then every other record of every
        group continues from its group's state, together (`continue_from`'s packs). Returns the probabilities and
        the indices of the records that computed a state."""
        groups: dict[str, list[int]] = {}
        for i, record in enumerate(records):
            key = prefix_key(self.prefix.model_key, record.input_ids[: record.state_end], record.media_digest)
            groups.setdefault(key, []).append(i)
        results: dict[int, Probabilities] = {}
        computed: set[int] = set()
        continuing: list[int] = []
        states: list[PrefixState] = []
        for key, indices in groups.items():
            state = self.state_cache.get(key)
            if state is None:
                first, indices = indices[0], indices[1:]
                results[first], state = self.prefill_and_keep(records[first], key, steps)
                computed.add(first)
            continuing += indices
            states += [state] * len(indices)
        if continuing:
            results.update(zip(continuing, self.continue_from([records[i] for i in continuing], states, steps)))
        return [results[i] for i in range(len(records))], computed

    def between_layers(self, steps: BatchSteps) -> Callable[[int], None]:
        """For an eager forward: called between layers, it stops the batch once every request in it was abandoned,
        and, inside a bulk batch, keeps the host at most LAYERS_AHEAD layers ahead of the GPU and lets the
        interactive requests waiting run: they queue on the GPU behind a few layers of the bulk batch instead of
        all of it."""
        if not steps.bulk:
            return lambda _index: steps.stop_if_abandoned()
        launched: list[torch.cuda.Event] = []

        def between(_index: int) -> None:
            steps.stop_if_abandoned()
            if self.config.cuda:
                event = torch.cuda.Event()
                event.record()
                launched.append(event)
                if len(launched) > LAYERS_AHEAD:
                    launched.pop(0).synchronize()
            steps.let_interactive_in()

        return between

    def head_one(self, normed: torch.Tensor, memory: torch.Tensor, record: EncodedRecord,
                 steps: BatchSteps = UNCHECKED) -> Probabilities:
        """From a CUDA graph of the record's shape bucket where head graphs take it, else eagerly."""
        steps.stop_if_abandoned()
        probabilities = self.head_graphs.probabilities(normed, memory, record)
        return probabilities if probabilities is not None else super().head_one(normed, memory, record)

    def enable_graphs(self) -> None:
        """CUDA graphs (when configured) from now on: not while the plain kernels stand in for the fast ones, since
        a capture on the worker thread must not overlap the warm-up's compiles on its own thread."""
        on = self.config.cuda_graphs
        self.graphs.max_tokens = self.config.graph_max_tokens if on else 0
        self.head_graphs.max_tokens = 32_768 if on else 0

    def compile_fast_kernels(self) -> kernels.Kernels | None:
        """The fast kernels chosen, checked and compiled on the calling thread (the warm-up's), on a stream of its
        own, while the worker answers requests on the plain ones; None if the backbone runs on its chosen kernels
        already. Pass the result to `use_kernels` on the worker thread."""
        if not self.plain_until_warm:
            return None
        chosen = self.backbone.select_kernels()
        trial = copy.copy(self.backbone)  # the same weights, on the chosen kernels
        trial.kernels = chosen
        long, short = 300, 41  # every kernel the packed path launches compiles and autotunes here: a pack of two
        side = torch.cuda.Stream(self.device) if self.config.cuda else None
        with torch.inference_mode(), torch.cuda.stream(side) if side else contextlib.nullcontext():
            ids = torch.zeros(long + short, dtype=torch.long, device=self.device)
            trial.forward(ids, make_segments([long, short], self.device))
            # a record keeping its state, and a pack continuing from it (a sweep's first case, a re-run's first
            # batch: on the H200 their kernels' compiles and autotuning added ~14 s to a sweep's first 20 cases)
            _, state = trial.forward(ids[:long], make_segments([long], self.device), split_at=long - short)
            trial.forward(ids[: 2 * short], make_segments([short, short], self.device, first_position=long - short),
                          prefixes=[state, state])
        if side is not None:
            side.synchronize()
        return chosen

    def use_kernels(self, chosen: kernels.Kernels) -> None:
        """Run the packed backbone on `chosen` from now on (the warm-up's switch to the fast kernels; benchmarks put
        a kernel back to its plain version to measure what it does). The prefill graphs replay the kernels they were
        captured with and the state cache holds states the old kernels computed, so both are emptied. Call it while
        no request runs."""
        self.backbone.kernels = chosen
        self.plain_until_warm = False
        self.state_cache.clear()
        self.graphs.forget()
        self.enable_graphs()

    def warm_up_steps(self) -> list[Callable[[], Any]]:
        """A CUDA graph for each length bucket, one step each (longest first); cuDNN's attention plan for every
        padded length of a long record, and those of a second chunk of every padded length, a step each (on the
        worker thread: torch keeps cuDNN's plans per thread)."""
        steps: list[Callable[[], Any]] = []
        if self.config.cuda_graphs:
            steps += [partial(self.graphs.capture_bucket, length) for length in self.graphs.lengths_to_capture()]
        text = self.backbone.config
        shape = (self.device, self.dtype, text.num_attention_heads, text.num_key_value_heads, text.head_dim)
        chunk = self.config.prefill_chunk_tokens
        longest = attention.cudnn_length(longest_chunk(chunk))  # a record's longest chunk, padded
        if self.backbone.kernels.attention is attention.attention_varlen_cudnn_long:
            # records longer than a chunk run cuDNN's causal attention on at most its longest chunk and a step
            warm_tokens = longest + attention.CUDNN_LENGTH_STEP if chunk else LONG_ATTENTION_WARM_TOKENS
            steps.append(partial(attention.warm_long_attention, *shape, warm_tokens))
        if chunk and self.backbone.kernels.attention_chunk is attention.attention_chunk_cudnn:
            steps += [partial(attention.warm_chunk_attention, *shape, chunk, tokens)  # longest first, as above
                      for tokens in range(longest, 0, -attention.CUDNN_LENGTH_STEP)]
        return steps

    def capture_on_use(self, on: bool) -> None:
        self.graphs.capture_on_use = on

    def clear_states(self) -> None:
        self.state_cache.clear(reset_stats=True)

    def info(self) -> dict[str, Any]:
        info = super().info()
        info["kernels"].update(
            packed=self.backbone.kernels.describe(),
            slow_fallbacks=self.backbone.kernels.slow if self.config.cuda else [],
            fused_projections=True, prefill_chunk_tokens=self.config.prefill_chunk_tokens or None,  # None: whole
            media_records="forward_padded (multimodal model, padded batch)",
            cuda_graphs=self.graphs.describe() if self.config.cuda_graphs else None,
            head_graphs=self.head_graphs.describe() if self.config.cuda_graphs else None)
        info["state_cache"] = self.state_cache.stats()
        return info


class StateVariants:
    """Records over one state or a few with different schemas (a schema sweep's variants, Engine.decide_variants),
    one item of a scheduler batch that the packed runner decides as a whole (`PackedRunner.forward_variants`, its
    result the probabilities and the indices of the records that computed a state). Its length, what the scheduler
    budgets, is every member's tokens."""

    def __init__(self, records: list[EncodedRecord]) -> None:
        self.records = records

    def __len__(self) -> int:
        return sum(len(r) for r in self.records)


class SharedPrefixes(StateVariants):
    """A text record and its text variants (Why, explain.py), decided as a whole by `PackedRunner.forward_shared`;
    its length is what the explanation is charged (see explain.explain_budget)."""

    def __init__(self, records: list[EncodedRecord]) -> None:
        super().__init__(records)
        self.shared = [shared_prefix(records[0], variant) for variant in records[1:]]


def packs_after(new_tokens: list[int], tokens: int) -> list[list[int]]:
    """The indices of records continuing after cached states, whose new tokens are `new_tokens`, in packs of at
    most `tokens` new tokens (one record at least), in order."""
    packs: list[list[int]] = []
    size = 0
    for index, new in enumerate(new_tokens):
        if not packs or size + new > tokens:
            packs.append([])
            size = 0
        packs[-1].append(index)
        size += new
    return packs


def continuation_points(shared: list[int]) -> dict[int, list[int]]:
    """Where Why's variants continue from the record's states: at most `SHARED_SPLITS` token positions, each with the
    variants (numbered from 1, the record being 0) whose first change, `shared[i - 1]`, is at or after it."""
    splits = sorted(set(shared))
    ends = sorted({splits[i * len(splits) // SHARED_SPLITS] for i in range(SHARED_SPLITS)} if splits else ())
    variants_at: dict[int, list[int]] = {}
    for index, split in enumerate(shared, start=1):
        variants_at.setdefault(max(end for end in ends if end <= split), []).append(index)
    return variants_at


def shared_prefix(record: EncodedRecord, variant: EncodedRecord) -> int:
    """How many of the variant's first tokens are the record's: everything before its first change (at least the
    encoder's fixed prefix), never past the variant's state (the head reads the schema's rows, which are computed)."""
    limit = min(len(record), variant.state_end)
    return next((i for i in range(limit) if record.input_ids[i] != variant.input_ids[i]), limit)


def split_probabilities(logits: torch.Tensor, batch: HeadBatch, records: list[EncodedRecord]) -> list[Probabilities]:
    """Each record's probabilities, per question, out of the batch's flat option logits."""
    flat = iter(option_probabilities(logits, batch).cpu().tolist())  # the one host sync of the batch
    return [[list(itertools.islice(flat, len(spans))) for spans in record.option_spans] for record in records]

