"""Encode a System One request into token ids and spans, token for token like the release code (spec §2).

Every text piece is tokenized on its own with no special tokens added, and the pieces are concatenated in order:
prefix, media placeholders, state, schema, suffix. The head needs the span of each question's instruction and of
each option's JSON; we record them as [start, end) token positions.

A request is refused for its size before the expensive work: with overflow "refuse", cheap lower bounds (UTF-8
bytes over the longest token's bytes for text, the processor's resize rule applied to the image header for media)
are checked first, then the exact counts as each part is tokenized, and media pixels are decoded last. Encoding of
one request never waits for another's: text goes through our own copy of the Rust tokenizer (the HF wrapper
reconfigures its tokenizer on every call, so it cannot be shared), and media through a small pool of processor
copies that also bounds how many requests hold decoded pixels at once. A long state is tokenized in pieces at once
(`letter_space_pieces`), on every core: its ids are the whole text's.
"""

from __future__ import annotations

import array
import copy
import ctypes
import ctypes.util
import hashlib
import itertools
import json
import os
import queue
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import Problem, RequestError, TokenBudgetError
from ..protocol import DEFAULT_MAX_LENGTH, Question, ValidRequest
from . import media

SYSTEM = ("Read the complete state and schema. Decide every field jointly. "
          "Each answer must be exactly one of that field's allowed options.")
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
UNBOUNDED = 2**31 - 1  # a max_length no record reaches: counting, not refusing


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
SCHEMA_MEMO_ENTRIES = 16
SCHEMA_MEMO_MAX_CHARS = 1 << 18  # larger schemas are tokenized each time rather than held
STATE_PIECE_CHARS = 8192  # a longer state is tokenized in pieces of about this many characters, in parallel
# the pre-tokenizer `letter_space_pieces` is exact for: Qwen3.5's (spec §1)
QWEN35_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                      r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
MEDIA_SLOTS = 2  # requests whose media are decoded at once; each may hold gigabytes of pixels while it runs
TRIM_AFTER_PIXELS = 4_000_000  # give freed memory back to the OS after media this large
# NFC shrinks a text's UTF-8 by at most 3.5× (U+0390 from three 2-3 byte input characters is the worst case in
# Python's Unicode tables: composition absorbs at most the code points of one decomposition); 4 leaves a margin.
NFC_MAX_SHRINK = 4
STATE_WINDOW_TOKENS = 4  # a truncated state's first window: this many characters per token it must hold
STATE_WINDOW_MIN_CHARS = 64
# Unicode White_Space, what the pre-tokenizer's \s means (str.isspace also takes U+001C..U+001F)
WHITE_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None elsewhere. Decoded pixels are freed into glibc's arenas, which keep them: without
    a trim, a few large images leave the process gigabytes bigger for good."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


