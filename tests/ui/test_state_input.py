"""State editor parsing, media upload checks and request building (what the Decide page sends)."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import pytest
from PIL import Image

from clef_engine import protocol
from workbench_ui import state_input
from workbench_ui.state_input import (
    MAX_IMAGES,
    Media,
    MediaError,
    StateInputError,
    build_request,
    check_image,
    check_media_counts,
    check_video,
    parse_state,
    redact_media,
    sniff_content_type,
)

QUESTIONS = {"spam": {"type": "noul", "instructions": "Spam?", "criteria": None}}


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def video_bytes(container: str = "mp4", codec: str = "mpeg4", frames: int = 8, fps: int = 4) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), (i * 30) % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


# --- state -----------------------------------------------------------------------------------------------------


def test_plain_text_state_is_kept_exactly():
    text = "From: a@b.c\nSubject: refund\n\n  please refund me  \n"
    parsed = parse_state(text)
    assert parsed.kind == "text" and parsed.value == text


def test_json_object_and_array_are_detected_in_auto_mode():
    assert parse_state('  {"a": [1, 2.5, null, true]}').value == {"a": [1, 2.5, None, True]}
    assert parse_state("[1, 2]").kind == "json"
    # Something that merely looks like a JSON scalar stays text in auto mode, but is JSON when asked for.
    assert parse_state("42").value == "42"
    assert parse_state("42", mode="json").value == 42
    assert parse_state('"quoted"', mode="json").value == "quoted"
    assert parse_state('{"a": 1', mode="text").value == '{"a": 1'


def test_json_error_names_line_and_column():
    text = '{\n  "vendor": "ACME",\n  "total": 12,,\n}'
    with pytest.raises(StateInputError) as caught:
        parse_state(text)
    assert (caught.value.line, caught.value.column) == (3, 15)
    assert "not valid JSON" in caught.value.message
    assert str(caught.value).endswith("(line 3, column 15)")


def test_unterminated_string_points_at_its_start():
    with pytest.raises(StateInputError) as caught:
        parse_state('{"a": "b}')
    assert (caught.value.line, caught.value.column) == (1, 7)
    assert "Unterminated string" in caught.value.message
    with pytest.raises(StateInputError) as caught:
        parse_state('{"a": "b}\n')
    assert (caught.value.line, caught.value.column) == (1, 10), "a raw newline inside a string is the error"
    assert "Invalid control character" in caught.value.message


def test_nan_and_infinity_are_refused_with_their_position():
    with pytest.raises(StateInputError) as caught:
        parse_state('{"note": "NaN here is fine",\n "score": NaN}')
    assert "NaN is not a JSON value" in caught.value.message
    assert (caught.value.line, caught.value.column) == (2, 11)
    with pytest.raises(StateInputError, match="-Infinity is not a JSON value"):
        parse_state("[1, -Infinity]")


def test_duplicate_keys_warn_instead_of_silently_dropping_a_value():
    parsed = parse_state('{"total": 10, "nested": {"total": 1, "total": 2}}')
    assert parsed.value == {"total": 10, "nested": {"total": 2}}
    assert parsed.warnings == ('The key "total" appears more than once; only its last value is kept.',)


def test_empty_and_oversized_states_are_refused(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(StateInputError, match="The state is empty"):
        parse_state("  \n\t")
    monkeypatch.setattr(state_input, "MAX_STATE_CHARS", 10)
    with pytest.raises(StateInputError, match="11 characters; at most 10"):
        parse_state("x" * 11)


def test_state_to_text_round_trips():
    state = {"vendor": "Müller", "lines": [1, 2]}
    assert parse_state(state_input.state_to_text(state)).value == state
    assert state_input.state_to_text("plain") == "plain"


# --- media -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "content_type"), [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                                    ("WEBP", "image/webp")])
def test_images_are_accepted_by_content_not_file_name(fmt: str, content_type: str):
    media = check_image("photo.bin", image_bytes(fmt))
    assert (media.kind, media.content_type, media.width, media.height) == ("image", content_type, 32, 24)
    prefix = f"data:{content_type};base64,"
    assert media.data_url().startswith(prefix)
    assert base64.b64decode(media.data_url()[len(prefix):]) == media.data


def test_other_files_named_like_images_are_refused():
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    with pytest.raises(MediaError, match=r"cat\.png: not a file type the engine reads; images must be PNG, JPEG or"):
        check_image("cat.png", gif.getvalue())
    with pytest.raises(MediaError, match="clip.png: a video/mp4 file; images must be PNG, JPEG or WebP"):
        check_image("clip.png", video_bytes())


def test_truncated_image_is_refused():
    data = image_bytes("PNG", (64, 64))
    with pytest.raises(MediaError, match="broken.png: the image cannot be decoded"):
        check_image("broken.png", data[: len(data) // 2])


def test_image_limits(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(state_input, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaError, match=r"big.png: 32×24 = 0.0 MP is over the 0 MP limit"):
        check_image("big.png", image_bytes())
    monkeypatch.setattr(state_input, "MAX_IMAGE_BYTES", 50)
    with pytest.raises(MediaError, match="big.png: .* MB is over the 0 MB image limit"):
        check_image("big.png", image_bytes())


@pytest.mark.parametrize(("container", "codec", "content_type"), [
    ("mp4", "mpeg4", "video/mp4"),
    ("webm", "libvpx", "video/webm"),
    ("mov", "mpeg4", "video/quicktime"),
])
def test_videos_are_accepted_and_probed(container: str, codec: str, content_type: str):
    media = check_video(f"clip.{container}", video_bytes(container, codec, frames=8, fps=4))
    assert (media.kind, media.content_type, media.width, media.height) == ("video", content_type, 64, 48)
    assert media.duration_s == pytest.approx(2.0, abs=0.3)


def test_bad_videos_are_refused(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(MediaError, match="notes.mp4: not a file type the engine reads; videos must be MP4, WebM"):
        check_video("notes.mp4", b"hello world, not a video at all")
    with pytest.raises(MediaError, match="photo.mp4: a image/png file; videos must be MP4, WebM or MOV"):
        check_video("photo.mp4", image_bytes())
    corrupt = b"\x00\x00\x00\x1cftypisom" + b"\x00" * 200
    with pytest.raises(MediaError, match="corrupt.mp4: the video cannot be decoded"):
        check_video("corrupt.mp4", corrupt)
    monkeypatch.setattr(state_input, "MAX_VIDEO_SECONDS", 1.0)
    with pytest.raises(MediaError, match="long.mp4: 2 s is longer than the 1 s limit"):
        check_video("long.mp4", video_bytes())


def test_sniff_content_type_of_unknown_bytes():
    assert sniff_content_type(b"") is None
    assert sniff_content_type(b"GIF89a....") is None


def test_media_count_limits():
    image = check_image("a.png", image_bytes())
    check_media_counts([image] * MAX_IMAGES, [])
    with pytest.raises(MediaError, match="5 images attached; a request carries at most 4"):
        check_media_counts([image] * (MAX_IMAGES + 1), [])
    assert "PNG, JPEG or WebP, up to 4 per request, 20 MB and 16 MP each" in state_input.media_limits_text()


def test_upload_limits_come_from_the_contract_module():
    """One source for media per request: the page takes what the hosted service takes, for videos too."""
    assert MAX_IMAGES == state_input.MAX_VIDEOS == protocol.HOSTED.max_images
    assert state_input.MAX_IMAGE_PIXELS == protocol.HOSTED.max_image_pixels
    assert set(state_input.IMAGE_TYPES) == set(protocol.IMAGE_CONTENT_TYPES)
    assert set(state_input.VIDEO_TYPES) == set(protocol.VIDEO_CONTENT_TYPES)
    video = check_video("a.mp4", video_bytes(frames=8, fps=4))
    check_media_counts([], [video] * MAX_IMAGES)
    with pytest.raises(MediaError, match="5 videos attached; a request carries at most 4"):
        check_media_counts([], [video] * (MAX_IMAGES + 1))


# --- request ---------------------------------------------------------------------------------------------------


def test_build_request_text_only_has_no_media_keys():
    request = build_request({"a": 1}, QUESTIONS)
    assert request == {"model": "clef", "state": {"a": 1}, "questions": QUESTIONS}
    json.dumps(request)  # must be plain JSON


def test_build_request_with_media_keeps_order_and_redacts_for_display():
    first, second = check_image("first.png", image_bytes("PNG")), check_image("second.jpg", image_bytes("JPEG"))
    clip = check_video("clip.mp4", video_bytes())
    request = build_request("text state", QUESTIONS, images=[first, second], videos=[clip], model="clef-flash")
    assert request["model"] == "clef-flash"
    assert request["images"] == [first.data_url(), second.data_url()]
    assert request["videos"] == [clip.data_url()]
    shown = redact_media(request, [first, second], [clip])
    assert shown["images"][0].startswith("data:image/png;base64,")
    assert shown["images"][0].endswith(f"… [first.png, {first.size_bytes:,} bytes]")
    assert shown["videos"][0].endswith(f"… [clip.mp4, {clip.size_bytes:,} bytes]")
    assert request["images"][0] == first.data_url(), "the request itself is not modified"
    assert [q.id for q in protocol.prepare(request).questions] == ["spam"], "the request passes the contract"


def test_build_request_refuses_too_many_images():
    image = Media("image", "a.png", "image/png", image_bytes(), 32, 24)
    with pytest.raises(MediaError, match="at most 4"):
        build_request("s", QUESTIONS, images=[image] * 5)


def test_video_preview_shows_the_frames_the_engine_sends(tiny_engine):
    """The Decide page previews the engine's sampled frames; they must be the frames the encoder feeds the model."""
    clip = check_video("clip.mp4", video_bytes(frames=20, fps=10))
    preview = tiny_engine.sample_video_frames(clip.data)
    request = build_request("s", QUESTIONS, videos=[clip])
    record = tiny_engine.encode(request)
    (sent,) = record.videos
    assert preview.frame_indices == sent.frame_indices
    assert preview.total_frames == 20 and preview.fps == pytest.approx(10)
    assert len(preview.frames) < 20, "2 fps sampling of a 10 fps clip keeps a subset"
    np.testing.assert_array_equal(preview.frames, sent.frames)
