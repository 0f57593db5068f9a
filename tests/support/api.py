"""What the tests of the HTTP API check answers with: a correct answer (`check_answers`), the metrics, the internals an
answer must never show, and an answer with this call's own timings zeroed (to compare two calls byte for byte)."""

from __future__ import annotations

import json
import re

JSON = {"content-type": "application/json"}  # what a body sent with httpx's content= must declare
# What an answer must never show: library and Python internals (a client can do nothing with them).
INTERNAL_NAMES = re.compile(r"Traceback|set_int_max_str_digits|\[Errno|InvalidDataError|PngImagePlugin|MAX_TEXT_CHUNK|"
                            r"MemoryError|'None'|<class |object at 0x|UnidentifiedImageError|BadGzipFile|zlib|"
                            r"while decompressing|BrokenProcessPool|_RemoteTraceback|concurrent\.futures")


def check_answers(request: dict, response: dict) -> None:
    """What a client relies on: every question answered with finite, normalised, self-consistent numbers."""
    assert response["model"] == request["model"]
    assert list(response["answers"]) == list(request["questions"])
    json.dumps(response, allow_nan=False)  # every number finite
    for qid, question in request["questions"].items():
        answer = response["answers"][qid]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert 0.0 <= answer["noul"] <= 1.0
            continue
        probabilities = answer["probabilities"]
        assert all(0.0 <= p <= 1.0 for p in probabilities.values())
        assert abs(sum(probabilities.values()) - 1.0) <= 5e-5 * len(probabilities) + 1e-9  # 4-decimal rounding
        if question["type"] == "choice":
            assert list(probabilities) == list(question["criteria"])
            assert probabilities[answer["choice"]] == max(probabilities.values())
            assert answer["confidence"] == probabilities[answer["choice"]]
        else:
            levels = [str(i) for i in range(len(question["criteria"]))]
            assert list(probabilities) == levels
            assert list(answer["legend"]) == levels
            assert list(answer["legend"].values()) == question["criteria"]
            expectation = sum(i * probabilities[level] for i, level in enumerate(levels))
            assert abs(answer["score"] - expectation) <= 5e-5 * sum(range(len(levels))) + 1e-4
            assert 0 <= answer["score"] <= len(levels) - 1
    assert isinstance(response["usage"]["input_tokens"], int) and response["usage"]["input_tokens"] > 0
    assert response["usage"]["output_tokens"] == 0
    assert response["x_latency_ms"] > 0
    assert response["x_token_counts"]["total"] == response["usage"]["input_tokens"]
    assert response["x_truncated_state_tokens"] == 0


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], key: str) -> float:
    return samples.get(key, 0.0)


TIMINGS = ("x_latency_ms", "x_compute_ms", "x_queue_ms")  # this call's times, which differ between two calls


def without_latency(raw: bytes) -> bytes:
    return re.sub(rb'"(x_latency_ms|x_compute_ms|x_queue_ms)":[0-9.eE+-]+', rb'"\1":0', raw)
