"""Encode a System One request into token ids and spans, token for token like the release code (spec §2).

Every text piece is tokenized on its own with no special tokens added, and the pieces are concatenated in order:
prefix, media placeholders, state, schema, suffix. The head needs the span of each question's instruction and of
each option's JSON; we record them as [start, end) token positions.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import Problem, RequestError, TokenBudgetError
from ..protocol import Question, parse_questions
from . import media

SYSTEM = ("Read the complete state and schema. Decide every field jointly. "
          "Each answer must be exactly one of that field's allowed options.")
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
DEFAULT_MAX_LENGTH = 16_384
OVERFLOW_POLICIES = ("refuse", "truncate_state")
PARTS = ("prefix", "media", "state", "schema", "suffix")


def render(value: Any) -> str:
    """A string as is; any other JSON value compact, keys sorted, unicode kept."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def option_json(option_id: str, description: Any) -> str:
    option = {"option_id": option_id} if description is None else {"description": description, "option_id": option_id}
    return render(option)


def schema_pieces(questions: list[Question]) -> tuple[list[str], list[int], list[list[int]]]:
    """The schema's text pieces, the index of each question's instruction piece and of each option's JSON piece."""
    pieces = [SCHEMA_HEADER]
    instruction_piece: list[int] = []
    option_piece: list[list[int]] = []
    for i, question in enumerate(questions, start=1):
        pieces.append(f"\nFIELD {i}\nID: {question.id}\nTYPE: {question.type}\nINSTRUCTION: ")
        instruction = question.instructions
        instruction_piece.append(len(pieces))
        pieces.append(render(instruction) if instruction not in (None, "") else question.id)
        pieces.append("\nALLOWED OPTIONS:\n")
        indices = []
        for k, (option_id, description) in enumerate(zip(question.option_ids, question.option_descriptions), start=1):
            pieces.append(f"OPTION {k}: ")
            indices.append(len(pieces))
            pieces.append(option_json(option_id, description))
            pieces.append("\n")
        option_piece.append(indices)
        pieces.append("END FIELD\n")
    return pieces, instruction_piece, option_piece


@dataclass
class EncodedRecord:
    input_ids: list[int]
    questions: list[Question]
    question_spans: list[tuple[int, int]]
    option_spans: list[list[tuple[int, int]]]
    token_counts: dict[str, int]
    truncated_state_tokens: int = 0
    media_offset: int | None = None
    media_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values, image_grid_thw, ...
    media_digest: str = ""  # hash of the media tensors, part of a state-cache key
    state_end: int = 0  # tokens [0, state_end) are prefix + media + state: what a state cache can reuse
    videos: list[media.Video] = field(default_factory=list)  # the frames actually sent, for display

    @property
    def question_types(self) -> list[str]:
        return [q.type for q in self.questions]

    @property
    def has_media(self) -> bool:
        return bool(self.media_inputs)

    def __len__(self) -> int:
        return len(self.input_ids)


STATE_MEMO_MIN_CHARS = 4096
STATE_MEMO_ENTRIES = 16


