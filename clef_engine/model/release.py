"""Find and check a Clef release, then load its backbone, head and processor.

A release is a folder (or a Hugging Face repo resolved to one through huggingface_hub). We check the cheap facts
first — files, architecture, head width, shard index — so a wrong folder fails in milliseconds, not after minutes
of loading 55 GB of weights.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ReleaseError
from . import page_cache

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
# A config.json field a release with random weights (clef_engine.tiny) carries, so every loader can flag its answers.
RANDOM_WEIGHTS_FIELD = "random_weights"
REQUIRED_FILES = (
    "config.json",
    HEAD_WEIGHTS,
    HEAD_CONFIG,
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
)
KNOWN_MODELS = {"clef": "Cloudflare/clef", "clef-flash": "Cloudflare/clef-flash"}


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    width: int = 1024
    routing_layers: int = 2
    layers: int = 4
    heads: int = 16
    feedforward: int = 4096


@dataclass(frozen=True)
class Release:
    """A checked release folder and what we read from its small files."""

    path: Path
    source: str  # what the user asked for: a folder or a repo id
    revision: str | None
    config: dict
    head_config: HeadConfig
    weight_files: tuple[str, ...]

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", {})

    @property
    def random_weights(self) -> bool:
        """The release says its weights are random (a tiny test release): its answers mean nothing."""
        return self.config.get(RANDOM_WEIGHTS_FIELD) is True


def download_command(source: str, revision: str | None) -> str:
    """The command that downloads a hub release: the `hf` huggingface_hub installs beside this Python (the project's
    .venv/bin/hf), which need not be on PATH."""
    hf = Path(sys.executable).parent / "hf"
    return f"{hf} download {source}" + (f" --revision {revision}" if revision else "")


def local_release(source: str, revision: str | None = None) -> Path | None:
    """A local folder as is, a Hugging Face repo id from the local cache only (never a download); else None."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.startswith((".", "/", "~")) or source.count("/") != 1:  # not a repo id
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 — not cached (or no hub)
        return None


def resolve(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id, from the local cache first, then the Hub."""
    source = str(source)
    source = KNOWN_MODELS.get(source.lower(), source)
    found = local_release(source, revision)
    if found is not None:
        return found
    path = Path(source).expanduser()
    if path.exists():
        raise ReleaseError(f"{source} is a file; expected a release folder or a Hugging Face repo id")
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ReleaseError(f"release folder {path} does not exist (want a folder or a repo id, e.g. Cloudflare/clef)")

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        raise ReleaseError(
            f"{source}{'@' + revision if revision else ''} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set. Download it first on a machine with internet: "
            f"`{download_command(source, revision)}`, or pass the release folder."
        )
    try:
        return Path(snapshot_download(source, revision=revision))
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ReleaseError(
            f"could not get {source}{'@' + revision if revision else ''}: not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and the download failed ({type(error).__name__}: {error}). "
            f"Download it with `{download_command(source, revision)}` or pass the release folder."
        ) from error


def check(path: Path, *, source: str | None = None, revision: str | None = None) -> Release:
    """Check a release folder without loading weights. Raises ReleaseError saying what is wrong and where."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ReleaseError(f"{path} is not a complete Clef release: missing {', '.join(missing)}")
    config = _read_json(path / "config.json")
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ReleaseError(f"{path / 'config.json'}: architecture is {architectures}, expected {ARCHITECTURE}")
    head_json = _read_json(path / HEAD_CONFIG)
    known = set(HeadConfig.__dataclass_fields__)
    try:
        head_config = HeadConfig(**{k: v for k, v in head_json.items() if k in known})
    except TypeError as error:
        raise ReleaseError(f"{path / HEAD_CONFIG}: {error}") from error
    backbone_hidden = config.get("text_config", {}).get("hidden_size")
    if head_config.hidden_size != backbone_hidden:
        raise ReleaseError(
            f"{path / HEAD_CONFIG}: head hidden_size {head_config.hidden_size} != backbone hidden_size "
            f"{backbone_hidden} in config.json — head and backbone are from different releases"
        )
    return Release(path, str(source or path), revision, config, head_config, _weight_files(path))


def _weight_files(path: Path) -> tuple[str, ...]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = _read_json(index_file)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise ReleaseError(f"{index_file}: empty weight_map")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ReleaseError(f"{index_file} lists shards that are missing: {', '.join(missing)}")
        return tuple(shards)
    if (path / "model.safetensors").is_file():
        return ("model.safetensors",)
    raise ReleaseError(f"{path}: no model.safetensors.index.json and no model.safetensors")


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ReleaseError(f"{file}: cannot read JSON ({error})") from error


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError:  # torch's message lists its every backend; ours the two an engine runs on
        raise ReleaseError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N") from None


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ReleaseError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


# The functions transformers' Qwen3.5 Gated DeltaNet calls by module-level name, each bound at import to
# flash-linear-attention's (or causal-conv1d's) CUDA kernel whenever that package imports, to its own PyTorch version
# otherwise.
GATED_DELTANET_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                            "causal_conv1d_update")


