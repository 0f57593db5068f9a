"""Packed (varlen) prefill: records of different lengths in one token-major sequence, no padding.

Our own layer loop over the transformers modules' weights (their parameters, our forward): positions restart at
every record, and the short causal conv, the gated-delta recurrence and full attention each respect record
boundaries (`segments.Segments`). Only the text model runs (no vocabulary logits). At load, the projections that read
the same input are concatenated into one weight each (GDN q/k/v/z/b/a, attention q+gate/k/v, MLP gate/up) and the
modules' parameters become views of it, so the plain transformers path still works and no memory is added.

The same loop continues one record after a cached prefix (`PrefixState`, see cache.py): attention reads the
cached K/V, the conv reads the cached last W-1 inputs, the recurrence starts from the cached state. And one forward
over a whole record can also return those states at a split point (`split_at`, the end of the record's state), so
storing a long state costs no second pass. CUDA graphs of this forward live in graphs.py. A long record alone runs
in chunks (`forward_chunked`).

Media records are not handled here (the engine sends them to the padded multimodal path).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels as K
from .segments import Segments, make_segments


@dataclass
class LayerState:
    """What one layer needs to continue after a prefix: K/V (attention) or conv tail + recurrent state (GDN)."""

    keys: torch.Tensor | None = None  # [P, Hk, D] after norm and RoPE
    values: torch.Tensor | None = None
    conv_tail: torch.Tensor | None = None  # [W-1, conv_dim] the last conv inputs of the prefix
    recurrent: torch.Tensor | None = None  # [1, HV, K, V] float32

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.conv_tail, self.recurrent) if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LayerState:
        return LayerState(*(t.to(device, non_blocking=non_blocking) if t is not None else None
                            for t in (self.keys, self.values, self.conv_tail, self.recurrent)))


def _fuse(modules: list[nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of Linear layers (no bias) and make each module's weight a view of the result."""
    fused = torch.cat([m.weight.detach() for m in modules], dim=0).contiguous()
    row = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[row: row + rows], requires_grad=False)
        row += rows
    return fused


class FastLayer:
    """The weights of one decoder layer, arranged for the packed forward."""

    def __init__(self, layer, config):
        self.kind = layer.block_type
        self.norm1 = (1.0 + layer.input_layernorm.weight.detach().float()).contiguous()
        self.norm2 = (1.0 + layer.post_attention_layernorm.weight.detach().float()).contiguous()
        mlp = layer.mlp
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj.weight
        if self.kind == "linear_attention":
            gdn = layer.linear_attn
            self.key_dim, self.value_dim = gdn.key_dim, gdn.value_dim
            self.k_heads, self.v_heads = gdn.num_k_heads, gdn.num_v_heads
            self.k_head_dim, self.v_head_dim = gdn.head_k_dim, gdn.head_v_dim
            self.conv_dim = gdn.conv_dim
            self.in_proj = _fuse([gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a])
            self.conv_weight = gdn.conv1d.weight.detach()[:, 0, :]  # [conv_dim, W] view
            self.conv_width = self.conv_weight.shape[-1]
            self.A_log, self.dt_bias = gdn.A_log.detach(), gdn.dt_bias.detach()
            self.gated_norm = gdn.norm.weight.detach()
            self.gated_norm_eps = gdn.norm.variance_epsilon
            self.out_proj = gdn.out_proj.weight
        else:
            attn = layer.self_attn
            self.heads = config.num_attention_heads
            self.kv_heads = config.num_key_value_heads
            self.head_dim = attn.head_dim
            self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            self.q_norm = (1.0 + attn.q_norm.weight.detach().float()).contiguous()
            self.k_norm = (1.0 + attn.k_norm.weight.detach().float()).contiguous()
            self.o_proj = attn.o_proj.weight


