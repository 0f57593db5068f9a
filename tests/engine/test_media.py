"""Media through Engine.decide: the release code's answers for every video form, and bad media refused by name.

The release path here is computed independently of the engine's media code: the processor called the release's way
(a frame array as is, a decoded file with its real fps and every frame), then the transformers model and the
reference head.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from clef_engine.errors import RequestError
from clef_engine.model import media
from clef_engine.model.encoding import VIDEO_PLACEHOLDER, EncodedRecord
from clef_engine.model.reference import reference_decide
from clef_engine.protocol import data_url, format_answer
from tests.support.media import mp4_bytes, png_bytes

REQUEST = {
    "state": "Clip from the loading dock camera.",
    "questions": {
        "fall": {"type": "noul", "instructions": "Does a box fall?"},
        "who": {"type": "choice", "instructions": "Who moves first?", "criteria": {"b": "A worker", "a": "A robot",
                                                                                   "c": None}},
        "risk": {"type": "score", "instructions": "Risk level", "criteria": ["low", "mid", "high"]},
    },
}


def frames(count: int, height: int = 48, width: int = 64, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def all_frames(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame of a video file and its fps, decoded plainly (no sampling)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(decoded), float(stream.average_rate)


@pytest.fixture(scope="module")
def release_processor(tiny_release):
    """The release's processor, loaded fresh as the release code loads it."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_release)


def release_probabilities(engine, processor, request: dict, videos: list, **processor_kwargs) -> list[list[float]]:
    """The release path for a request with `videos`: the processor called with them as given, its media ids spliced
    after the prefix of the text-only encoding, then the padded transformers model and the per-option loop head."""
    text_only = engine.encode(request)
    outputs = processor(text=[VIDEO_PLACEHOLDER * len(videos) + "\n"], videos=videos, return_tensors="pt",
                        add_special_tokens=False, **processor_kwargs)
    media_ids = outputs["input_ids"][0].tolist()
    start, shift = len(engine.encoder.prefix_ids), len(media_ids)
    record = EncodedRecord(
        input_ids=text_only.input_ids[:start] + media_ids + text_only.input_ids[start:],
        questions=text_only.questions,
        question_spans=[(a + shift, b + shift) for a, b in text_only.question_spans],
        option_spans=[[(a + shift, b + shift) for a, b in spans] for spans in text_only.option_spans],
        token_counts={},
        media_inputs={k: outputs[k] for k in ("pixel_values_videos", "video_grid_thw")})
    return reference_decide(engine.runner, [record])[0]


def engine_probabilities(engine, request: dict) -> list[list[float]]:
    """What Engine.decide computes, before rounding: the same encode and the same batch function."""
    return engine.runner.forward([engine.encode(request)])[0]


def assert_close(ours: list[list[float]], release: list[list[float]], tolerance: float = 1e-5) -> None:
    assert [len(q) for q in ours] == [len(q) for q in release]
    worst = max(abs(a - b) for qa, qb in zip(ours, release) for a, b in zip(qa, qb))
    assert worst <= tolerance, worst


def check_decide_matches(engine, request: dict, release: list[list[float]]) -> None:
    response = engine.decide(request)
    questions = engine.encode(request).questions
    for question, probabilities in zip(questions, release):
        expected = format_answer(question, probabilities)
        answer = response["answers"][question.id]
        for key in ("noul", "confidence", "score"):
            if key in expected:
                assert answer[key] == pytest.approx(expected[key], abs=1e-4)


def test_frame_array_without_fps_reaches_the_processor_as_the_release_hands_it(tiny_engine, release_processor):
    video = frames(40)
    request = dict(REQUEST, videos=[video])
    release = release_probabilities(tiny_engine, release_processor, REQUEST, [video])
    assert_close(engine_probabilities(tiny_engine, request), release)
    check_decide_matches(tiny_engine, request, release)
    # the processor samples with its own default (no metadata: it assumes 24 fps), not at 2 fps of the frames
    assert tiny_engine.encode(request).videos[0].frame_indices == [0, 13, 26, 39]

    # what the engine did before (assume 2 fps, sample at 2 fps, pass that metadata) is not the release's answer
    from transformers.video_utils import VideoMetadata

    old_indices = tiny_engine.encoder.video_sample_indices(len(video), 2.0)
    old = release_probabilities(
        tiny_engine, release_processor, REQUEST, [video[old_indices]], do_sample_frames=False,
        video_metadata=[VideoMetadata(total_num_frames=len(video), fps=2.0, frames_indices=old_indices)])
    with pytest.raises(AssertionError):
        assert_close(old, release)


