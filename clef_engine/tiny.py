"""Write a tiny Clef-format release: every file of the real one, random weights, tiny sizes.

The real release was saved by transformers, so we build the same objects (the real model class with a tiny config,
the real processor classes with the real processor settings, a byte-level BPE tokenizer with the Qwen3.5
pre-tokenizer and every special token of spec §1) and save them the same way. Code that loads the real release loads
this one unchanged. It keeps both layer types (3 Gated DeltaNet + 1 full attention) and a real vision tower, so
text, image and video records all run on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import environment
from .model.encoding import PREFIX, QWEN35_PRETOKENIZE, SUFFIX
from .model.head import JointSchemaHead
from .model.release import HEAD_CONFIG, HEAD_WEIGHTS, HeadConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
TINY_VOCAB = 1024
# Sizes of the tiny release (`--size`): two models of different sizes in one process is what tests of several
# resident models need; "tiny" is the default and the demo model.
SIZES = {"tiny": dict(hidden=64, ffn=128, layers=4), "small": dict(hidden=96, ffn=256, layers=8)}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Real Qwen3.5 processor settings (processor_config.json of the release): these decide how many tokens media cost,
# so the tiny release keeps them.
IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                       image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 65536, "longest_edge": 16777216})
VIDEO_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                       image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 4096, "longest_edge": 25165824},
                       fps=2, min_frames=4, max_frames=768, do_sample_frames=True)


def training_text() -> list[str]:
    """Text the tiny tokenizer learns merges from: the prompt scaffolding plus ordinary English and JSON."""
    words = ("the invoice ticket customer payment refund amount total due date vendor alert security login "
             "password damage claim photo car vehicle image video true false yes no unknown none other priority "
             "high medium low critical billing technical account shipping delivery order status approved rejected "
             "description option_id proposition answer field question score level choice noul state schema")
    return [PREFIX, SUFFIX, "\n\nSCHEMA FIELDS:\n\nFIELD 1\nID: q\nTYPE: choice\nINSTRUCTION: \nALLOWED OPTIONS:\n"
            "OPTION 1: \nEND FIELD\n", '{"description":"The proposition is true or the answer is yes.",'
            '"option_id":"true"}', words, words.title(), '{"amount":1250.5,"currency":"EUR","items":[1,2,3]}',
            "0123456789 .,;:!?-_/()[]{}\"'"]


def build_tokenizer() -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(training_text() * 4, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, model_max_length=262144, clean_up_tokenization_spaces=False)


def tiny_config(tokenizer: Any, size: str = "tiny") -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = math.ceil(len(tokenizer) / 64) * 64
    shape = SIZES[size]
    text = dict(
        model_type="qwen3_5_text", vocab_size=vocab_size, hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (shape["layers"] // 4),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], dtype="bfloat16",
    )
    vision = dict(model_type="qwen3_5_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=shape["hidden"],
                  num_position_embeddings=256, hidden_act="gelu_pytorch_tanh", in_channels=3)
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
        vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, dtype="bfloat16",
        random_weights=True,  # read by the loader (Release.random_weights): every page showing answers says so
    )


def randomize_head(head: JointSchemaHead, generator: torch.Generator) -> None:
    """Random, not zero: LayerNorm gains near 1 with noise, biases small, projections scaled for unit outputs."""
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.ndim == 0:
                continue
            if name.endswith("weight") and ("norm" in name):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("bias"):
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
            else:
                fan_in = parameter.shape[-1]
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))
        head.residual_gate.fill_(0.5)


def build_head_files(directory: Path, config: HeadConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed + 1)
    head = JointSchemaHead(config)
    randomize_head(head, generator)
    state = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(directory / HEAD_WEIGHTS), metadata={"format": "pt"})
    (directory / HEAD_CONFIG).write_text(json.dumps(asdict(config), indent=2) + "\n")


def build_tiny_release(directory: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write the tiny release to `directory` (created if needed) and return its path. `size`: a key of SIZES."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config_dict = tiny_config(tokenizer, size)
    config = Qwen3_5Config(**config_dict)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():  # transformers zero-inits some tensors (biases, norms); random everywhere is a fairer test
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
            elif parameter.abs().sum() == 0:
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory, max_shard_size="400KB")

    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PROCESSOR),
        video_processor=Qwen3VLVideoProcessor(**VIDEO_PROCESSOR),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    build_head_files(directory, HeadConfig(hidden_size=SIZES[size]["hidden"], width=32, routing_layers=2, layers=2,
                                           heads=4, feedforward=64), seed)
    (directory / "joint_schema_model.py").write_text(
        '"""Placeholder for the release\'s reference code; the tiny release is built by clef_engine.tiny."""\n')
    (directory / "README.md").write_text(
        "# Tiny Clef-format release\n\nRandom weights, tiny sizes, every file of a real Clef release. Built by "
        f"`python -m clef_engine tiny` (seed {seed}, size {size}). Its answers mean nothing.\n")
    (directory / "LICENSE").write_text("Apache-2.0\n")
    return directory


# ---- the demo model ---------------------------------------------------------------------------------------------

DEMO_MARKER = ".clef-demo-release"


def demo_release(directory: str | os.PathLike | None = None) -> Path:
    """The tiny random-weight release, built once into a cache folder (CLEF_CACHE_DIR or ~/.cache/clef-workbench)."""
    root = Path(directory) if directory else environment.cache_dir()
    # Keyed by the builder's source, so a changed builder never reuses a release an older one wrote.
    here = Path(__file__).parent
    builder = (here / "tiny.py").read_bytes() + (here / "model" / "head.py").read_bytes()
    target = root / f"demo-release-{hashlib.sha256(builder).hexdigest()[:12]}"
    if (target / DEMO_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".demo-release-{os.getpid()}-{threading.get_ident()}"
    build_tiny_release(staging)
    (staging / DEMO_MARKER).write_text("random weights: answers mean nothing\n")
    try:
        staging.rename(target)  # atomic: concurrent builders race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_demo_release(path: Path) -> bool:
    return (Path(path) / DEMO_MARKER).exists()
