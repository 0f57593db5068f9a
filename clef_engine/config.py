"""EngineConfig: every knob of the engine and every environment variable it reads, in one place.

`EngineConfig.resolve(...)` takes the keyword arguments of `clef_engine.load` (None = not given), fills the rest from
the environment, then from defaults that depend on the device, and returns a frozen config. Nothing else in
`clef_engine` reads the environment for the engine; the engine picks its runner once from this config.

- CLEF_DEVICE (device): where the engine runs; cuda if a GPU is visible, else cpu.
- CLEF_DTYPE (dtype): bf16 on CUDA, float32 on the CPU.
- CLEF_ALLOW_SLOW_KERNELS (allow_slow_kernels): allow CUDA without flash-linear-attention; off.
- CLEF_CUDA_GRAPHS (cuda_graphs): replay single records and cached-state continuations from CUDA graphs; on, CUDA
  only.
- CLEF_TOKEN_BUDGET (token_budget): most tokens in one GPU batch of interactive work; 65,536 on CUDA, 16,384 on
  the CPU.
- CLEF_BULK_BATCH_TOKENS (bulk_batch_tokens): most tokens in one batch of bulk work (interactive requests run
  between its layers, see runner.py); 16,384 on CUDA, the token budget on the CPU.
- CLEF_STATE_CACHE_BYTES (state_cache_bytes): device tier of the long-state cache, 0 = off; 8 GiB on CUDA (plus a
  host tier of 4x), 256 MiB on the CPU.
- CLEF_PREFILL_CHUNK_TOKENS (prefill_chunk_tokens): one record longer than this runs through the backbone in chunks
  of this many tokens, so that its activations stay bounded whatever its length; a last chunk shorter than an eighth
  of one joins the chunk before it (`chunk_bounds` in fast/packed.py); 0 = whole records. 16,384 on CUDA, 0 on the
  CPU.
- CLEF_WARM_UP (warm_up): after loading, compile, autotune and capture in the background while the engine answers
  (the engine reads "warming" until done; `Engine.warm_up_steps`); on with CUDA, off on the CPU.

Process settings, each set (if unset) before a release loads (`apply_process_settings`):
- FLA_DISABLE_BACKEND_DISPATCH: flash-linear-attention's backend registry would otherwise walk its backends on every
  kernel call, and nothing but its Triton backend runs on these GPUs.
- TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR: the compiled kernels, in `triton/` and `inductor/` of the project's
  cache folder (CLEF_CACHE_DIR, see environment.py), and TRITON_CACHE_AUTOTUNING=1: the autotuner's choices too,
  so that a later process on the machine (or one sharing the folder) compiles and autotunes nothing again. Triton
  reads them when the kernels' modules are imported, which loading the backbone does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import environment
from .errors import ReleaseError
from .model.release import default_device, parse_device, parse_dtype

GiB = 2**30
# option -> its variable, CLEF_ and the option's name in capitals (listed in the module docstring)
ENVIRONMENT = {key: f"CLEF_{key.upper()}" for key in ("device", "dtype", "allow_slow_kernels", "cuda_graphs",
                                                      "token_budget", "bulk_batch_tokens", "state_cache_bytes",
                                                      "prefill_chunk_tokens", "warm_up")}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ReleaseError(f"{name}={text!r}: use 1 or 0")


def _count(name: str, text: str) -> int:
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        value = -1
    if value < 0:
        raise ReleaseError(f"{name}={text!r}: use a whole number >= 0")
    return value


@dataclass(frozen=True)
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    packed: bool = True  # text records through fast/packed.py; False: the release's padded call for everything
    allow_slow_kernels: bool = False
    cuda_graphs: bool = False
    graph_max_tokens: int = 4096  # one record up to this many tokens replays a captured graph
    token_budget: int = 16_384
    bulk_batch_tokens: int = 16_384
    state_cache_bytes: int = GiB // 4
    state_cache_host_bytes: int = 0
    min_prefix_tokens: int = 2048  # shorter state prefixes are cheaper to recompute than to store
    prefill_chunk_tokens: int = 0  # records longer than this run in chunks of this many tokens (CLEF_PREFILL_...)
    max_queued_records: int = 4096
    warm_up: bool = False  # compile, autotune and capture after loading, in the background, not in users' requests

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def resolve(cls, *, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                env: Mapping[str, str] | None = None, **given: Any) -> EngineConfig:
        """The config for these keyword arguments (None = not given), then the environment, then the defaults."""
        env = os.environ if env is None else env
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        values = {key: value for key, value in given.items() if value is not None}
        for key, name in ENVIRONMENT.items():
            text = (env.get(name) or "").strip()
            if not text or key in values:
                continue
            if key in ("allow_slow_kernels", "cuda_graphs", "warm_up"):
                values[key] = _flag(name, text)
            elif key in ("device", "dtype"):
                values[key] = text
            else:
                values[key] = _count(name, text)
        device_set, dtype_set = values.pop("device", None), values.pop("dtype", None)
        where = parse_device(device if device is not None else device_set or default_device())
        dtype = parse_dtype(dtype if dtype is not None else dtype_set, where)
        cuda = where.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ReleaseError("device cuda was asked for but no CUDA GPU is visible")
        token_budget = values.pop("token_budget", 65_536 if cuda else 16_384)
        cache_bytes = values.pop("state_cache_bytes", 8 * GiB if cuda else GiB // 4)
        defaults = dict(token_budget=token_budget, bulk_batch_tokens=16_384 if cuda else token_budget,
                        cuda_graphs=cuda, state_cache_bytes=cache_bytes,
                        state_cache_host_bytes=4 * cache_bytes if cuda else 0, warm_up=cuda,
                        prefill_chunk_tokens=16_384 if cuda else 0)
        defaults.update(values)
        config = cls(device=where, dtype=dtype, **defaults)
        return replace(config, cuda_graphs=config.cuda_graphs and cuda and config.packed,
                       bulk_batch_tokens=min(config.bulk_batch_tokens, config.token_budget))

    def apply_process_settings(self) -> None:
        """Process-wide settings the fast kernels read (see the module docstring)."""
        if self.cuda:
            cache = environment.cache_dir()
            os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
            os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
            os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