class Encoder:
    """Holds the tokenizer and processor of a release; encodes requests. Thread-safe for concurrent callers."""

    def __init__(self, processor: Any) -> None:
        import tokenizers

        self.processor = processor
        self.tokenizer = processor.tokenizer  # for callers: ids ↔ tokens, decode (never used to encode here)
        backend = processor.tokenizer.backend_tokenizer.to_str()  # read once: a real vocabulary's is megabytes
        # our own copy, never reconfigured, so any number of threads can encode with it at once
        self._text = tokenizers.Tokenizer.from_str(backend)
        self._text.no_truncation()
        self._text.no_padding()
        # encode_batch runs without the GIL (encode holds it for the whole call); the fast variant skips offsets
        self._encode_batch = getattr(self._text, "encode_batch_fast", self._text.encode_batch)
        spec = json.loads(backend)
        self.max_token_bytes = longest_token_bytes(self._text, spec)
        self._normalizer = (spec.get("normalizer") or {}).get("type")
        self._added_tokens = added_token_texts(spec)
        self._pieces_exact = cuts_at_letter_spaces_are_exact(spec)
        self._processors: queue.Queue = queue.Queue()
        for _ in range(MEDIA_SLOTS):
            self._processors.put(copy.deepcopy(processor))
        self._memo_lock = threading.Lock()
        self._states: OrderedDict[bytes, array.array] = OrderedDict()  # digest of a long state -> ids, recent last
        self._schemas: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()  # pieces -> ids, recent last
        self.prefix_ids = self.tokenize(PREFIX)
        self.suffix_ids = self.tokenize(SUFFIX)
        self.newline_ids = self.tokenize("\n")
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    # ---- text -------------------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_many([text])[0]

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=False)]

    def token_bound(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without tokenizing it: every token stands for at most
        `max_token_bytes` bytes of the normalized text. Normalizing a large text would hold the GIL for seconds,
        so for NFC we divide by how much NFC can shrink a text instead."""
        shrink = 1
        if self._normalizer is not None and not text.isascii():
            if self._normalizer == "NFC":
                shrink = NFC_MAX_SHRINK
            else:
                text = self._text.normalizer.normalize_str(text)
        size = len(text.encode("utf-8", "surrogatepass"))
        return -(-size // (self.max_token_bytes * shrink))

    def leading_state_tokens(self, text: str, count: int) -> tuple[list[int], int]:
        """At least the first `count` tokens of `text` (all of them when it has fewer), tokenizing only a window at
        the start of it, and a lower bound on the tokens after those returned: what a state cut to fit needs,
        whatever its length. A window's tokens are the text's own except those of its last pre-tokens, which
        may join what follows the window (see `settled_tokens`); the window doubles until it holds `count` settled
        tokens, up to characters enough for `count` tokens of any kind, where a single pre-token longer than that
        is taken as the window cuts it."""
        limit = (count + 1) * self.max_token_bytes * NFC_MAX_SHRINK
        chars = max(STATE_WINDOW_MIN_CHARS, count * STATE_WINDOW_TOKENS)
        while True:
            window = text[:chars]
            encoding = self._text.encode_batch([window], add_special_tokens=False)[0]
            if chars >= len(text):
                return encoding.ids, 0
            settled = settled_tokens(window, encoding.offsets, encoding.word_ids, self._added_tokens)
            if settled >= count or chars >= limit:
                kept = max(settled, min(count, len(encoding.ids)))
                end = encoding.offsets[kept - 1][1] if kept else 0
                return encoding.ids[:kept], self.token_bound(text[end:])
            chars *= 2

    def tokenize_schema(self, pieces: list[str]) -> list[list[int]]:
        """The ids of a schema's pieces (see schema_pieces), tokenized once while the schema is among the last
        SCHEMA_MEMO_ENTRIES seen: a batch run's cases, and an analyst's reruns on new states, share one schema.
        The lists returned are shared: callers read them."""
        key = tuple(pieces)
        ids = self._recall(self._schemas, key)
        if ids is None:
            ids = self.tokenize_many(pieces)
            if sum(map(len, pieces)) <= SCHEMA_MEMO_MAX_CHARS:
                self._keep(self._schemas, key, ids, SCHEMA_MEMO_ENTRIES)
        return ids

    def tokenize_state(self, text: str) -> list[int]:
        """The state's ids, from the memo when this long state was accepted before (a long state is re-sent
        unchanged while an analyst iterates on a schema, and the state cache's continuation path would otherwise
        spend tens of ms of CPU per decide on it)."""
        ids = self._recall(self._states, _text_digest(text)) if len(text) >= STATE_MEMO_MIN_CHARS else None
        if ids is not None:
            return ids.tolist()
        if not self._pieces_exact or len(text) < 2 * STATE_PIECE_CHARS:
            return self.tokenize(text)
        # a new long state is on the path of its first answer, the GPU waiting: its pieces on every core at once
        pieces = letter_space_pieces(text, max(STATE_PIECE_CHARS, len(text) // (os.cpu_count() or 1)))
        return [token for ids in self.tokenize_many(pieces) for token in ids]

    def remember_state(self, text: str, ids: list[int]) -> None:
        """Keep the ids of a long state of an accepted record (never of a refused one: a client sending ever new
        oversized states must not grow the process)."""
        if len(text) >= STATE_MEMO_MIN_CHARS:
            self._keep(self._states, _text_digest(text), array.array("I", ids), STATE_MEMO_ENTRIES)

    def _recall(self, memo: OrderedDict, key: Any) -> Any:
        with self._memo_lock:
            if key in memo:
                memo.move_to_end(key)
            return memo.get(key)

    def _keep(self, memo: OrderedDict, key: Any, value: Any, entries: int) -> None:
        with self._memo_lock:
            memo[key] = value
            memo.move_to_end(key)
            while len(memo) > entries:
                memo.popitem(last=False)

    # ---- media ------------------------------------------------------------------------------------------------

    def video_sample_indices(self, total_frames: int, fps: float | None) -> list[int]:
        """The frames the video processor samples of a video's `total_frames` (at least one), as it would sample them
        itself (fps None: a frame array given without one, for which the processor assumes its own default)."""
        from transformers.video_utils import VideoMetadata

        video_processor = self.processor.video_processor
        if not video_processor.do_sample_frames:
            return list(range(total_frames))
        metadata = VideoMetadata(total_num_frames=total_frames, fps=fps)
        return [int(i) for i in video_processor.sample_frames(metadata)]

    def image_tokens(self, image: Any) -> int:
        """Tokens of one image (start, pads, end) from its size, by the image processor's own resize rule; raises
        MediaError for a size the processor refuses."""
        image_processor = self.processor.image_processor
        try:
            patches = image_processor.get_number_of_image_patches(image.height, image.width)
        except (ValueError, ZeroDivisionError) as error:
            raise media.MediaError(f"the image processor cannot take a {image.width}×{image.height} image "
                                   f"({error})") from error
        return patches // image_processor.merge_size**2 + 2

    def video_tokens(self, video: media.Video) -> int:
        """A lower bound on the tokens of one sampled video (pads and start/end per frame pair; the timestamp texts
        are not counted); raises MediaError for what the video processor refuses."""
        from transformers.image_utils import ChannelDimension, infer_channel_dimension_format

        video_processor = self.processor.video_processor
        temporal = video_processor.temporal_patch_size
        if video.total_frames == 0:
            raise media.MediaError("the video has no frames")
        sampled = len(video.frame_indices)
        if sampled < temporal:
            raise media.MediaError(
                f"the video has {video.total_frames} frame(s) and the processor samples {sampled}; it needs at "
                f"least {temporal} (its temporal patch size)")
        try:
            # the processor reads T×H×W×C frames as T×C×H×W when H could be a channel count; so does this check
            channels_first = infer_channel_dimension_format(video.frames) == ChannelDimension.FIRST
            height, width = video.frames.shape[2:4] if channels_first else video.frames.shape[1:3]
            patches = video_processor.get_num_of_video_patches(sampled, int(height), int(width))
        except (ValueError, ZeroDivisionError) as error:
            raise media.MediaError(f"the video processor cannot take {sampled} frames of "
                                   f"{video.frames.shape[2]}×{video.frames.shape[1]} ({error})") from error
        per_frame_pair = patches // (sampled // temporal) // video_processor.merge_size**2
        return -(-sampled // temporal) * (per_frame_pair + 2)

    def media_bound(self, images: list, videos: list) -> int:
        """A lower bound on the media tokens of opened media (exact for images; video files count 0 until
        decoded)."""
        if not images and not videos:
            return 0
        tokens = sum(self.image_tokens(image) for image in images)
        tokens += sum(self.video_tokens(video) for video in videos if isinstance(video, media.Video))
        return tokens + len(self.newline_ids)

    def encode_media(self, images: list, videos: list) -> tuple[list[int], dict[str, torch.Tensor],
                                                                 list[media.Video]]:
        """Decode the pixels and run the processor, as the release does: one call with every image and video, a
        frame array with no fps without metadata. At most MEDIA_SLOTS requests do this at once."""
        if not images and not videos:
            return [], {}, []
        processor = self._processors.get()
        decoded: list[list] = [[], []]
        try:
            decoded = _each_media(images, media.decode_image, videos, lambda video: video if isinstance(
                video, media.Video) else self._checked_video(media.decode_video(video, self.video_sample_indices)))
            return self._process(processor, *decoded)
        finally:
            self._processors.put(processor)
            pixels = sum(image.width * image.height for image in images) + sum(
                video.frames.size // 3 for video in decoded[1])
            if pixels >= TRIM_AFTER_PIXELS and _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)

    def _process(self, processor: Any, images: list,
                 videos: list[media.Video]) -> tuple[list[int], dict[str, torch.Tensor], list[media.Video]]:
        from transformers.video_utils import VideoMetadata

        text = IMAGE_PLACEHOLDER * len(images) + VIDEO_PLACEHOLDER * len(videos) + "\n"
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = [v.frames for v in videos]
            # The frames are already the processor's own sample (see media.py), taken with the fps it would have
            # used; the metadata tells it where they came from (fps None: its default, as for the release's call).
            kwargs["video_metadata"] = [
                VideoMetadata(total_num_frames=v.total_frames, fps=v.fps, frames_indices=list(v.frame_indices))
                for v in videos]
            kwargs["do_sample_frames"] = False
            if processor.video_processor.cap_pixels_per_frame is None:
                kwargs["cap_pixels_per_frame"] = False  # what None means in transformers 5.17, said to silence it
        try:
            outputs = processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs)
        except (ValueError, RuntimeError, TypeError) as error:  # a precondition the checks above do not know yet
            if "DefaultCPUAllocator" in str(error) or isinstance(error, torch.OutOfMemoryError):
                raise MemoryError from None  # the server's memory, not the media: never a 422 quoting the allocator
            field_name = "images" if images else "videos"
            raise RequestError([Problem((field_name,), f"the processor cannot take these media ({error})",
                                        f"value_error.{field_name[:-1]}")]) from error
        ids = outputs["input_ids"][0].tolist()
        tensors = {k: outputs[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
                   if k in outputs}
        return ids, tensors, videos

    # ---- records ----------------------------------------------------------------------------------------------

    def open_request(self, request: ValidRequest) -> tuple[list[Question], list, list, str]:
        """A validated request's questions, images, videos and state text, its media opened (headers read, videos
        given as frames sampled; video files stay bytes) and checked against the limits and the processor's
        preconditions with no pixel decoded. Raises RequestError listing every problem."""
        def image(item: Any) -> Any:
            opened = media.open_image(item)
            self.image_tokens(opened)
            return opened

        def video(item: Any) -> media.Video | bytes:
            opened = media.open_video(item, self.video_sample_indices)
            return opened if isinstance(opened, bytes) else self._checked_video(opened)

        images, videos = _each_media(request.images, image, request.videos, video)
        return list(request.questions), images, videos, render(request.state)

    def _checked_video(self, video: media.Video) -> media.Video:
        self.video_tokens(video)
        return video

    def count_tokens(self, valid: ValidRequest) -> dict[str, int]:
        """The tokens of each part and their total, as `encode` with no budget counts them. An image's tokens
        follow from its header, so a request whose media are images alone is counted without decoding a pixel
        (decoding a large photo costs far more than counting); a video's are known once its frames are sampled."""
        questions, images, videos, state_text = self.open_request(valid)
        if videos:
            return dict(self.encode(replace(valid, max_length=UNBOUNDED, overflow="refuse")).token_counts)
        pieces, instruction_piece, _ = schema_pieces(questions)
        piece_ids = self.tokenize_schema(pieces)
        _check_instructions(questions, [piece_ids[piece] for piece in instruction_piece])
        counts = {"prefix": len(self.prefix_ids), "media": self.media_bound(images, []),
                  "state": len(self.tokenize_state(state_text)), "schema": sum(map(len, piece_ids)),
                  "suffix": len(self.suffix_ids)}
        return {**counts, "total": sum(counts.values())}

    def encode_many(self, valids: Sequence[ValidRequest]) -> list[EncodedRecord]:
        """`encode` of each, their states tokenized together on every core (Why's variants: many states of one
        record's size, a few ms of one core each). Those states are not memoized: they are not sent again."""
        texts = [render(valid.state) for valid in valids]
        whole = [i for i, (valid, text) in enumerate(zip(valids, texts))  # those whose size alone is not over budget
                 if self.token_bound(text) <= max_length_of(valid)]
        ids: list[list[int] | None] = [None] * len(valids)
        for i, state_ids in zip(whole, self.tokenize_many([texts[i] for i in whole])):
            ids[i] = state_ids
        return [self.encode(valid, state_ids) for valid, state_ids in zip(valids, ids)]

    def encode(self, valid: ValidRequest, tokenized_state: list[int] | None = None) -> EncodedRecord:
        """Encode one request, validated before (protocol.prepare), under its own budget (`tokenized_state`: its
        state's ids, if known). Raises RequestError or TokenBudgetError; never anything else for bad input."""
        max_length = max_length_of(valid)
        overflow = valid.overflow
        questions, images, videos, state_text = self.open_request(valid)
        pieces, instruction_piece, option_piece = schema_pieces(questions)

        # Cheapest first: bounds of every part, then exact schema, then exact state; pixels are decoded last.
        counts = {"prefix": len(self.prefix_ids), "media": self.media_bound(images, videos),
                  "state": self.token_bound(state_text), "schema": sum(map(self.token_bound, pieces)),
                  "suffix": len(self.suffix_ids)}
        media_bound = ("media",) if videos else ()  # image tokens are exact from the header; videos' are not
        check_budget(counts, max_length, overflow, at_least=media_bound + ("state", "schema"))
        piece_ids = self.tokenize_schema(pieces)
        counts["schema"] = sum(map(len, piece_ids))
        check_budget(counts, max_length, overflow, at_least=media_bound + ("state",))
        if overflow == "refuse" or counts["state"] <= max_length:  # no more work than a refused state may cost
            state_ids, after = (self.tokenize_state(state_text) if tokenized_state is None else tokenized_state), 0
        else:  # a state far over the budget: only as much of it as fits is tokenized (its rest is counted at least)
            room = max_length - counts["prefix"] - counts["media"] - counts["schema"] - counts["suffix"]
            state_ids, after = self.leading_state_tokens(state_text, room)
        counts["state"] = len(state_ids) + after
        check_budget(counts, max_length, overflow, at_least=media_bound)
        media_ids, media_inputs, decoded_videos = self.encode_media(images, videos)
        counts["media"] = len(media_ids)
        truncated = check_budget(counts, max_length, overflow, at_least=())
        if truncated:
            counts["state"] -= truncated
            state_ids = state_ids[: counts["state"]]  # the reference cuts the end of the state

        input_ids = self.prefix_ids + media_ids + state_ids
        state_end = len(input_ids)
        spans = []  # [start, end) of each schema piece
        for ids in piece_ids:
            spans.append((len(input_ids), len(input_ids) + len(ids)))
            input_ids.extend(ids)
        question_spans = [spans[piece] for piece in instruction_piece]
        option_spans = [[spans[piece] for piece in pieces] for pieces in option_piece]
        input_ids.extend(self.suffix_ids)
        counts["total"] = len(input_ids)
        _check_instructions(questions, [piece_ids[piece] for piece in instruction_piece])
        if not truncated and tokenized_state is None:
            self.remember_state(state_text, state_ids)

        return EncodedRecord(
            input_ids=input_ids, questions=questions, question_spans=question_spans, option_spans=option_spans,
            token_counts=counts, truncated_state_tokens=truncated, media_inputs=media_inputs,
            media_digest=_digest(media_inputs), state_end=state_end, videos=decoded_videos,
        )