@pytest.mark.parametrize("count, fps", [(40, 10.0), (7, 3.0), (3, 30.0)])
def test_frame_array_with_fps_brings_its_metadata(tiny_engine, release_processor, count, fps):
    from transformers.video_utils import VideoMetadata

    video = frames(count, seed=count)
    request = dict(REQUEST, videos=[{"frames": video, "fps": fps}])
    release = release_probabilities(tiny_engine, release_processor, REQUEST, [video],
                                    video_metadata=[VideoMetadata(total_num_frames=count, fps=fps)])
    assert_close(engine_probabilities(tiny_engine, request), release)
    check_decide_matches(tiny_engine, request, release)


def test_decoded_file_brings_its_real_fps(tiny_engine, release_processor):
    from transformers.video_utils import VideoMetadata

    data = mp4_bytes(frames=30, fps=15)
    decoded, fps = all_frames(data)
    request = dict(REQUEST, videos=[data_url("video/mp4", data)])
    release = release_probabilities(tiny_engine, release_processor, REQUEST, [decoded],
                                    video_metadata=[VideoMetadata(total_num_frames=len(decoded), fps=fps)])
    assert_close(engine_probabilities(tiny_engine, request), release)
    check_decide_matches(tiny_engine, request, release)


def test_two_videos_and_an_image_in_one_call(tiny_engine, release_processor):
    """One processor call for the record: a frame array without fps next to one with fps."""
    from transformers.video_utils import VideoMetadata

    first, second = frames(9, seed=7), frames(12, 32, 32, seed=8)
    request = dict(REQUEST, videos=[first, {"frames": second, "fps": 6.0}])
    release = release_probabilities(
        tiny_engine, release_processor, REQUEST, [first, second],
        video_metadata=[VideoMetadata(total_num_frames=9, fps=None, frames_indices=list(range(9))),
                        VideoMetadata(total_num_frames=12, fps=6.0)])
    assert_close(engine_probabilities(tiny_engine, request), release)


# ---- bad media: 422 naming the field, never an error from inside the processor ------------------------------------

def refused(engine, request: dict) -> RequestError:
    with pytest.raises(RequestError) as caught:
        engine.decide(request)
    return caught.value


@pytest.mark.parametrize("width, height", [(201, 1), (1, 300), (6401, 32), (4000, 3)])
def test_image_aspect_ratio_over_200_is_refused_by_name(tiny_engine, width, height):
    error = refused(tiny_engine, dict(REQUEST, images=[data_url("image/png", png_bytes(width, height))]))
    assert [p.loc for p in error.problems] == [("images", 0)]
    assert f"{width}×{height}" in str(error) and "aspect ratio" in str(error)


@pytest.mark.parametrize("width, height", [(200, 1), (1, 200), (1, 1), (3, 3), (2, 1)])
def test_tiny_and_thin_images_the_processor_takes_are_answered(tiny_engine, width, height):
    response = tiny_engine.decide(dict(REQUEST, images=[png_bytes(width, height)]))
    assert response["x_token_counts"]["media"] > 0


def test_second_image_at_fault_is_named(tiny_engine):
    error = refused(tiny_engine, dict(REQUEST, images=[png_bytes(32, 32), png_bytes(1, 300)]))
    assert [p.loc for p in error.problems] == [("images", 1)]


@pytest.mark.parametrize("count", [0, 1])
def test_videos_of_fewer_frames_than_the_temporal_patch_are_refused(tiny_engine, count):
    for video in (frames(count), {"frames": frames(count), "fps": 2.0}):
        error = refused(tiny_engine, dict(REQUEST, videos=[video]))
        assert [p.loc for p in error.problems] == [("videos", 0)]
        assert ("no frames" if count == 0 else "needs at least 2") in str(error)


