"""Will a release fit? Checked before loading, so that a second model on a busy GPU is a clear refusal, not an OOM
halfway through reading 55 GB.

need = the weights in the dtype they will load in (the safetensors files' sizes, rescaled from the dtype they were
saved in) + a margin for what the engine adds once it runs: the state cache's device tier, and activations of the
largest batch (about the token budget × (4 × hidden + 3 × FFN) values — the packed layer loop's largest live
tensors), plus slack (CUDA: 1 GiB for graphs, kernels' workspaces and the caching allocator; CPU: 64 MiB). It is
compared with the memory free now: `torch.cuda.mem_get_info` on CUDA (other engines' weights and caches already
count there), the available RAM on the CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig
from .errors import ReleaseError
from .model.release import local_release

GiB = 2**30
SLACK_BYTES = {"cuda": GiB, "cpu": 64 * 2**20}
# Published sizes on disk (spec §1), for a repo id not downloaded yet: the check runs before the download.
PUBLISHED_BYTES = {"cloudflare/clef": 55_000_000_000, "cloudflare/clef-flash": 19_100_000_000}
PUBLISHED_SHAPES = {"cloudflare/clef": (5120, 17408), "cloudflare/clef-flash": (4096, 12288)}
SAVED_ITEMSIZE = 2  # both releases are saved in bf16


class InsufficientMemoryError(ReleaseError):
    """The release would not fit in the memory free on its device."""


@dataclass(frozen=True)
class Estimate:
    weights: int  # bytes, in the dtype the engine loads
    margin: int  # state cache + activations + slack
    device: str

    @property
    def total(self) -> int:
        return self.weights + self.margin


def _weights_on_disk(folder: Path) -> tuple[int, int, int, int]:
    """(backbone + head bytes on disk, saved item size, hidden size, FFN size) of a release folder."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    saved = str(text.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    itemsize = torch.empty((), dtype=getattr(torch, saved.removeprefix("torch."), torch.bfloat16)).element_size()
    files = [p for p in folder.glob("*.safetensors")]
    return (sum(p.stat().st_size for p in files), itemsize, int(text.get("hidden_size", 0)),
            int(text.get("intermediate_size", 0)))


def estimate(source: str | os.PathLike, *, revision: str | None = None,
             config: EngineConfig | None = None) -> Estimate | None:
    """What loading `source` needs on its device, or None when the release cannot be found without a download of
    something unknown (the loader then says what is wrong)."""
    config = config or EngineConfig.resolve()
    folder = local_release(str(source), revision)  # not found: the published size
    if folder is not None and (folder / "config.json").exists():
        on_disk, saved_itemsize, hidden, ffn = _weights_on_disk(folder)
    elif str(source).lower() in PUBLISHED_BYTES:
        on_disk, saved_itemsize = PUBLISHED_BYTES[str(source).lower()], SAVED_ITEMSIZE
        hidden, ffn = PUBLISHED_SHAPES[str(source).lower()]
    else:
        return None
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    weights = on_disk * itemsize // saved_itemsize
    activations = config.token_budget * (4 * hidden + 3 * ffn) * itemsize
    cache = config.state_cache_bytes if config.packed else 0
    slack = SLACK_BYTES["cuda" if config.cuda else "cpu"]
    return Estimate(weights, cache + activations + slack, str(config.device))


def free_bytes(device: torch.device) -> int:
    """Memory free now on `device`: CUDA's free memory plus what this process's caching allocator holds unused (a new
    engine here allocates from it too), or the RAM the kernel says is available."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def check_fits(source: str | os.PathLike, *, label: str | None = None, revision: str | None = None,
               config: EngineConfig | None = None, loaded: Sequence[str] = (),
               free: Callable[[torch.device], int] = free_bytes) -> Estimate | None:
    """Raise InsufficientMemoryError when `source` would not fit in the memory free on its device now; `loaded`
    names the models already resident there (for the message). Returns the estimate (None: could not estimate)."""
    config = config or EngineConfig.resolve()
    need = estimate(source, revision=revision, config=config)
    if need is None:
        return None
    available = free(config.device)
    if need.total > available:
        where = f"{config.device}" + (f" with {', '.join(loaded)} loaded" if loaded else "")
        raise InsufficientMemoryError(
            f"{label or source} needs ~{gib(need.total)} ({gib(need.weights)} of weights in "
            f"{str(config.dtype).removeprefix('torch.')} + {gib(need.margin)} for the state cache and activations), "
            f"{gib(available)} free on {where}. Unload a model, choose a smaller one (Clef-Flash), or lower "
            "CLEF_STATE_CACHE_BYTES / CLEF_TOKEN_BUDGET.")
    return need
