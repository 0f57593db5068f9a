"""Reading a release's weight files into the OS page cache in the background, from the first line of a load.

transformers reads the shards by faulting in the pages of a memory map, tensor by tensor, which on a cold page cache
runs at a fraction of the disk's speed; read at once by large sequential reads, one thread per file, they reach the
disk's speed, and the loader then finds most pages in memory. Started before the imports (torch, transformers: seconds
of a start), the reads overlap them. No torch here: `clef_engine.load` calls this before importing the engine."""

from __future__ import annotations

import threading
from pathlib import Path

_started: set[Path] = set()
_lock = threading.Lock()


def read_in_background(folder: Path) -> None:
    """Start reading every `*.safetensors` file of `folder` through, once per folder and process."""
    folder = folder.resolve()
    with _lock:
        if folder in _started:
            return
        _started.add(folder)
    for path in sorted(folder.glob("*.safetensors")):
        threading.Thread(target=read_through, args=(path,), name=f"page-cache {path.name}", daemon=True).start()


def read_through(path: Path, block: int = 16 << 20) -> None:
    buffer = bytearray(block)
    try:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    except OSError:  # only a head start: the loader reads the file itself and reports what is wrong with it
        pass
