"""Run the backbone over a batch of encoded records and return final hidden states (spec §3).

`run_padded` is the plain path, the release's own call: right-pad to the longest record, text-only batches through
`model.model.language_model`, batches with media through the multimodal `model.model`, `use_cache=False`. Right
padding is exact for real tokens because the backbone is causal. Faster paths live in `fast/packed.py` and run in
`runner.py`; this one stays as the reference they are tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from .encoding import EncodedRecord


def pad_batch(records: list[EncodedRecord], pad_token_id: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] right-padded and the attention mask, on `device`."""
    longest = max(len(r) for r in records)
    input_ids = torch.full((len(records), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(records), longest), dtype=torch.long)
    for b, record in enumerate(records):
        input_ids[b, : len(record)] = torch.tensor(record.input_ids)
        attention_mask[b, : len(record)] = 1
    return input_ids.to(device, non_blocking=True), attention_mask.to(device, non_blocking=True)


def media_batch(records: list[EncodedRecord], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The records' media tensors concatenated in record order, as the multimodal model takes them."""
    merged: dict[str, torch.Tensor] = {}
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [r.media_inputs[name] for r in records if name in r.media_inputs]
        if parts:
            tensor = torch.cat(parts, dim=0).to(device)
            merged[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return merged


def media_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token modality (0 text, 1 image, 2 video), which the multimodal model needs for M-RoPE positions."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


@torch.inference_mode()
def run_padded(model: Any, records: list[EncodedRecord], pad_token_id: int) -> torch.Tensor:
    """Final hidden states [B, T, hidden] of a right-padded batch."""
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    input_ids, attention_mask = pad_batch(records, pad_token_id, device)
    if any(r.has_media for r in records):
        outputs = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              mm_token_type_ids=media_token_types(model.config, input_ids),
                              **media_batch(records, device, dtype))
    else:
        outputs = model.model.language_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return outputs.last_hidden_state
