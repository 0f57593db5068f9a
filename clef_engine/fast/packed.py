"""Packed (varlen) prefill: records of different lengths in one token-major sequence, no padding.

Our own layer loop over the transformers modules' weights (their parameters, our forward): positions restart at
every record, and the short causal conv, the gated-delta recurrence and full attention each respect record
boundaries (`kernels.Segments`). Only the text model runs (no vocabulary logits). At load, the projections that read
the same input are concatenated into one weight each (GDN q/k/v/z/b/a, attention q+gate/k/v, MLP gate/up) and the
modules' parameters become views of it, so the plain transformers path still works and no memory is added.

The same loop continues one record after a cached prefix (`PrefixState`, see cache.py): attention reads the
cached K/V, the conv reads the cached last W-1 inputs, the recurrence starts from the cached state. And one forward
over a whole record can also return those states at a split point (`split_at`, the end of the record's state), so
storing a long state costs no second pass. CUDA graphs of this forward live in graphs.py.

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
                prefix_length: int = 0, split_at: int | None = None,
                between_layers=None) -> tuple[torch.Tensor, list[LayerState] | None]:
        """Final hidden states [N, hidden] of the packed tokens (after the final norm).

        `between_layers(index)`, if given, is called after each layer is launched (the engine lets waiting
        interactive requests run there, in the middle of a long bulk batch).
        `prefix` (one record only): continue after `prefix_length` cached tokens. `split_at` (one record only, no
        prefix): also return each layer's state after the first `split_at` tokens, for the state cache; the hidden
        states are those of the plain forward."""
        if (prefix is not None or split_at is not None) and segments.count != 1:
            raise ValueError("prefix continuation and state collection work on one record at a time")
        if split_at is not None and (prefix is not None or not 0 < split_at <= input_ids.shape[0]):
            raise ValueError(f"split_at={split_at} must lie within the record and cannot follow a prefix")
        collect = split_at is not None
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(segments.positions, x)
        states: list[LayerState] | None = [] if collect else None
        residual = None  # kern.rms_norm returns the residual stream in float32, whatever the model's dtype
        branch = x
        kern = self.kernels
        for index, layer in enumerate(self.layers):
            normed, residual = kern.rms_norm(branch, layer.norm1, self.eps, residual, self.dtype)
            before = prefix[index] if prefix is not None else None
            if layer.kind == "linear_attention":
                branch, state = self.gated_delta_net(layer, normed, segments, before, split_at)
            else:
                branch, state = self.attention(layer, normed, cos, sin, segments, before, prefix_length, split_at)
            if states is not None:
                states.append(state)
            normed, residual = kern.rms_norm(branch, layer.norm2, self.eps, residual, self.dtype)
            activated = kern.silu_mul(F.linear(normed, layer.gate_up), layer.intermediate)
            branch = kern.residual_projection(activated, layer.down)
            if between_layers is not None:
                between_layers(index)
        hidden, _ = kern.rms_norm(branch, self.final_norm, self.eps, residual, self.dtype)
        return hidden, states

    def gated_delta_net(self, layer: FastLayer, x: torch.Tensor, segments: K.Segments, before: LayerState | None,
                        split_at: int | None) -> tuple[torch.Tensor, LayerState | None]:
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
        state = None
        if split_at is None or split_at == n:
            core, final = kern.gated_delta(q, k, v, a, b, layer.A_log, layer.dt_bias, segments, initial_state=initial,
                                           output_final_state=split_at is not None)
        else:  # the recurrence in two calls, the second starting from the first's final state: the state at the split
            head_part = K.make_segments([split_at], x.device)
            tail_part = K.make_segments([n - split_at], x.device, first_position=split_at)
            first, final = kern.gated_delta(q[:split_at], k[:split_at], v[:split_at], a[:split_at], b[:split_at],
                                            layer.A_log, layer.dt_bias, head_part, output_final_state=True)
            second, _ = kern.gated_delta(q[split_at:], k[split_at:], v[split_at:], a[split_at:], b[split_at:],
                                         layer.A_log, layer.dt_bias, tail_part, initial_state=final)
            core = torch.cat([first, second])
        core = kern.gated_rms_norm(core, z, layer.gated_norm, layer.gated_norm_eps)
        out = kern.residual_projection(core.view(n, value_dim), layer.out_proj)
        if split_at is not None:
            width = layer.conv_width - 1
            tail = mixed[max(0, split_at - width): split_at]
            if tail.shape[0] < width:
                tail = torch.cat([tail.new_zeros(width - tail.shape[0], tail.shape[1]), tail])
            state = LayerState(conv_tail=tail.contiguous(), recurrent=final)
        return out, state

    def attention(self, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  segments: K.Segments, before: LayerState | None, prefix_length: int,
                  split_at: int | None) -> tuple[torch.Tensor, LayerState | None]:
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
        state = None
        if split_at is not None:  # copies: the views would keep the whole record's projection alive
            state = LayerState(keys=keys[:split_at].clone(), values=values[:split_at].clone())
        return kern.residual_projection(out, layer.o_proj), state


def pack_ids(records, device: torch.device) -> torch.Tensor:
    """The records' token ids concatenated, on `device` (one host-to-device copy)."""
    flat = [token for record in records for token in record.input_ids]
    return torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
