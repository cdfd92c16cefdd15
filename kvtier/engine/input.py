"""Prompt-length rules of one engine, shared by EngineCore.add_request and the API server
(kvtier.server.serving), so that both refuse the same input with the same text.

The server applies them before it sends a request to the engine (thread or process), so that
usage, echo and the request log see the prompt the engine runs; the engine applies them again
for its other callers (LLM, tests). Each raises ValueError; the server turns it into a 400.
Plain functions of the model's context length: no torch, no engine state."""

from __future__ import annotations

from collections.abc import Iterable


def truncation_length(keep: int | None, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens `truncate_prompt_tokens=keep` keeps (vLLM's
    meaning; -1: the context less one output token); None: no truncation. ValueError when
    `keep` is not -1 or a positive integer, or leaves no room for an output token."""
    if keep is None:
        return None
    if not isinstance(keep, int) or (keep < 1 and keep != -1):
        raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {keep!r}")
    keep = max_model_len - 1 if keep == -1 else keep
    if keep >= max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({keep}) must be below this model's context of {max_model_len} tokens"
        )
    return keep


def truncate_prompt(prompt_token_ids: Iterable[int], keep: int | None, max_model_len: int) -> Iterable[int]:
    """The prompt's last `truncation_length(keep)` tokens (a list); the prompt itself, untouched,
    without truncation."""
    n = truncation_length(keep, max_model_len)
    if n is None:
        return prompt_token_ids
    return list(prompt_token_ids)[-n:]


def kept_prompt_tokens(num_tokens: int, keep: int | None, max_model_len: int) -> int:
    """How many tokens of a `num_tokens` prompt remain after truncate_prompt_tokens=`keep`."""
    n = truncation_length(keep, max_model_len)
    return num_tokens if n is None else min(num_tokens, n)


def output_room(num_prompt_tokens: int, max_model_len: int) -> int:
    """Output tokens that fit in the context after a prompt of `num_prompt_tokens`."""
    return max_model_len - num_prompt_tokens


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt leaves room for at least one output token."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens; this model's context is "
            f"{max_model_len} tokens (prompt plus at least one output token)"
        )


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The prompt plus `max_tokens` fits in the context (None: as many as fit)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens; use max_tokens <= {output_room(num_prompt_tokens, max_model_len)}"
        )
