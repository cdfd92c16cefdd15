"""OpenAI response bodies and SSE chunks from engine outputs (plain dicts, JSON-ready).

Extras beyond OpenAI's shape: `usage.prompt_tokens_details.cached_tokens_by_tier` and a
top-level `kvtier` object (restore decision, recomputed tokens, restore and first-token time).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.outputs import CompletionOutput, RequestOutput


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event (`data: ...` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def finish_reason(reason: str | None) -> str | None:
    return reason  # the engine already speaks OpenAI's words: 'stop', 'length' (and 'abort')


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    by_tier: dict[str, int] = {}
    for o in outs:
        for tier, n in o.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "cached_tokens_by_tier": by_tier,
        },
    }


def kvtier_extras(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """What the cache did for this request. With several prompts: `restore_decision` and
    `ttft_s` are the first prompt's, counts are summed, and `prompts` lists each."""
    first = outs[0]
    extras: dict[str, Any] = {
        "restore_decision": first.restore_decision,
        "num_recomputed_tokens": sum(o.num_recomputed_tokens for o in outs),
        "restore_s": sum(o.restore_s for o in outs),
        "num_preemptions": sum(o.num_preemptions for o in outs),
        "ttft_s": first.metrics.ttft_s,
    }
    if len(outs) > 1:
        extras["prompts"] = [
            {
                "restore_decision": o.restore_decision,
                "num_cached_tokens": o.num_cached_tokens,
                "cached_tokens_by_tier": o.cached_tokens_by_tier,
                "num_recomputed_tokens": o.num_recomputed_tokens,
                "restore_s": o.restore_s,
                "ttft_s": o.metrics.ttft_s,
            }
            for o in outs
        ]
    return extras


# ------------------------------------------------------------------ logprobs
class TokenText:
    """Token id -> how logprobs name it (`__call__`: its text, special tokens shown) and its
    text (`text`: what text offsets and chat `bytes` count)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        return self.text(token_id)


class TokenIdText(TokenText):
    """vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:N` (text offsets
    still count the tokens' text)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def completion_logprobs(
    c: CompletionOutput, start: int, text_offset: int, token_text: TokenText
) -> dict[str, Any] | None:
    """Legacy completions logprobs of tokens[start:]; text offsets count from `text_offset`."""
    if c.logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    pos = text_offset
    for tid, top in zip(c.token_ids[start:], c.logprobs[start:]):
        tokens.append(token_text(tid))
        lps.append(top.get(tid))
        tops.append({token_text(t): lp for t, lp in top.items()})
        offsets.append(pos)
        pos += len(token_text.text(tid))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(o: RequestOutput, token_text: TokenText) -> dict[str, Any]:
    """Legacy completions logprobs of the prompt (echo): the first token has none."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = 0
    plp = o.prompt_logprobs or [None] * len(o.prompt_token_ids)
    for tid, top in zip(o.prompt_token_ids, plp):
        tokens.append(token_text(tid))
        lps.append(None if top is None else top.get(tid))
        tops.append(None if top is None else {token_text(t): lp for t, lp in top.items()})
        offsets.append(pos)
        pos += len(token_text.text(tid))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(o: RequestOutput, token_text: TokenText) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per position None or {token id: {logprob, decoded_token}}."""
    if o.prompt_logprobs is None:
        return None
    return [
        None
        if top is None
        else {
            str(t): {"logprob": float(lp), "rank": getattr(lp, "rank", None), "decoded_token": token_text(t)}
            for t, lp in top.items()
        }
        for top in o.prompt_logprobs
    ]


def chat_logprobs(c: CompletionOutput, start: int, num_top: int, token_text: TokenText) -> dict[str, Any] | None:
    """`bytes` of the chosen token are its text's (also as `token_id:N`, as vLLM), those of the
    top alternatives their names'."""
    if c.logprobs is None:
        return None
    content = []
    for tid, top in zip(c.token_ids[start:], c.logprobs[start:]):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(
            {
                "token": token_text(tid),
                "logprob": top.get(tid),
                "bytes": list(token_text.text(tid).encode("utf-8")),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode("utf-8"))}
                    for t, lp in ranked
                ],
            }
        )
    return {"content": content}


# ------------------------------------------------------------------ bodies
def completion_body(
    request_id: str,
    model: str,
    created: int,
    outs: Sequence[RequestOutput],
    n: int,
    token_text: TokenText,
    return_token_ids: bool = False,
    echo: bool = False,
    prompt_texts: Sequence[str] | None = None,
    echo_only: bool = False,
) -> dict[str, Any]:
    """`echo`: each choice's text (and logprobs) starts with its prompt's (`prompt_texts`);
    `echo_only` (max_tokens 0): it is the prompt's alone."""
    choices = []
    for p, o in enumerate(outs):
        for c in o.outputs:
            lp = completion_logprobs(c, 0, 0, token_text)
            text = c.text
            if echo and echo_only:
                text = prompt_texts[p] if prompt_texts is not None else ""
                lp = None if lp is None else echo_logprobs(o, token_text)
            elif echo:
                prompt = prompt_texts[p] if prompt_texts is not None else ""
                text = prompt + text
                if lp is not None:
                    head = echo_logprobs(o, token_text)
                    shift = len(prompt)
                    lp = {
                        "tokens": head["tokens"] + lp["tokens"],
                        "token_logprobs": head["token_logprobs"] + lp["token_logprobs"],
                        "top_logprobs": head["top_logprobs"] + lp["top_logprobs"],
                        "text_offset": head["text_offset"] + [x + shift for x in lp["text_offset"]],
                    }
            choice = {
                "index": p * n + c.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            if o.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(o, token_text)
            if return_token_ids:
                choice["prompt_token_ids"] = list(o.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(outs),
        "kvtier": kvtier_extras(outs),
    }


def chat_body(
    request_id: str,
    model: str,
    created: int,
    out: RequestOutput,
    num_top: int,
    token_text: TokenText,
    return_token_ids: bool = False,
    role: str = "assistant",
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = [
        {
            "index": c.index,
            "message": {"role": role, "content": c.text},
            "logprobs": chat_logprobs(c, 0, num_top, token_text),
            "finish_reason": finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    if return_token_ids:
        for choice, c in zip(choices, out.outputs):
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(c.token_ids)
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage([out]),
        "kvtier": kvtier_extras([out]),
    }
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(out, token_text)
    return body


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    reason: str | None,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }
    if reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    reason: str | None,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }
    if reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(request_id: str, model: str, created: int, obj: str, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(outs),
        "kvtier": kvtier_extras(outs),
    }
