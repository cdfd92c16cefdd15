"""What the ingress hands an engine replica through Ray: one HTTP request of the OpenAI API,
whole, with the fields Ray's request routers read beside it (no Ray import here).

`prompt` (a completion: ForwardedCompletion) and `messages` (a chat: ForwardedChat) are the
request body's own fields, so Ray's `PrefixCacheAffinityRouter` reads them as it reads
ray.serve.llm's requests; `cache_salt` is
the salt the replica will key the request's blocks with (the tenant's, narrowed by the
request's `cache_salt`: kvtier.server.tenancy.Tenant.effective_salt), which the KV-event router
needs to compute the replica's block hashes. It travels inside the Ray cluster only; the
replica ignores it and resolves the tenant from the API key itself.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ForwardedRequest:
    """Any request but a completion or a chat one (admin calls, /v1/models, /tokenize ...)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    body_json: dict[str, Any] | None = None
    """The parsed body of a completions / chat request (None when it is not a JSON object: the
    replica answers the error)."""
    cache_salt: str | None = None
    """The effective salt of the request's blocks (see the module docstring)."""
    replica: str | None = None
    """A replica's full id: the request must go to that replica (an admin call fanned out to
    every replica); None: the router chooses."""


@dataclass
class ForwardedCompletion(ForwardedRequest):
    """A /v1/completions request. Only this class has `prompt`: Ray's PrefixCacheAffinityRouter
    takes the first of `messages` / `prompt` an argument has, even when it is None."""

    prompt: Any = None
    """The request's `prompt` (a string, token ids or a list of those)."""


@dataclass
class ForwardedChat(ForwardedRequest):
    """A /v1/chat/completions request (only this class has `messages`)."""

    messages: Any = None


def forwarded(path: str, **fields: Any) -> ForwardedRequest:
    """The ForwardedRequest for `path`, its prompt or messages read from the body."""
    obj, prompt, messages = None, None, None
    if fields.get("method") == "POST":
        obj, prompt, messages = parse_openai_body(path, fields.get("body", b""))
    if obj is not None and path == COMPLETIONS:
        return ForwardedCompletion(path=path, body_json=obj, prompt=prompt, **fields)
    if obj is not None and path == CHAT:
        return ForwardedChat(path=path, body_json=obj, messages=messages, **fields)
    return ForwardedRequest(path=path, **fields)


def prompt_of(req: Any) -> Any:
    """The completion's prompt or the chat's messages (None for any other request)."""
    if isinstance(req, ForwardedCompletion):
        return req.prompt
    if isinstance(req, ForwardedChat):
        return req.messages
    return None


def parse_openai_body(path: str, body: bytes) -> tuple[dict[str, Any] | None, Any, Any]:
    """(body object, prompt, messages) of a completions or chat request; (None, None, None) for
    any other path or a body that is not a JSON object."""
    if path not in (COMPLETIONS, CHAT):
        return None, None, None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None, None
    if not isinstance(obj, dict):
        return None, None, None
    if path == COMPLETIONS:
        return obj, obj.get("prompt"), None
    messages = obj.get("messages")
    return obj, None, messages if isinstance(messages, list) else None


def routing_token_ids(tokenizer: Any, req: ForwardedRequest) -> list[int] | None:
    """The prompt token ids the replica will compute for `req`, by kvtier's own code paths (the
    tokenizer's `encode` for a completion, `kvtier.server.serving.render_chat` then `encode`
    without special tokens for a chat); the first prompt of a batch. None where they cannot be
    known here (an invalid body, a prompt the replica will refuse): the router then balances
    by load."""
    if req.body_json is None or tokenizer is None:
        return None
    try:
        if isinstance(req, ForwardedCompletion):
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(tokenizer.encode(prompt))
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            return None
        from kvtier.server.protocol import ChatCompletionRequest
        from kvtier.server.serving import render_chat

        chat = ChatCompletionRequest.model_validate(req.body_json)
        if chat.chat_template is not None:
            return None  # a request's own template renders in the replica's sandbox only
        return list(tokenizer.encode(render_chat(tokenizer, chat), add_special_tokens=False))
    except Exception:  # noqa: BLE001 - the replica answers what is wrong with the request
        return None


_TOKENIZERS: dict[tuple[str, str | None], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def routing_tokenizer(model: str | None, chat_template: str | None) -> Any:
    """The tokenizer (with the replicas' chat template) that KVEventRouter hashes prompts with,
    loaded once per process: the ingress loads it while it starts (so a routed app is ready
    when Ray Serve says so), the router then finds it here. None when it cannot load (logged
    with the reason): the router then balances by load."""
    from kvtier.model.tokenizer import Tokenizer, has_tokenizer

    if model is None:
        return None
    key = (model, chat_template)
    with _TOKENIZERS_LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
        tokenizer = None
        try:
            if has_tokenizer(model):
                tokenizer = Tokenizer(model)
                if chat_template is not None:
                    from kvtier.cli.serve import use_chat_template

                    use_chat_template(tokenizer, chat_template)
        except Exception:  # without a tokenizer the router balances by load (logged with the reason)
            logging.getLogger("kvtier.ray_serve.router").exception(
                "KVEventRouter: the tokenizer of %s did not load; routing by load only", model
            )
            tokenizer = None
        _TOKENIZERS[key] = tokenizer
        return tokenizer


def loaded_routing_tokenizer(model: str | None, chat_template: str | None) -> Any:
    """`routing_tokenizer`'s tokenizer if this process has loaded it already, else None (a plain
    read: while the ingress is still loading it, the caller's own thread waits on the lock)."""
    return _TOKENIZERS.get((model, chat_template)) if model is not None else None
