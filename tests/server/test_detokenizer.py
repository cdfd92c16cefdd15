"""Incremental detokenization: deltas add up to the full decode, characters split across
byte tokens are held back until complete; the server's side only forwards what is new (the
engine's stop-string holdback: tests/engine/test_llm_api.py)."""

from __future__ import annotations

import random

import pytest

from kvtier.engine.detokenizer import IncrementalDetokenizer, StreamText
from kvtier.model.tokenizer import Tokenizer, build_byte_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("byte_tok")
    build_byte_tokenizer(d)
    return Tokenizer(d)


def deltas(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    out = [detok.push([t]) for t in ids]
    out.append(detok.flush())
    return out


def test_multibyte_characters_split_across_tokens(tok):
    text = "naïve 日本 🦊!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    parts = deltas(IncrementalDetokenizer(tok), ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)  # nothing sent half-formed
    # the 4-byte fox arrives as one delta, with its last byte
    last_byte = len(text[: text.index("🦊")].encode()) + 3
    assert parts[last_byte - 3 : last_byte + 1] == ["", "", "", "🦊"]


def test_random_bytes_match_the_full_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(0, 262) for _ in range(rng.randrange(1, 40))]  # bytes and specials
        detok = IncrementalDetokenizer(tok)
        pushed = []
        i = 0
        while i < len(ids):  # several tokens per step, sometimes
            k = rng.randrange(1, 4)
            pushed.append(detok.push(ids[i : i + k]))
            i += k
        pushed.append(detok.flush())
        assert "".join(pushed) == tok.decode(ids)


def test_stream_text_forwards_what_is_new_and_trusts_the_final_text():
    st = StreamText()
    assert [st.update(t) for t in ("he", "he", "hello", "hello wo")] == ["he", "", "llo", " wo"]
    assert st.finish("hello world") == "rld"
    st = StreamText()
    st.update("hello wor")
    assert st.finish("hello ") == ""  # not expected (the engine holds text back): nothing unsent
    assert StreamText().finish("") == ""
