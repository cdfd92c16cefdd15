"""Incremental detokenization: the new text of a growing token sequence, one step at a time.

Decoding the whole output every step costs O(length) per token; this decodes a short window::

    token_ids:  [ ............ sent ............ | window ...... ]
                                   prefix_offset ^   read_offset ^   ^ len(token_ids)
    new text  = decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])

The window starts one step back so that tokenizers whose pieces depend on their neighbour
(SentencePiece's leading space) decode as they would in the full text. A window whose text ends
in U+FFFD is an incomplete multi-byte character (a byte-level tokenizer split it across tokens):
it is held back until the next token completes it, or until `flush` at the end.

Stop strings: the engine cuts the final text at a stop string that may span tokens already
seen, so while a sequence with stop strings runs its last `max(len(stop)) - 1` characters are
held back too (EngineCore._output).

Where it runs: in the engine, once per token, for requests whose text is streamed or has stop
strings (the only ones that need text before the end); the server only forwards text deltas
(`StreamText`). Every other request is decoded once, whole, when it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger("kvtier.server")

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        """All text returned so far."""

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None or not new_token_ids:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text held back (an incomplete character at the very end)."""
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StreamText:
    """The text of one output sequence as a stream of deltas, on the server's side.

    The engine decodes (`IncrementalDetokenizer`, for requests added with `stream`) and hands
    each running output's text as far as it is final; `update(text)` returns what is new since
    the last call, and `finish(final_text)` the rest, given the engine's final text (the
    authority, decoded whole once: stop strings are cut from it)."""

    def __init__(self) -> None:
        self.sent = ""

    def update(self, text: str) -> str:
        if len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):  # not expected: what was sent cannot be unsent
            logger.warning("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final_text[-40:])
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