def _each_media(images: Any, open_image: Callable[[Any], Any], videos: Any,
                open_video: Callable[[Any], Any]) -> list[list]:
    """`open_image` of every image and `open_video` of every video, or RequestError listing every one that fails."""
    opened: dict[str, list] = {"images": [], "videos": []}
    problems = []
    for key, items, open_item in (("images", images, open_image), ("videos", videos, open_video)):
        for i, item in enumerate(items):
            try:
                opened[key].append(open_item(item))
            except media.MediaError as error:
                problems.append(Problem((key, i), str(error), f"value_error.{key[:-1]}"))
    if problems:
        raise RequestError(problems)
    return [opened["images"], opened["videos"]]


def _check_instructions(questions: list[Question], instruction_ids: list[list[int]]) -> None:
    for question, ids in zip(questions, instruction_ids):
        if not ids:
            raise RequestError([Problem(("questions", question.id, "instructions"),
                                        "instructions encode to no tokens")])


SHORTEN = {"schema": "shorten the schema (fewer questions or options, shorter texts)",
           "media": "send fewer or smaller images, or shorter videos"}  # what cutting the state cannot fix


def check_budget(counts: dict[str, int], max_length: int, overflow: str, *, at_least: tuple[str, ...]) -> int:
    """Raise TokenBudgetError when the record cannot fit; else return how many state tokens to cut (0 unless
    overflow is "truncate_state"). Parts named in `at_least` are lower bounds so far, and the message says so."""

    def amount(n: int, *parts: str) -> str:
        return f"at least {n:,}" if any(p in at_least for p in parts) else f"{n:,}"

    fixed = counts["prefix"] + counts["media"] + counts["schema"] + counts["suffix"]
    if fixed > max_length:
        largest = max(("media", "schema"), key=lambda part: counts[part])
        frame = counts["prefix"] + counts["suffix"]
        if frame >= max_length:  # no schema fits, however short: only a larger max_length helps
            blame, advice = (f"the prompt's own text (prefix + suffix) alone takes {frame:,}", "raise max_length")
        else:
            blame = f"of what the request sends, the {largest} ({amount(counts[largest], largest)} tokens) is the most"
            advice = f"{SHORTEN[largest]}, or raise max_length"
        raise TokenBudgetError(
            f"prefix + media + schema + suffix take {amount(fixed, 'media', 'schema')} tokens, "
            f"{amount(fixed - max_length, 'media', 'schema')} over max_length {max_length:,} before any state; {blame}",
            advice=advice, over_by=fixed - max_length, part=largest, token_counts=counts, max_length=max_length)
    over = fixed + counts["state"] - max_length
    if over <= 0:
        return 0
    if overflow == "refuse":
        every = ("media", "schema", "state")
        raise TokenBudgetError(
            f"the record is {amount(fixed + counts['state'], *every)} tokens, {amount(over, *every)} over max_length "
            f"{max_length:,}; the state ({amount(counts['state'], 'state')} tokens) is too long",
            advice="shorten it, raise max_length, or allow truncation (overflow='truncate_state')",
            over_by=over, part="state", token_counts=counts, max_length=max_length)
    return over if not at_least else 0


