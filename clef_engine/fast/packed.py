"""Packed (varlen) prefill: records of different lengths in one token-major sequence, no padding.

Our own layer loop over the transformers modules' weights (their parameters, our forward): positions restart at
every record, and the short causal conv, the gated-delta recurrence and full attention each respect record
boundaries (`kernels.Segments`). Only the text model runs (no vocabulary logits). At load, the projections that read
the same input are concatenated into one weight each (GDN q/k/v/z/b/a, attention q+gate/k/v, MLP gate/up) and the
modules' parameters become views of it, so the plain transformers path still works and no memory is added.

The same loop continues one record after a cached prefix (`PrefixState`, see cache.py): attention reads the
cached K/V, the conv reads the cached last W-1 inputs, the recurrence starts from the cached state.
`GraphedPrefill` replays both, for one record of up to 4,096 new tokens, from CUDA graphs.

Media records are not handled here (the engine sends them to the padded multimodal path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels as K


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


class FastBackbone:
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
        self.kernels = kernels or K.select_kernels(self.device, self.dtype, heads=self.config.num_attention_heads,
                                                   kv_heads=self.config.num_key_value_heads,
                                                   head_dim=self.config.head_dim,
                                                   value_head_dim=self.config.linear_value_head_dim)

    # ---- one forward --------------------------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = positions.view(1, 1, -1).expand(3, 1, -1)  # text: the three M-RoPE axes are equal
        cos, sin = self.rotary(like, position_ids)
        return cos[0], sin[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, segments: K.Segments, *, prefix: list[LayerState] | None = None,
                prefix_length: int = 0, collect: bool = False) -> tuple[torch.Tensor, list[LayerState] | None]:
        """Final hidden states [N, hidden] of the packed tokens (after the final norm).

        `prefix` (one record only): continue after `prefix_length` cached tokens. `collect` (one record only):
        also return each layer's state at the end of the record, for the state cache."""
        if (prefix is not None or collect) and segments.count != 1:
            raise ValueError("prefix continuation and state collection work on one record at a time")
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(segments.positions, x)
        states: list[LayerState] | None = [] if collect else None
        residual = None
        branch = x
        kern = self.kernels
        for index, layer in enumerate(self.layers):
            normed, residual = kern.rms_norm(branch, layer.norm1, self.eps, residual)
            before = prefix[index] if prefix is not None else None
            if layer.kind == "linear_attention":
                branch, state = self.gated_delta_net(layer, normed, segments, before, collect)
            else:
                branch, state = self.attention(layer, normed, cos, sin, segments, before, prefix_length, collect)
            if states is not None:
                states.append(state)
            normed, residual = kern.rms_norm(branch, layer.norm2, self.eps, residual)
            branch = F.linear(kern.silu_mul(F.linear(normed, layer.gate_up), layer.intermediate), layer.down)
        hidden, _ = kern.rms_norm(branch, self.final_norm, self.eps, residual)
        return hidden, states

    def gated_delta_net(self, layer: FastLayer, x: torch.Tensor, segments: K.Segments, before: LayerState | None,
                        collect: bool) -> tuple[torch.Tensor, LayerState | None]:
        n = x.shape[0]
        kern = self.kernels
        projected = F.linear(x, layer.in_proj)
        conv_dim, value_dim, v_heads = layer.conv_dim, layer.value_dim, layer.v_heads
        mixed = projected[:, :conv_dim]
        z = projected[:, conv_dim: conv_dim + value_dim]
        b = projected[:, conv_dim + value_dim: conv_dim + value_dim + v_heads]
        a = projected[:, conv_dim + value_dim + v_heads:]
        key_dim = layer.key_dim
        if before is not None:
            q, k, v = K.split_qkv(K.causal_conv_after(mixed, layer.conv_weight, before.conv_tail), key_dim)
        else:
            q, k, v = kern.causal_conv(mixed, layer.conv_weight, segments, key_dim)
        q = q.view(n, layer.k_heads, layer.k_head_dim)
        k = k.view(n, layer.k_heads, layer.k_head_dim)
        v = v.view(n, v_heads, layer.v_head_dim)
        initial = before.recurrent if before is not None else None
        core, final = kern.gated_delta(q, k, v, a, b, layer.A_log, layer.dt_bias, segments, initial_state=initial,
                                       output_final_state=collect)
        core = kern.gated_rms_norm(core, z, layer.gated_norm, layer.gated_norm_eps)
        out = F.linear(core.view(n, value_dim), layer.out_proj)
        state = None
        if collect:
            width = layer.conv_width - 1
            history = mixed if before is None else torch.cat([before.conv_tail.to(mixed.dtype), mixed])
            tail = history[-width:]
            if tail.shape[0] < width:
                tail = torch.cat([tail.new_zeros(width - tail.shape[0], tail.shape[1]), tail])
            state = LayerState(conv_tail=tail.contiguous(), recurrent=final)
        return out, state

    def attention(self, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  segments: K.Segments, before: LayerState | None, prefix_length: int,
                  collect: bool) -> tuple[torch.Tensor, LayerState | None]:
        n = x.shape[0]
        kern = self.kernels
        heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
        projected = F.linear(x, layer.qkv)
        # per head the projection holds [query | gate] (2 * dim), then all K heads, then all V heads
        q = kern.norm_rope(projected, 0, 2 * dim, heads, dim, layer.q_norm, cos, sin, self.eps)
        k = kern.norm_rope(projected, heads * dim * 2, dim, kv_heads, dim, layer.k_norm, cos, sin, self.eps)
        v = projected[:, heads * dim * 2 + kv_heads * dim:].view(n, kv_heads, dim)
        gate = projected[:, : heads * dim * 2].view(n, heads, 2 * dim)[..., dim:]
        if before is not None:
            keys, values = torch.cat([before.keys, k]), torch.cat([before.values, v])
            out = kern.attention_after_prefix(q, keys, values, prefix_length)
        else:
            keys, values = k, v
            out = kern.attention(q, k, v, segments)
        out = kern.sigmoid_gate(out.reshape(n, heads, dim), gate)
        state = LayerState(keys=keys.contiguous(), values=values.contiguous()) if collect else None
        return F.linear(out, layer.o_proj), state


