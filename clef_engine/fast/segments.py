"""Where each record of a pack starts (`Segments`), built on the host once per batch, for every kernel of the
packed backbone (kernels.py, attention.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

CHUNK = 64  # fla's chunk size for both the conv and the gated-delta kernels


@dataclass
class Segments:
    """Where each record of a pack starts; built on the host once per batch (no device syncs afterwards)."""

    lengths: list[int]
    starts: list[int]
    positions: torch.Tensor  # [N] long, restarting at `first_position` for every record
    cu_seqlens: torch.Tensor | None  # [R+1] long on the device (None for a single record: no varlen needed)
    cu_seqlens_int32: torch.Tensor | None
    chunk_indices: torch.Tensor | None  # fla's per-chunk (record, chunk) table, precomputed on the host
    max_length: int
    behind_tails: dict[int, tuple[Segments, torch.Tensor]] = field(default_factory=dict, repr=False)
    pieces: dict[tuple[int, int], Segments] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def count(self) -> int:
        return len(self.lengths)

    def behind(self, width: int) -> tuple[Segments, torch.Tensor]:
        """The pack with `width` more rows before each record (the last inputs of earlier tokens, for the conv of
        records that continue after a cached state), and the indices of the records' own rows in it; made once per
        pack."""
        if width not in self.behind_tails:
            rows = torch.cat([torch.arange(start + (i + 1) * width, start + (i + 1) * width + n)
                              for i, (start, n) in enumerate(zip(self.starts, self.lengths))])
            self.behind_tails[width] = (make_segments([width + n for n in self.lengths], self.positions.device),
                                        rows.to(self.positions.device, non_blocking=True))
        return self.behind_tails[width]


    def piece(self, start: int, end: int) -> Segments:
        """Rows [start, end) of a one-record pack as a pack of their own (a recurrence run in pieces, positions
        counted from the pack's first row: it reads none); made once per pack, not once per layer."""
        if (start, end) not in self.pieces:
            self.pieces[(start, end)] = make_segments([end - start], self.positions.device, first_position=start)
        return self.pieces[(start, end)]


def make_segments(lengths: list[int], device: torch.device, *, first_position: int | list[int] = 0) -> Segments:
    """`first_position`: each record's first position (after the cached tokens it continues), one for all or one
    per record."""
    bounds = list(itertools.accumulate(lengths, initial=0))
    starts = bounds[:-1]
    firsts = first_position if isinstance(first_position, list) else [first_position] * len(lengths)
    positions = torch.cat([torch.arange(first, first + n) for first, n in zip(firsts, lengths, strict=True)])
    positions = positions.to(device, non_blocking=True)
    if len(lengths) == 1:  # no varlen for fla; the attention kernel still takes [0, n]
        cu_single = torch.tensor([0, lengths[0]], dtype=torch.int32).to(device, non_blocking=True)
        return Segments(lengths, starts, positions, None, cu_single, None, lengths[0])
    cu_host = torch.tensor(bounds, dtype=torch.long)
    chunk_counts = [(n + CHUNK - 1) // CHUNK for n in lengths]
    chunk_indices = torch.tensor([[r, c] for r, count in enumerate(chunk_counts) for c in range(count)],
                                 dtype=torch.long).reshape(-1, 2)
    return Segments(lengths, starts, positions, cu_host.to(device, non_blocking=True),
                    cu_host.to(torch.int32).to(device, non_blocking=True),
                    chunk_indices.to(device, non_blocking=True), max(lengths))