def max_length_of(valid: ValidRequest) -> int:
    return DEFAULT_MAX_LENGTH if valid.max_length is None else valid.max_length


def settled_tokens(window: str, offsets: list[tuple[int, int]], word_ids: list[int | None],
                   added: Sequence[str] = ()) -> int:
    """How many leading tokens of a window of a text (its tokens' character offsets and pre-token numbers) are the
    text's own whatever follows the window. The tokenizer first takes out the `added` tokens (`<|im_start|>`, …),
    so the window's end may hold the start of one; before that, the pre-tokenizer splits a text into runs of one
    kind of character — letters and marks (with one character before them), digits, other characters (with a space
    before them and newlines after them), whitespace — and each pre-token is tokenized alone, so only the
    pre-tokens of the window's last run, and of the other characters before it when that run is whitespace, can
    change with what follows; NFC composes only within that run too."""
    tail = len(window) - max((k for token in added for k in range(1, len(token)) if window.endswith(token[:k])),
                             default=0)
    kind = _kind(window[tail - 1]) if tail else ""
    while tail and _kind(window[tail - 1]) == kind:
        tail -= 1
    if kind == "space":
        while tail and _kind(window[tail - 1]) == "other":
            tail -= 1
    tail = max(0, tail - 1)
    kept = len(offsets)
    while kept and (offsets[kept - 1][0] >= tail or offsets[kept - 1][1] > tail):
        kept -= 1
    while 0 < kept < len(offsets) and word_ids[kept - 1] == word_ids[kept]:  # a pre-token is kept whole or not
        kept -= 1
    return kept