def test_one_frame_video_file_is_refused(tiny_engine):
    error = refused(tiny_engine, dict(REQUEST, videos=[data_url("video/mp4", mp4_bytes(frames=1))]))
    assert [p.loc for p in error.problems] == [("videos", 0)]
    assert "needs at least 2" in str(error)


def test_png_bytes_labelled_video_are_refused(tiny_engine):
    png = png_bytes(64, 64)
    for item in (data_url("video/mp4", png), {"content_type": "video/mp4", "base64": base64.b64encode(png).decode()},
                 png):
        error = refused(tiny_engine, dict(REQUEST, videos=[item]))
        assert [p.loc for p in error.problems] == [("videos", 0)]
        assert "image/png" in str(error)


def test_two_frame_video_and_thin_frames_are_answered(tiny_engine):
    assert tiny_engine.decide(dict(REQUEST, videos=[frames(2)]))["x_token_counts"]["media"] > 0
    # frames 1 px high: the processor reads them channels-first (as for the release code), which it can take
    assert tiny_engine.decide(dict(REQUEST, videos=[frames(4, 1, 300)]))["x_token_counts"]["media"] > 0


def test_video_frames_at_extreme_aspect_ratio_are_refused(tiny_engine):
    error = refused(tiny_engine, dict(REQUEST, videos=[frames(4, 8, 2000)]))
    assert [p.loc for p in error.problems] == [("videos", 0)] and "aspect ratio" in str(error)


def test_every_bad_media_item_is_reported_at_once(tiny_engine):
    error = refused(tiny_engine, dict(REQUEST, images=[png_bytes(201, 1)], videos=[frames(1)]))
    assert [p.loc for p in error.problems] == [("images", 0), ("videos", 0)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 1200), height=st.integers(1, 40), transpose=st.booleans())
def test_any_image_size_gives_an_answer_or_a_request_error(tiny_engine, width, height, transpose):
    if transpose:
        width, height = height, width
    image = Image.new("RGB", (width, height), (width % 256, height % 256, 7))
    try:
        response = tiny_engine.decide(dict(REQUEST, images=[image]))
    except RequestError as error:
        assert [p.loc for p in error.problems] == [("images", 0)]
        assert max(width, height) / min(width, height) > 200
    else:
        assert response["x_token_counts"]["media"] > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(0, 9), height=st.integers(1, 64), width=st.integers(1, 700),
       fps=st.one_of(st.none(), st.floats(0.5, 60)))
def test_any_video_shape_gives_an_answer_or_a_request_error(tiny_engine, count, height, width, fps):
    video = frames(count, height, width) if fps is None else {"frames": frames(count, height, width), "fps": fps}
    try:
        response = tiny_engine.decide(dict(REQUEST, videos=[video]))
    except RequestError as error:
        assert [p.loc for p in error.problems] == [("videos", 0)]
    else:
        assert response["x_token_counts"]["media"] > 0


@pytest.mark.parametrize("item", ["data:image/png;base64", "data:image/png;base64,", b"\x00" * 64,
                                  {"content_type": "image/png", "base64": base64.b64encode(b"text").decode()}])
def test_unreadable_image_bytes_are_named_without_python_internals(tiny_engine, item):
    # Found in the audit: PIL's message was passed on, "cannot identify image file <_io.BytesIO object at 0x…>".
    error = refused(tiny_engine, dict(REQUEST, images=[item]))
    assert [p.loc for p in error.problems] == [("images", 0)]
    assert "PNG, JPEG or WebP" in str(error)
    assert "0x" not in str(error) and "BytesIO" not in str(error)


def test_decoded_h264_frames_are_the_plain_decoders_bit_for_bit():
    """The decoder runs with its own threads: the sampled frames are still exactly what a plain single-threaded
    decode of every frame gives (H.264 with B-frames and several keyframes, the common camera and screen case)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.options = {"g": "12", "bf": "2"}
        for image in frames(60, 64, 96, seed=7):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = buffer.getvalue()
    decoded, _ = all_frames(data)
    video = media.decode_video(data, lambda total, fps: list(range(1, total, 7)))
    assert video.frame_indices == list(range(1, 60, 7))
    assert np.array_equal(video.frames, decoded[video.frame_indices])
