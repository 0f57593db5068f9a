"""When memory runs short the request is answered as too large for this server (413, in our words), never as bad
input: no 422 quoting torch's allocator, no valid video called corrupt."""

from __future__ import annotations

import errno

import pytest

from clef_engine.model import media
from clef_engine.protocol import data_url
from tests.support.bodies import REQUEST
from tests.support.media import h264_mp4, png_bytes

ALLOCATOR_FAILURE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 1152921504606846976 bytes. Error code 12 (Cannot allocate memory)")


def test_processor_out_of_memory_is_a_memory_error_not_a_422(tiny_engine, monkeypatch) -> None:
    encoder = tiny_engine.encoder

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(ALLOCATOR_FAILURE)

    monkeypatch.setattr(type(encoder.processor), "__call__", out_of_memory)
    with pytest.raises(MemoryError) as caught:
        tiny_engine.encode(dict(REQUEST, images=[data_url("image/png", png_bytes(32, 32, seed=1))]))
    assert "alloc_cpu" not in str(caught.value)


@pytest.mark.parametrize("code", [errno.ENOMEM, errno.EAGAIN], ids=["ENOMEM", "EAGAIN"])
def test_a_decoder_short_of_memory_or_threads_does_not_call_a_valid_video_corrupt(monkeypatch, code: int) -> None:
    import av

    video = h264_mp4(3)
    opened = av.open

    def failing(*args, **kwargs):
        raise OSError(code, "Cannot allocate memory")

    monkeypatch.setattr(av, "open", failing)
    with pytest.raises(MemoryError):
        media.decode_video(video, lambda total, fps: list(range(total)))
    monkeypatch.setattr(av, "open", opened)
    assert len(media.decode_video(video, lambda total, fps: list(range(total))).frame_indices) == 3