def route_cpu_tensors_to_pytorch_functions() -> None:
    """On a GPU machine with flash-linear-attention installed, transformers runs the Gated DeltaNet's Triton kernels
    whatever device the tensors are on, so a model loaded on the CPU fails in its first linear-attention layer
    ("Pointer argument cannot be accessed from Triton (cpu tensor?)"). Send CPU tensors to transformers' own
    PyTorch functions (the `__wrapped__` of each binding) and leave CUDA tensors where they were going. Idempotent."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    for name in GATED_DELTANET_FUNCTIONS:
        bound = getattr(qwen, name, None)
        plain = getattr(bound, "__wrapped__", None)
        if plain is None or getattr(bound, "routes_cpu_tensors", False):
            continue
        accepted = set(inspect.signature(plain).parameters)

        def routed(*args: Any, _bound: Any = bound, _plain: Any = plain, _accepted: set[str] = accepted,
                   **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()))
            if first.is_cuda:
                return _bound(*args, **kwargs)
            return _plain(*args, **{key: value for key, value in kwargs.items() if key in _accepted})

        routed.routes_cpu_tensors = True  # type: ignore[attr-defined]
        routed.__wrapped__ = plain  # type: ignore[attr-defined]
        setattr(qwen, name, routed)


def load_backbone(release: Release, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The release's backbone through transformers' own class, in eval mode on `device`."""
    from transformers import Qwen3_5ForConditionalGeneration

    route_cpu_tensors_to_pytorch_functions()
    page_cache.read_in_background(release.path)  # already started by clef_engine.load for a folder
    model = Qwen3_5ForConditionalGeneration.from_pretrained(release.path, dtype=dtype, device_map=str(device))
    return model.eval().requires_grad_(False)


def load_head_state(release: Release) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(release.path / HEAD_WEIGHTS)


def load_processor(release: Release) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(release.path)


def describe(release: Release) -> dict:
    """What `python -m clef_engine info` prints: files, architecture, sizes, head config."""
    text = release.text_config
    vision = release.config.get("vision_config", {})
    files = sorted(p.name for p in release.path.iterdir() if p.is_file())
    return {
        "path": str(release.path),
        "source": release.source,
        "revision": release.revision,
        "files": files,
        "architecture": ARCHITECTURE,
        "dtype": release.config.get("dtype") or release.config.get("torch_dtype") or text.get("dtype"),
        "text": {k: text.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                          "linear_num_key_heads", "linear_num_value_heads")},
        "layer_types": dict(Counter(text.get("layer_types") or [])),
        "vision": {k: vision.get(k) for k in ("depth", "hidden_size", "patch_size", "spatial_merge_size",
                                              "temporal_patch_size", "out_hidden_size")},
        "weight_shards": list(release.weight_files),
        "weights_on_disk_bytes": sum((release.path / f).stat().st_size for f in release.weight_files),
        "head": asdict(release.head_config),
    }