class Encoder:
    """Holds the tokenizer and processor of a release; encodes requests. Thread-safe for concurrent callers."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        # HF tokenizer wrappers reconfigure the Rust tokenizer on each call; concurrent calls can collide
        # ("Already borrowed"), so callers from many threads take turns. Tokenizing is cheap next to the GPU.
        self._lock = threading.Lock()
        self._states: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # long state text -> ids, recent last
        self.prefix_ids = self.tokenize(PREFIX)
        self.suffix_ids = self.tokenize(SUFFIX)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize_state(self, text: str) -> list[int]:
        """A long state is re-sent unchanged while an analyst iterates on a schema (and each decide of the state
        cache's continuation path would otherwise spend ~30 ms of CPU on a 16k-token state): remember the last few."""
        if len(text) < STATE_MEMO_MIN_CHARS:
            return self.tokenize(text)
        with self._lock:
            ids = self._states.get(text)
            if ids is not None:
                self._states.move_to_end(text)
                return list(ids)
        ids = self.tokenize(text)
        with self._lock:
            self._states[text] = tuple(ids)
            while len(self._states) > STATE_MEMO_ENTRIES:
                self._states.popitem(last=False)
        return ids

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        with self._lock:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def video_sample_indices(self, total_frames: int, fps: float) -> list[int]:
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(total_num_frames=total_frames, fps=fps)
        return [int(i) for i in self.processor.video_processor.sample_frames(metadata)]

    def encode_media(self, request: dict) -> tuple[list[int], dict[str, torch.Tensor], list[media.Video]]:
        images_in = request.get("images") or []
        videos_in = request.get("videos") or []
        if not images_in and not videos_in:
            return [], {}, []
        problems, images, videos = [], [], []
        for i, item in enumerate(images_in):
            try:
                images.append(media.load_image(item))
            except media.MediaError as error:
                problems.append(Problem(("images", i), str(error), "value_error.image"))
        for i, item in enumerate(videos_in):
            try:
                videos.append(media.load_video(item, self.video_sample_indices))
            except media.MediaError as error:
                problems.append(Problem(("videos", i), str(error), "value_error.video"))
        if problems:
            raise RequestError(problems)
        from transformers.video_utils import VideoMetadata

        text = IMAGE_PLACEHOLDER * len(images) + VIDEO_PLACEHOLDER * len(videos) + "\n"
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = [v.frames for v in videos]
            kwargs["video_metadata"] = [
                VideoMetadata(total_num_frames=v.total_frames, fps=v.fps, frames_indices=v.frame_indices)
                for v in videos
            ]
            kwargs["do_sample_frames"] = False  # frames are already the processor's own sample (see media.py)
            kwargs["cap_pixels_per_frame"] = False  # transformers' current default, stated to silence its warning
        with self._lock:
            outputs = self.processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs)
        ids = outputs["input_ids"][0].tolist()
        tensors = {k: outputs[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
                   if k in outputs}
        return ids, tensors, videos

    def encode(self, request: dict, *, max_length: int | None = None, overflow: str = "refuse") -> EncodedRecord:
        """Validate and encode one request. Raises RequestError or TokenBudgetError; never anything else for bad
        input."""
        questions = parse_questions(request)
        max_length = DEFAULT_MAX_LENGTH if max_length is None else max_length
        if overflow not in OVERFLOW_POLICIES:
            raise RequestError([Problem(("overflow",), f"overflow must be one of {OVERFLOW_POLICIES}")])
        if not isinstance(max_length, int) or max_length < 1:
            raise RequestError([Problem(("max_length",), "max_length must be a positive integer")])

        media_ids, media_inputs, videos = self.encode_media(request)
        state_ids = self.tokenize_state(render(request["state"]))
        pieces, instruction_piece, option_piece = schema_pieces(questions)
        piece_ids = self.tokenize_many(pieces)
        schema_length = sum(map(len, piece_ids))

        counts = {"prefix": len(self.prefix_ids), "media": len(media_ids), "state": len(state_ids),
                  "schema": schema_length, "suffix": len(self.suffix_ids)}
        fixed = counts["prefix"] + counts["media"] + counts["schema"] + counts["suffix"]
        truncated = 0
        if fixed > max_length:
            largest = max(("media", "schema"), key=counts.get)
            raise TokenBudgetError(
                f"prefix + media + schema + suffix take {fixed} tokens, {fixed - max_length} over max_length "
                f"{max_length} before any state; the {largest} ({counts[largest]} tokens) is the largest part",
                over_by=fixed - max_length, part=largest, token_counts=counts, max_length=max_length)
        if fixed + len(state_ids) > max_length:
            over = fixed + len(state_ids) - max_length
            if overflow == "refuse":
                raise TokenBudgetError(
                    f"the record is {fixed + len(state_ids)} tokens, {over} over max_length {max_length}; "
                    f"the state ({len(state_ids)} tokens) is too long — shorten it, raise max_length, or allow "
                    f"truncation (overflow='truncate_state')",
                    over_by=over, part="state", token_counts=counts, max_length=max_length)
            truncated = over
            state_ids = state_ids[: len(state_ids) - over]  # the reference cuts the end of the state
            counts["state"] = len(state_ids)

        input_ids = self.prefix_ids + media_ids + state_ids
        state_end = len(input_ids)
        question_spans: list[tuple[int, int]] = []
        option_spans: list[list[tuple[int, int]]] = [[] for _ in questions]
        starts = {}
        for index, ids in enumerate(piece_ids):
            starts[index] = len(input_ids)
            input_ids.extend(ids)
        for j, piece in enumerate(instruction_piece):
            question_spans.append((starts[piece], starts[piece] + len(piece_ids[piece])))
            for option in option_piece[j]:
                option_spans[j].append((starts[option], starts[option] + len(piece_ids[option])))
        input_ids.extend(self.suffix_ids)
        counts["total"] = len(input_ids)
        for j, span in enumerate(question_spans):
            if span[0] == span[1]:
                raise RequestError([Problem(("questions", questions[j].id, "instructions"),
                                            "instructions encode to no tokens")])

        return EncodedRecord(
            input_ids=input_ids, questions=questions, question_spans=question_spans, option_spans=option_spans,
            token_counts=counts, truncated_state_tokens=truncated,
            media_offset=len(self.prefix_ids) if media_ids else None, media_inputs=media_inputs,
            media_digest=_digest(media_inputs), state_end=state_end, videos=videos,
        )


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    if not tensors:
        return ""
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].contiguous().cpu()
        hasher.update(name.encode())
        hasher.update(str(tuple(tensor.shape)).encode())
        hasher.update(tensor.numpy().tobytes())
    return hasher.hexdigest()