class PackedBackbone:
    """The text model of a loaded `Qwen3_5ForConditionalGeneration`, run packed."""

    def __init__(self, model, kernels: K.Kernels | None = None):
        text = model.model.language_model
        self.config = text.config
        self.eps = self.config.rms_norm_eps
        self.embed = text.embed_tokens.weight
        self.rotary = text.rotary_emb
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        with torch.no_grad():  # not inference_mode: the fused weights must stay usable by plain transformers calls
            self.layers = [FastLayer(layer, self.config) for layer in text.layers[: self.config.num_hidden_layers]]
            self.final_norm = (1.0 + text.norm.weight.detach().float()).contiguous()
        self.kernels = kernels or self.select_kernels()

    def select_kernels(self) -> K.Kernels:
        """The fastest kernels that work for this backbone here (kernels.select_kernels)."""
        return K.select_kernels(self.device, self.dtype, heads=self.config.num_attention_heads,
                                kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim,
                                value_head_dim=self.config.linear_value_head_dim)

    # ---- the projections and the kernels that produce their inputs ---------------------------------------------
    # (the FP8 experiment, bench/lengths_and_precision.py, overrides `_norm` and `_project` of a loaded backbone)

    def _norm(self, branch: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
        """Residual add + RMSNorm; the normed output is the next projection's input."""
        return self.kernels.rms_norm(branch, weight, self.eps, residual, self.dtype)

    def _project(self, x, weight) -> torch.Tensor:
        """A projection whose output stays in the layer (q/k/v and gate, Gated DeltaNet in_proj, MLP gate/up)."""
        return F.linear(x, weight)

    def _project_residual(self, x, weight) -> torch.Tensor:
        """A projection whose output joins the residual stream (o_proj, Gated DeltaNet out_proj, MLP down)."""
        return self.kernels.residual_projection(x, weight)

    # ---- one forward --------------------------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = positions.view(1, 1, -1).expand(3, 1, -1)  # text: the three M-RoPE axes are equal
        cos, sin = self.rotary(like, position_ids)
        return cos[0], sin[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, segments: Segments, *,
                prefixes: Sequence[list[LayerState]] | None = None, split_at: int | None = None,
                between_layers=None) -> tuple[torch.Tensor, list[LayerState] | None]:
        """Final hidden states [N, hidden] of the packed tokens (after the final norm).

        `between_layers(index)`, if given, is called after each layer is launched (the engine lets waiting
        interactive requests run there, in the middle of a long bulk batch).
        `prefixes`: per record of the pack, the layer states of the cached tokens it continues after (a sweep's
        variants share one state, a re-run's records each have their own; `segments.positions` go on from them).
        `split_at` (one record only, no prefix): also return each layer's state after the first `split_at` tokens,
        for the state cache; the hidden states are those of the plain forward."""
        collect = split_at is not None
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(segments.positions, x)
        states: list[LayerState] | None = [] if collect else None

        def mix(index: int, layer: FastLayer, normed: torch.Tensor) -> torch.Tensor:
            before = [layers[index] for layers in prefixes] if prefixes is not None else None
            if layer.kind == "linear_attention":
                branch, at = self.gated_delta_net(layer, normed, segments, before, [split_at] if collect else [])
                state = at[0] if at else None
            else:
                branch, state = self.attention(layer, normed, cos, sin, segments, before, split_at)
            if states is not None:
                states.append(state)
            return branch

        return self._layers(x, mix, between_layers), states

    def _layers(self, x: torch.Tensor, mix, between_layers=None) -> torch.Tensor:
        """Every decoder layer over the embedded tokens `x`, `mix(index, layer, normed)` giving the token mixer's
        output (attention or Gated DeltaNet); the final hidden states, normed."""
        residual = None  # the norms return the residual stream in float32, whatever the model's dtype
        branch = x
        for index, layer in enumerate(self.layers):
            normed, residual = self._norm(branch, layer.norm1, residual)
            branch = mix(index, layer, normed)
            normed, residual = self._norm(branch, layer.norm2, residual)
            gate_up = self._project(normed, layer.gate_up)
            branch = self._project_residual(self.kernels.silu_mul(gate_up, layer.intermediate), layer.down)
            if between_layers is not None:
                between_layers(index)
        hidden, _ = self.kernels.rms_norm(branch, self.final_norm, self.eps, residual, self.dtype)
        return hidden

    @torch.inference_mode()
    def forward_chunked(self, input_ids: torch.Tensor, chunk_tokens: int, on_chunk, *, split_at: int | None = None,
                        splits: Sequence[int] = (), on_split=None, between_layers=None) -> list[LayerState] | None:
        """One record in chunks of at most `chunk_tokens` tokens, each chunk through every layer before the next,
        so that the activations are one chunk's whatever the record's length. Each layer carries what the next
        chunk needs: attention writes its K/V into one buffer of the record's length (no copies as it grows) and a
        chunk's queries attend to every earlier key and to their own chunk's causally; the conv and the gated-delta
        recurrence continue from the previous chunk's last inputs and final state, as after a cached state.
        `on_chunk(start, hidden)` receives each chunk's final hidden states, in order. With `split_at`, every
        layer's state at that point is returned, its K/V as views of the buffers (no copy); the chunk it falls in
        runs whole, its recurrence in two calls: a chunk ending there would be a forward of a few tokens, its
        attention a cuDNN shape of its own (the Clef-Flash 16k user path, docs/performance.md). With `splits`, a
        chunk ends at each and `on_split(end, states)` receives those states there, before the next chunk runs
        (what Why's variants continue from, explain.py)."""
        n = input_ids.shape[0]
        cuts = {*splits, *([split_at] if split_at is not None else [])}
        if not all(0 < cut <= n for cut in cuts):
            raise ValueError(f"splits {sorted(cuts)} must lie within the record of {n} tokens")
        carried: list[LayerState | None] = [None] * len(self.layers)
        buffers = {index: tuple(torch.empty(n, layer.kv_heads, layer.head_dim, device=self.device, dtype=self.dtype)
                                for _ in range(2))
                   for index, layer in enumerate(self.layers) if layer.kind != "linear_attention"}

        def states_at(point: int, recurrent: Sequence[LayerState | None]) -> list[LayerState]:
            """Every layer's state after `point` tokens: K/V views of the buffers, the recurrence's as given."""
            return [LayerState(keys=buffers[i][0][:point], values=buffers[i][1][:point]) if i in buffers
                    else recurrent[i] for i in range(len(self.layers))]

        at_split = None
        for start, end in chunk_bounds(n, chunk_tokens, splits):
            inside = split_at - start if split_at is not None and start < split_at <= end else None
            hidden, recurrent = self._forward_chunk(input_ids[start:end], start, carried, buffers, between_layers,
                                                    inside)
            on_chunk(start, hidden)
            if inside is not None:
                at_split = states_at(split_at, [recurrent.get(i) for i in range(len(self.layers))])
            if end in splits:
                on_split(end, states_at(end, carried))
        return at_split

    def _forward_chunk(self, chunk_ids: torch.Tensor, start: int, carried: list[LayerState | None],
                       buffers: dict[int, tuple[torch.Tensor, torch.Tensor]], between_layers,
                       split: int | None = None) -> tuple[torch.Tensor, dict[int, LayerState]]:
        """One chunk of `forward_chunked` (tokens from `start` on) through every layer; `carried` takes each Gated
        DeltaNet layer's state at the chunk's end, for the next chunk. Returns the final hidden states and, with
        `split` (counted within the chunk), each Gated DeltaNet layer's state after that many of its tokens."""
        n = chunk_ids.shape[0]
        segments = make_segments([n], self.device, first_position=start)
        x = F.embedding(chunk_ids, self.embed)
        cos, sin = self.rope(segments.positions, x)
        at_split: dict[int, LayerState] = {}
        ends = sorted({n, *([split] if split is not None else [])})

        def mix(index: int, layer: FastLayer, normed: torch.Tensor) -> torch.Tensor:
            if layer.kind == "linear_attention":
                before = carried[index]
                branch, states = self.gated_delta_net(layer, normed, segments, None if before is None else [before],
                                                      ends)
                carried[index] = states[-1]
                if split is not None:
                    at_split[index] = states[0]
                return branch
            return self.attention_chunk(layer, normed, cos, sin, segments, buffers[index], start)

        return self._layers(x, mix, between_layers), at_split

    def gated_delta_net(self, layer: FastLayer, x: torch.Tensor, segments: Segments, before: list[LayerState] | None,
                        splits: Sequence[int] = ()) -> tuple[torch.Tensor, list[LayerState]]:
        """The Gated DeltaNet token mixer over the pack; with `splits` (one record only: sorted, within it), also
        the layer's state after each so many tokens: the recurrence runs in a call per piece, each starting from
        the previous one's final state."""
        n = x.shape[0]
        kern = self.kernels
        projected = self._project(x, layer.in_proj)
        conv_dim, value_dim, v_heads = layer.conv_dim, layer.value_dim, layer.v_heads
        mixed = projected[:, :conv_dim]
        z = projected[:, conv_dim: conv_dim + value_dim]
        b = projected[:, conv_dim + value_dim: conv_dim + value_dim + v_heads]
        a = projected[:, conv_dim + value_dim + v_heads:]
        key_dim = layer.key_dim
        if before is None:
            q, k, v = kern.causal_conv(mixed, layer.conv_weight, segments, key_dim)
        elif segments.count == 1:
            q, k, v = kern.causal_conv_after(mixed, layer.conv_weight, before[0].conv_tail, segments, key_dim)
        else:  # records continuing after cached states: each behind its state's conv tail, one pack of the plain conv
            tails, rows = segments.behind(layer.conv_width - 1)
            pieces = [piece for state, start, length in zip(before, segments.starts, segments.lengths)
                      for piece in (state.conv_tail.to(mixed.dtype), mixed[start: start + length])]
            q, k, v = (part.index_select(0, rows) for part in
                       kern.causal_conv(torch.cat(pieces), layer.conv_weight, tails, key_dim))
        q = q.view(n, layer.k_heads, layer.k_head_dim)
        k = k.view(n, layer.k_heads, layer.k_head_dim)
        v = v.view(n, v_heads, layer.v_head_dim)
        # after cached states: each record of the pack starts from its state's recurrent state
        state = torch.cat([s.recurrent for s in before]) if before is not None else None
        ends = sorted({*splits, n})
        finals: dict[int, torch.Tensor] = {}
        cores = []
        for start, end in zip([0, *ends[:-1]], ends):
            part = segments if len(ends) == 1 else segments.piece(start, end)
            core, state = kern.gated_delta(q[start:end], k[start:end], v[start:end], a[start:end], b[start:end],
                                           layer.A_log, layer.dt_bias, part, initial_state=state,
                                           output_final_state=bool(splits))
            finals[end] = state
            cores.append(core)
        core = kern.gated_rms_norm(torch.cat(cores) if len(cores) > 1 else cores[0], z, layer.gated_norm,
                                   layer.gated_norm_eps)
        out = self._project_residual(core.view(n, value_dim), layer.out_proj)
        states = []
        width = layer.conv_width - 1
        for split in splits:
            tail = mixed[max(0, split - width): split]
            if tail.shape[0] < width:  # fewer inputs than the conv reads: the earlier ones come from before
                earlier = (before[0].conv_tail.to(tail.dtype) if before is not None
                           else tail.new_zeros(width, tail.shape[1]))
                tail = torch.cat([earlier, tail])[-width:]
            states.append(LayerState(conv_tail=tail.contiguous(), recurrent=finals[split]))
        return out, states

    def _queries_keys_values(self, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v, gate) of an attention layer: q and k normed and rotated, v and the output gate views."""
        n, heads, kv_heads, dim = x.shape[0], layer.heads, layer.kv_heads, layer.head_dim
        projected = self._project(x, layer.qkv)
        # per head the projection holds [query | gate] (2 * dim), then all K heads, then all V heads
        q = self.kernels.norm_rope(projected, 0, 2 * dim, heads, dim, layer.q_norm, cos, sin, self.eps)
        k = self.kernels.norm_rope(projected, heads * dim * 2, dim, kv_heads, dim, layer.k_norm, cos, sin, self.eps)
        v = projected[:, heads * dim * 2 + kv_heads * dim:].view(n, kv_heads, dim)
        return q, k, v, projected[:, : heads * dim * 2].view(n, heads, 2 * dim)[..., dim:]

    def attention(self, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  segments: Segments, before: list[LayerState] | None,
                  split_at: int | None) -> tuple[torch.Tensor, LayerState | None]:
        n = x.shape[0]
        kern = self.kernels
        q, k, v, gate = self._queries_keys_values(layer, x, cos, sin)
        if before is not None and segments.count == 1:  # one record after its cached keys
            out = kern.attention_after_prefix(q, torch.cat([before[0].keys, k]), torch.cat([before[0].values, v]),
                                              before[0].keys.shape[0])
        elif before is not None:  # each record of the pack after its state's cached keys
            out = kern.attention_after_prefixes(q, k, v, [state.keys for state in before],
                                                [state.values for state in before], segments)
        else:
            out = kern.attention(q, k, v, segments)
        out = kern.sigmoid_gate(out.reshape(n, layer.heads, layer.head_dim), gate)
        state = None
        if split_at is not None:  # (never after a prefix) copies: views would keep the whole projection alive
            state = LayerState(keys=k[:split_at].clone(), values=v[:split_at].clone())
        return self._project_residual(out, layer.o_proj), state

    def attention_chunk(self, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        segments: Segments, buffers: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        """One chunk of a long record (tokens from `start` on): its K/V written into the record's buffers, its
        queries attending to the keys before it and to its own causally (the first chunk: a record's own causal
        attention, the kernel of whole records)."""
        n = x.shape[0]
        kern = self.kernels
        q, k, v, gate = self._queries_keys_values(layer, x, cos, sin)
        keys, values = buffers
        end = start + n
        keys[start:end], values[start:end] = k, v
        if start == 0:
            out = kern.attention(q, keys[:end], values[:end], segments)
        else:
            out = kern.attention_chunk(q, keys[:end], values[:end], start)
        out = kern.sigmoid_gate(out.reshape(n, layer.heads, layer.head_dim), gate)
        return self._project_residual(out, layer.o_proj)


SHORT_LAST_CHUNK = 8  # a last chunk shorter than 1/8 of a chunk joins the chunk before it (see chunk_bounds)


def chunk_bounds(n: int, chunk_tokens: int, splits: Iterable[int] = ()) -> list[tuple[int, int]]:
    """(start, end) of the chunks of a record of `n` tokens: at multiples of `chunk_tokens` (0: none; so that most
    chunks share one shape), except that a last chunk shorter than 1/`SHORT_LAST_CHUNK` of one joins the chunk
    before it: a short chunk's forward waits on its launches of every layer's kernels, not on the GPU (Clef-Flash
    records a little over 16,384 tokens, `over_a_chunk` in bench/results/2026-12-05-h200-over-a-chunk.json); and
    at each of `splits`."""
    cuts = list(range(chunk_tokens, n, chunk_tokens)) if chunk_tokens else []
    if cuts and n - cuts[-1] < chunk_tokens // SHORT_LAST_CHUNK:
        cuts.pop()
    cuts = sorted({*cuts, *splits, n})
    return list(zip([0] + cuts[:-1], cuts))


def runs_in_chunks(n: int, chunk_tokens: int) -> bool:
    """Whether a record of `n` tokens runs in chunks of `chunk_tokens` (0: never)."""
    return len(chunk_bounds(n, chunk_tokens)) > 1


def longest_chunk(chunk_tokens: int) -> int:
    """The most tokens one chunk of `chunk_tokens` runs: what the activations and cuDNN's plans are sized for."""
    return chunk_tokens + max(chunk_tokens // SHORT_LAST_CHUNK - 1, 0)


def chunked_head_inputs(backbone: PackedBackbone, input_ids: torch.Tensor, token_memory, dtype: torch.dtype,
                        chunk_tokens: int, *, split_at: int | None = None, splits: Sequence[int] = (), on_split=None,
                        between_layers=None) -> tuple[torch.Tensor, torch.Tensor, list[LayerState] | None]:
    """The head's inputs (normed hidden states, memory) of one record run in chunks (`forward_chunked`), each
    chunk's taken by `token_memory` (the head's, row by row) as soon as it is done: the record's final hidden
    states are never whole. Also the layer states at `split_at`, if asked; and at each of `splits`,
    `on_split(end, states, memory)` with the memory of the tokens before `end`."""
    n = input_ids.shape[0]
    normed = memory = None

    def take(start: int, hidden: torch.Tensor) -> None:
        nonlocal normed, memory
        normed_chunk, memory_chunk = token_memory(hidden.to(dtype))
        if normed is None:
            normed = normed_chunk.new_empty(n, normed_chunk.shape[-1])
            memory = memory_chunk.new_empty(n, memory_chunk.shape[-1])
        normed[start: start + hidden.shape[0]] = normed_chunk
        memory[start: start + hidden.shape[0]] = memory_chunk

    states = backbone.forward_chunked(input_ids, chunk_tokens, take, split_at=split_at, splits=splits,
                                      on_split=lambda end, layers: on_split(end, layers, memory[:end]),
                                      between_layers=between_layers)
    return normed, memory, states


def pack_ids(records, device: torch.device) -> torch.Tensor:
    """The records' token ids concatenated, on `device` (one host-to-device copy)."""
    flat = [token for record in records for token in record.input_ids]
    return torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
