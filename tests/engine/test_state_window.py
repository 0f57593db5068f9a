"""A long state is tokenized in parts, and its ids are the whole text's (spec §2): a state cut to fit (overflow
"truncate_state") only in a window at its start, its record the release code's (the first tokens of the whole state's
tokens, cut to fit); a whole one in pieces at once, on every core."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_engine.model import encoding
from tests.support.bodies import REQUEST

# pieces the pre-tokenizer treats differently: letters, marks that NFC composes, digits, contractions, punctuation
# runs ending in newlines, whitespace runs with and without newlines, ideographic space, Hangul jamo, numerals that
# Python's \w takes for letters, special tokens
PIECES = list("ab .!\n\r\t'sé\u0301=\u0338 1x\u3000\u1100\u1161\u11a8-?²Ⅻ") + ["'s", "  ", "\n\n", "...", "é",
                                                                           " a", "<|im_start|>", " <|im_end|>"]


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


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.lists(st.sampled_from(PIECES), max_size=200).map("".join), every=st.integers(1, 12))
def test_pieces_cut_at_letter_spaces_tokenize_as_the_whole_text(tiny_engine, text: str, every: int) -> None:
    encoder = tiny_engine.encoder
    pieces = encoding.letter_space_pieces(text, every)
    assert "".join(pieces) == text
    assert all(pieces) or text == ""
    assert [token for piece in pieces for token in encoder.tokenize(piece)] == encoder.tokenize(text)


def test_a_long_new_state_is_tokenized_in_pieces_at_once(tiny_engine, monkeypatch) -> None:
    encoder = tiny_engine.encoder
    state = " ".join(f"the word{i % 7} is alpha, then beta: {i}." for i in range(3_000))  # ~100k characters
    batches: list[list[int]] = []  # the characters of each text, per call of the tokenizer
    monkeypatch.setattr(encoder, "_encode_batch", lambda texts, **options: batches.append(list(map(len, texts))) or
                        encoder._text.encode_batch(texts, **options))
    monkeypatch.setattr(encoding.os, "cpu_count", lambda: 8)
    record = tiny_engine.encode(dict(REQUEST, state=state), max_length=10**7)
    pieces = next(batch for batch in batches if sum(batch) == len(state))
    assert 6 <= len(pieces) <= 8  # one batch of about a piece per core
    monkeypatch.undo()
    start = len(encoder.prefix_ids)
    assert record.input_ids[start: record.state_end] == encoder.tokenize(state)


def test_another_pre_tokenizer_gets_its_states_tokenized_whole(tiny_release) -> None:
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    tokenizer = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    assert encoding.cuts_at_letter_spaces_are_exact(json.loads(tokenizer.to_str()))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\S+\s*"), behavior="isolated"),  # a space ends a pre-token: cuts would move it
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert not encoding.cuts_at_letter_spaces_are_exact(json.loads(tokenizer.to_str()))
