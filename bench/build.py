"""Build Clef-shaped models with random bf16 weights directly on the GPU (spec §1 sizes), for benchmarks.

Token ids come from the tiny release's tokenizer (a byte-level BPE with every special token of §1), so requests
encode through the engine's real Encoder; the big vocabulary simply has unused rows.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clef_engine.model.release import HeadConfig  # noqa: E402

SIZES = {
    "clef": dict(hidden=5120, ffn=17408, layers=64, heads=24, kv_heads=4, gdn_k=16, gdn_v=48, vision_out=5120),
    "clef-flash": dict(hidden=4096, ffn=12288, layers=32, heads=16, kv_heads=4, gdn_k=16, gdn_v=32, vision_out=4096),
}
VOCAB = 248_320


def clef_config(name: str, tiny_release: Path) -> dict:
    """config.json of a Clef / Clef-Flash shaped release, special-token ids taken from the tiny release."""
    import json

    tiny = json.loads((tiny_release / "config.json").read_text())
    s = SIZES[name]
    text = dict(tiny["text_config"])
    text.update(
        vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (s["layers"] // 4),
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=s["gdn_k"], linear_num_value_heads=s["gdn_v"], max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    vision = dict(tiny["vision_config"])
    vision.update(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=s["vision_out"],
                  num_position_embeddings=2304)
    config = dict(tiny)
    config.update(text_config=text, vision_config=vision)
    return config


def scale_down(config: dict) -> None:
    """A scaled-down copy of the architecture in place, so a bench script runs whole on a CPU (BENCH_CPU_SMOKE)."""
    t = config["text_config"]
    t.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, layer_types=t["layer_types"][:4],
             num_attention_heads=4, head_dim=64, vocab_size=2048, linear_num_value_heads=32,
             linear_key_head_dim=32, linear_value_head_dim=32)
    config["vision_config"].update(depth=1, out_hidden_size=256)


@torch.no_grad()
def randomize_backbone(model, seed: int = 0) -> None:
    """Random everywhere (never zeros): matrices N(0, 0.02); zero-centred RMSNorm gains ±0.1; the gated norm's gain
    1 ± 0.1; GDN decay parameters as transformers initializes them."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1, 16, generator=generator).log())
        elif name.endswith("dt_bias"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif "linear_attn.norm" in name or ("visual" in name and "norm" in name and name.endswith("weight")):
            p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif "norm" in name:
            p.copy_(0.1 * torch.randn(p.shape, device=p.device, generator=generator))
        elif p.ndim == 1:  # biases (vision tower)
            p.copy_(0.02 * torch.randn(p.shape, device=p.device, generator=generator))
        else:
            p.normal_(0, 0.02, generator=generator)


def build_model(config: dict, device: str = "cuda", seed: int = 0):
    """Qwen3_5ForConditionalGeneration with random bf16 weights allocated on `device` (no fp32 copy)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config))
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    randomize_backbone(model, seed)
    return model.eval().requires_grad_(False)


def build_head(hidden: int, device: str = "cuda", seed: int = 1, *, width: int = 1024):
    from clef_engine.model.head import JointSchemaHead
    from clef_engine.tiny import randomize_head

    config = HeadConfig(hidden_size=hidden, width=width, routing_layers=2, layers=4, heads=16, feedforward=4096)
    head = JointSchemaHead(config)
    randomize_head(head, torch.Generator().manual_seed(seed))
    return head.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False), config


def random_engine(config: dict, tiny_release: Path, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                  head_width: int = 1024):
    """A clef_engine.Engine over a random model of `config` built in place (no weights on disk), with the tiny
    release's tokenizer and processor."""
    import clef_engine
    from clef_engine.model.encoding import Encoder
    from clef_engine.model.release import Release, load_processor

    model = build_model(config, device=device)
    head, head_config = build_head(config["text_config"]["hidden_size"], device=device, width=head_width)
    if dtype != torch.bfloat16:
        model, head = model.to(dtype), head.to(dtype)
    checked = Release(path=tiny_release, source="clef-27b-shaped-random", revision=None, config=config,
                      head_config=head_config, weight_files=())
    return clef_engine.Engine(checked, model, head, Encoder(load_processor(checked)), torch.device(device), dtype)


def parameter_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def floor_ms(tokens: int, tokens_per_s: float = 15_800) -> float:
    return round(1000 * tokens / tokens_per_s, 1)


__all__ = ["clef_config", "scale_down", "build_model", "build_head", "random_engine", "parameter_count", "gib",
           "floor_ms", "math"]
