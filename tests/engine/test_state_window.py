"""A state cut to fit (overflow "truncate_state") is tokenized only in a window at its start, and its record is the
release code's: the first tokens of the whole state's tokens, cut to fit (spec §2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_engine.model import encoding
from tests.support.bodies import REQUEST

# pieces the pre-tokenizer treats differently: letters, marks that NFC composes, digits, contractions, punctuation
# runs ending in newlines, whitespace runs with and without newlines, ideographic space, Hangul jamo
PIECES = list("ab .!\n\r\t'sé\u0301=\u0338 1x\u3000\u1100\u1161\u11a8-?") + ["'s", "  ", "\n\n", "...", "é"]


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of a character per token, from one character: every text is cut somewhere."""
    monkeypatch.setattr(encoding, "STATE_WINDOW_TOKENS", 1)
    monkeypatch.setattr(encoding, "STATE_WINDOW_MIN_CHARS", 1)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.lists(st.sampled_from(PIECES), max_size=200).map("".join), count=st.integers(0, 100))
def test_leading_tokens_are_the_whole_texts_first_tokens(tiny_engine, small_windows, text: str, count: int) -> None:
    encoder = tiny_engine.encoder
    ids, after = encoder.leading_state_tokens(text, count)
    whole = encoder.tokenize(text)
    assert len(ids) >= min(count, len(whole))
    assert ids == whole[: len(ids)]
    assert len(ids) + after <= len(whole)  # the rest is counted at least


def test_a_state_far_over_the_budget_is_cut_as_the_release_cuts_it(tiny_engine, monkeypatch) -> None:
    encoder = tiny_engine.encoder
    state = "alpha beta. gamma\n\n delta! " * 5_000  # over 1000 tokens from its size alone: the window's path
    assert encoder.token_bound(state) > 1000
    tokenized: list[int] = []  # characters of each text tokenized

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode_batch(self, texts, **options):
            tokenized.extend(map(len, texts))
            return self.inner.encode_batch(texts, **options)

    monkeypatch.setattr(encoder, "_text", Recording(encoder._text))
    monkeypatch.setattr(encoder, "_encode_batch", Recording(encoder._encode_batch.__self__).encode_batch)
    cut = tiny_engine.encode(dict(REQUEST, state=state), max_length=1000, overflow="truncate_state")
    assert sum(tokenized) < len(state) // 10
    monkeypatch.undo()
    whole = tiny_engine.encode(dict(REQUEST, state=state), max_length=10**7)
    kept = cut.token_counts["state"]
    start = len(encoder.prefix_ids)
    assert len(cut.input_ids) == 1000
    assert cut.input_ids[: start + kept] == whole.input_ids[: start + kept]
    assert cut.input_ids[start + kept:] == whole.input_ids[start + whole.token_counts["state"]:]
    # past the window the cut is counted at least: never more than were there
    assert 0 < cut.truncated_state_tokens <= whole.token_counts["state"] - kept