def _kind(character: str) -> str:
    if character in WHITE_SPACE:
        return "space"
    category = unicodedata.category(character)[0]
    return {"L": "letter", "M": "letter", "N": "digit"}.get(category, "other")


_SPACE_BETWEEN_WORD_CHARACTERS = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # \w's letters, and some numerals
CUT_TRIES = 64  # candidates looked at per cut: a text of numerals that \w takes for letters costs no more


def letter_space_pieces(text: str, every: int) -> list[str]:
    """`text` cut before a space between two letters (Unicode category L) about every `every` characters, or whole
    where it has none. Qwen3.5's pre-tokenizer always ends a pre-token before such a space and starts the next with
    it, whatever surrounds them, and NFC composes nothing across a space: tokenized apart, the pieces' ids are the
    whole text's, in order."""
    pieces, start = [], 0
    while len(text) - start >= 2 * every:
        found = itertools.islice(_SPACE_BETWEEN_WORD_CHARACTERS.finditer(text, start + every), CUT_TRIES)
        cut = next((m.start() for m in found if text[m.start() - 1].isalpha() and text[m.end()].isalpha()), None)
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def added_token_texts(spec: dict) -> list[str]:
    """The texts of a tokenizer.json's added tokens (`<|im_start|>`, …), which match before anything else."""
    return [token["content"] for token in spec.get("added_tokens") or []]