def pack_ids(records, device: torch.device) -> torch.Tensor:
    """The records' token ids concatenated, on `device` (one host-to-device copy)."""
    flat = [token for record in records for token in record.input_ids]
    return torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)


class GraphedPrefill:
    """CUDA graphs for one record of up to `max_tokens` tokens: short records are bound by the CPU launching
    kernels, and a graph replays the whole 64-layer forward with one launch.

    The record is right-padded to a bucket length (multiples of 64 up to 1k tokens, 128 up to 2k, 256 beyond);
    padding after the last real token changes nothing before it (the backbone is causal). One graph per bucket,
    captured on first use, all sharing one memory pool (they never run at the same time: one GPU worker). If a
    capture fails, graphs are switched off and the reason kept (`disabled`); the eager path answers instead.
    """

    def __init__(self, fast: FastBackbone, max_tokens: int = 4096):
        self.fast = fast
        self.max_tokens = max_tokens
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self.disabled: str | None = None
        self.continuation_disabled: str | None = None
        self.captures = 0
        self.replays = 0
        self.continuation_replays = 0

    @staticmethod
    def bucket(n: int) -> int:
        step = 64 if n <= 1024 else 128 if n <= 2048 else 256
        return -(-n // step) * step

    def usable(self, n: int) -> bool:
        return self.disabled is None and n <= self.max_tokens

    def _capture(self, length: int, prefix=None) -> tuple:
        """Capture the forward of `length` tokens; with `prefix` (a cached PrefixState) the continuation after it."""
        device = self.fast.device
        first = prefix.length if prefix is not None else 0
        segments = K.make_segments([length], device, first_position=first)
        arguments = {"prefix": prefix.layers, "prefix_length": first} if prefix is not None else {}
        ids = torch.zeros(length, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # eager warm-up: compiles and autotunes every kernel for these shapes
            self.fast.forward(ids, segments, **arguments)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, _ = self.fast.forward(ids, segments, **arguments)
        self.pool = graph.pool()
        self.captures += 1
        return graph, ids, hidden, segments

    def _graph(self, store: dict, length: int, prefix=None) -> tuple | None:
        """The graph of `length` tokens in `store`, captured on first use. If a capture fails, that kind of graph
        (single records, or continuations after a prefix) is switched off for good with the reason kept, and the
        eager path answers instead."""
        entry = store.get(length)
        if entry is None:
            try:
                entry = store[length] = self._capture(length, prefix)
            except Exception as error:  # noqa: BLE001 — fall back to eager, and say why
                reason = f"{type(error).__name__}: {error}"[:500]
                if prefix is None:
                    self.disabled = reason
                else:
                    self.continuation_disabled = reason
                torch.cuda.synchronize()
        return entry

    def run(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [n, hidden] of one record (a view into the graph's output: read it before the next
        call), or None if graphs are off."""
        n = input_ids.shape[0]
        entry = self._graph(self.graphs, self.bucket(n))
        if entry is None:
            return None
        graph, ids, hidden, _ = entry
        ids[:n].copy_(input_ids)
        graph.replay()
        self.replays += 1
        return hidden[:n]

    def run_after_prefix(self, input_ids: torch.Tensor, prefix) -> torch.Tensor | None:
        """The continuation of one record after a cached prefix (`input_ids` already padded to a bucket length),
        replayed from a graph, or None if continuation graphs are off.

        Eagerly the continuation is bound by the host launching ~1,850 kernels (~150 ms of wall time for ~70 ms of
        GPU work on Clef-27B). A graph reads the prefix's cached tensors by address, so its graphs are kept on the
        cache entry (`prefix.graphs`, per bucket): they live and die with the tensors they read, and an entry moved
        to host memory and back starts without graphs."""
        if self.continuation_disabled is not None or input_ids.shape[0] > self.max_tokens:
            return None
        entry = self._graph(prefix.graphs, input_ids.shape[0], prefix)
        if entry is None:
            return None
        graph, ids, hidden, _ = entry
        ids.copy_(input_ids)
        graph.replay()
        self.continuation_replays += 1
        return hidden

    def describe(self) -> dict:
        return {"max_tokens": self.max_tokens, "buckets": sorted(self.graphs), "captures": self.captures,
                "replays": self.replays, "disabled": self.disabled,
                "continuation_replays": self.continuation_replays,
                "continuation_disabled": self.continuation_disabled}