def cuts_at_letter_spaces_are_exact(spec: dict) -> bool:
    """Whether `letter_space_pieces` keeps the ids of the tokenizer of this tokenizer.json: its normalizer is NFC or
    none, its pre-tokenizer is Qwen3.5's regex then byte-level, and no added token (matched before everything else)
    could span or touch a cut: none holds whitespace or begins or ends with a letter."""
    steps = (spec.get("pre_tokenizer") or {}).get("pretokenizers") or [{}, {}]
    split, byte_level = steps[0], steps[-1]
    added = added_token_texts(spec)
    return ((spec.get("normalizer") or {}).get("type") in (None, "NFC") and len(steps) == 2
            and split.get("type") == "Split" and split.get("pattern") == {"Regex": QWEN35_PRETOKENIZE}
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex")
            and not any(any(c.isspace() for c in token) or token[:1].isalpha() or token[-1:].isalpha()
                        for token in added))


def longest_token_bytes(tokenizer: Any, spec: dict) -> int:
    """Bytes of text the longest token stands for (`spec`: its tokenizer.json). In a byte-level vocabulary each
    character of a token is one byte; added tokens (`<|im_start|>`, …) match their UTF-8 text."""
    added = set(added_token_texts(spec))
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    longest = 1
    for token in tokenizer.get_vocab(with_added_tokens=True):
        size = len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))
        longest = max(longest, size)
    return longest


def _text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

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
