"""OpenAI's Responses API, `POST /v1/responses`, served through the chat path.

A Responses request becomes a ChatCompletionRequest (input items -> messages, `instructions`
-> a first system message, function tools -> chat tools, `text.format` -> response_format)
and goes through `OpenAIServing.chat`: the same template rendering, sampling, structured
outputs, tool calls, request limits, metrics and disconnect handling as /v1/chat/completions.
The route runs under the chat route's key check, per-key limits and body limit. Its answer
is rebuilt in the Responses shape::

    chat body  {choices[0].message.content, .tool_calls, finish_reason, usage}
      -> response {output: [message(output_text)?, function_call*], status, usage}
    chat SSE   role, content deltas, tool calls at the end, usage chunk, [DONE]
      -> events  response.created, response.in_progress,
                 (output_item.added, content_part.added, output_text.delta*, output_text.done,
                  content_part.done, output_item.done) for the text,
                 (output_item.added, function_call_arguments.delta, .done, output_item.done)
                  per tool call, response.completed

Supported:
- `input`: a string (one user message) or a list of items: messages (`role` user, system,
  developer (rendered as system), assistant; `content` a string or a list of input_text /
  output_text parts), `function_call` and `function_call_output` items (a tool loop sends
  back the previous response's output and the tool results), `reasoning` items (their text
  goes to the template as the assistant message's `reasoning`, as vLLM).
- `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `user`,
  `parallel_tool_calls` (as the chat endpoint takes it), `truncation` ("auto": the prompt's
  oldest tokens are cut to fit, vLLM's truncate_prompt_tokens=-1), `top_logprobs` and
  `include: ["message.output_text.logprobs"]`.
- `tools`: function tools `{type: function, name, description, parameters}`; `tool_choice`
  none, auto (needs --enable-auto-tool-choice --tool-call-parser, as chat), required, or
  `{type: function, name}`.
- `text.format`: text, json_object, json_schema (`schema`, `name`, `strict`): chat's
  response_format.
- vLLM's extra sampling fields, as in chat: top_k, min_p, repetition_penalty, seed, stop,
  ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, include_stop_str_in_output,
  priority, cache_salt, logit_bias, bad_words, allowed_token_ids, structured_outputs, and
  request_id (the response's id is then resp_<it>, as with an X-Request-Id header).
- `reasoning.effort` goes to the chat template as `reasoning_effort` (as vLLM); kvtier has
  no reasoning parser, so a warning is logged, no reasoning items come back and
  `output_tokens_details.reasoning_tokens` is 0.
- `metadata` is echoed; `store` is accepted and nothing is stored (vLLM without
  VLLM_ENABLE_RESPONSES_API_STORE does the same).

Refused with a 400 naming the field: `previous_response_id` and `conversation` (kvtier keeps
no responses: send the earlier items in `input`), `background`, `prompt` (templates),
`item_reference` items, tools other than functions, non-text input parts (images, files,
audio), `encrypted_content` in reasoning items. Fields the request does not know are logged
as ignored (a 400 under --strict-request-fields), as in chat; `max_tool_calls`, `include`
values other than output_text logprobs and `text.verbosity` are logged as ignored.

The response: `id` resp_..., `object` response, `created_at`, `status` completed, incomplete
(`incomplete_details.reason` max_output_tokens, also when the context ran out) or cancelled
(the engine aborted it), the request's settings echoed, `output`, `usage` (input_tokens,
input_tokens_details.cached_tokens and kvtier's cached_tokens_by_tier, output_tokens,
output_tokens_details.reasoning_tokens 0, total_tokens) and chat's `kvtier` extras. A
stream ends with response.completed whatever the status (as vLLM; the response in it says
incomplete), or, when decoding fails after the 200 was sent, with an `error` event and
response.failed.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvtier.server.protocol import (
    KNOWN_NEUTRAL_FIELDS,
    APIError,
    ChatCompletionRequest,
    Count,
    validation_error,
)
from kvtier.server.serving import OpenAIServing
from kvtier.server.tenancy import Tenant

logger = logging.getLogger("kvtier.server")

FORWARDED_FIELDS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "cache_salt",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "structured_outputs",
    "request_id",
)
"""vLLM's and kvtier's extra sampling fields, passed to the chat request as they are (it
validates them, and its 400s name them)."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"

NO_STORE = (
    "kvtier does not keep responses (there is no response store), so {field} cannot be "
    "resolved: send the conversation so far in `input` instead (the earlier messages, the "
    "previous response's `output` items and any function_call_output items)"
)

# chat's field names in its 400s -> the Responses field the client sent
_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "truncate_prompt_tokens": "truncation",
    "chat_template_kwargs": "reasoning",
}


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses (see the module docstring for what each field does).
    Strict as chat's; fields it does not know stay in `model_extra`."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: Count | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Count | None = None
    prompt: Any = None
    stream_options: dict[str, Any] | None = None

    def forwarded(self) -> dict[str, Any]:
        """The extra sampling fields the body gives (FORWARDED_FIELDS)."""
        extra = self.model_extra or {}
        return {k: extra[k] for k in FORWARDED_FIELDS if k in extra}

    def ignored_fields(self) -> list[str]:
        extra = self.model_extra or {}
        return sorted(k for k in extra if k not in FORWARDED_FIELDS and k not in KNOWN_NEUTRAL_FIELDS)


def install_responses_api(
    app: FastAPI,
    serving: OpenAIServing,
    tenant_of: Callable[[Request], Tenant],
    limited: Callable[[Request, Callable[[], Awaitable[Response]]], Awaitable[Response]],
    read_json: Callable[..., Awaitable[Any]],
    max_body_bytes: int,
) -> None:
    """POST /v1/responses on `app`, under the same key check (`tenant_of`), per-key limits and
    stream stall bound (`limited`) and body reader and limit (`read_json`, `max_body_bytes`) as
    /v1/chat/completions (the app passes its own: this module does not import it back)."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tenant = tenant_of(request)

        async def handle() -> Response:
            req = await read_json(request, max_body_bytes, then=_validate)
            return await create_response(serving, req, tenant, request)

        return await limited(request, handle)


def _validate(body: dict[str, Any]) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError("the body is nested too deeply to validate", 400, code="invalid_json") from None


async def create_response(serving: OpenAIServing, req: ResponsesRequest, tenant: Tenant, raw: Request) -> Response:
    """The response to `req`: a JSON body, or an SSE stream of Responses events."""
    _check(req, serving.strict_request_fields)
    chat = _chat_request(req)
    echo = _echo(req, req.model if req.model and serving.for_model(req.model) else serving.model_name)
    try:
        answer = await serving.chat(chat, tenant, raw)
    except APIError as e:
        raise _renamed(e) from None
    if req.stream:
        stream: Any = answer  # serving's streaming response: its cleanup aborts the request
        stream.body_iterator = _events(stream.body_iterator, echo)
        return answer
    body = json.loads(bytes(answer.body))
    headers = {k: v for k, v in answer.headers.items() if k.lower() == "x-request-id"}
    return JSONResponse(_response_body(body, echo), headers=headers)


# ------------------------------------------------------------------ request
def _check(req: ResponsesRequest, strict: bool) -> None:
    """Refusals (fields kvtier cannot honour) and warnings (fields it ignores, as vLLM)."""
    if req.previous_response_id is not None:
        raise APIError(
            NO_STORE.format(field="previous_response_id"),
            param="previous_response_id",
            code="previous_response_not_supported",
        )
    if req.conversation is not None:
        raise APIError(NO_STORE.format(field="conversation"), param="conversation", code="conversation_not_supported")
    if req.background:
        raise APIError(
            "background responses are not supported by kvtier (they need a response store): "
            "leave background out, and use stream=true to read the output as it is generated",
            param="background",
        )
    if req.prompt is not None:
        raise APIError("prompt templates are not supported; send the text in `input`", param="prompt")
    ignored = req.ignored_fields()
    if ignored:
        shown = [name if len(name) <= 100 else name[:100] + "..." for name in ignored[:20]]
        if strict:
            import difflib

            hint = difflib.get_close_matches(ignored[0], [*ResponsesRequest.model_fields, *FORWARDED_FIELDS], n=1)
            raise APIError(
                f"unknown field {shown[0]!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; this server refuses fields it does not know (--strict-request-fields): {shown}",
                param=shown[0],
                code="unknown_field",
            )
        logger.warning("The following fields were present in the request but ignored: %s", set(shown))
    if req.max_tool_calls is not None:
        logger.warning("/v1/responses: max_tool_calls is ignored (kvtier runs no built-in tools)")
    other = sorted(set(req.include or ()) - {LOGPROBS_INCLUDE})
    if other:
        logger.warning("/v1/responses: include %s ignored (kvtier returns only output_text logprobs)", other)
    if req.text is not None and req.text.get("verbosity") not in (None, "medium"):
        logger.warning("/v1/responses: text.verbosity is ignored by kvtier")
    if req.reasoning is not None:
        logger.warning(
            "/v1/responses: kvtier has no reasoning parser: reasoning.effort only reaches the chat "
            "template (as reasoning_effort); no reasoning items are returned"
        )


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that produces `req`'s output."""
    messages = _messages(req.input)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise APIError("input is empty: give a string or a list of message items", param="input")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "user": req.user,
        **req.forwarded(),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools is not None:
        body["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = _response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    if LOGPROBS_INCLUDE in (req.include or ()) or req.top_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.truncation == "auto":
        body["truncate_prompt_tokens"] = -1
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise _renamed(validation_error(e)) from None


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from Responses input items (vLLM's construct_input_messages): function
    calls and reasoning join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        prev = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            msg = _message(i, item)
            if prev is not None and msg["role"] == "assistant" and prev.get("content") is None:
                prev["content"] = msg["content"]  # the text after its reasoning
            else:
                messages.append(msg)
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", i),
                "type": "function",
                "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i, empty=True)},
            }
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(i, item)
            if prev is not None and "reasoning" not in prev:
                prev["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif kind == "item_reference":
            raise APIError(NO_STORE.format(field="an item_reference"), param=f"input.{i}")
        else:
            raise APIError(
                f"input.{i}: item type {str(kind)[:40]!r} is not supported; kvtier takes message, "
                "function_call, function_call_output and reasoning items",
                param=f"input.{i}",
            )
    return messages


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(
            f"input.{i}.role must be user, system, developer or assistant, not {str(role)[:40]!r}",
            param=f"input.{i}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _text_of(content, f"input.{i}.content")
    return {"role": _ROLES[role], "content": text}


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(parts: Any, where: str) -> str:
    """The text of a list of content parts; a 400 for anything but text."""
    if not isinstance(parts, list):
        raise APIError(f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            shown = str(kind)[:40] if kind is not None else "a part without a type"
            raise APIError(
                f"{where}.{j}: {shown} is not supported: kvtier serves text models; send "
                '{"type": "input_text", "text": ...} parts',
                param=f"{where}.{j}",
            )
    return "".join(texts)


def _reasoning_text(i: int, item: dict[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise APIError(
            f"input.{i}: encrypted reasoning content is not supported; send its text in content",
            param=f"input.{i}.encrypted_content",
        )
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
            return str(parts[0]["text"])
    return ""


def _str(item: dict[str, Any], key: str, i: int, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise APIError(f"input.{i}.{key} must be a non-empty string", param=f"input.{i}.{key}")
    return value


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool as chat's {"type": "function", "function": {...}}."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(
            f"tools.{i}: {str(kind)[:40]!r} tools are not supported; kvtier serves function tools "
            '{"type": "function", "name": ..., "parameters": {...}}',
            param="tools",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"tools.{i}.name must be a non-empty string", param="tools")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError(f"tools.{i}.parameters must be a JSON schema object", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: chat checks the word
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        f"{str(choice.get('type'))[:40]!r} is not supported",
        param="tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError("text.format.schema must be a JSON schema object", param="text.format")
        spec = {k: fmt[k] for k in ("name", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": {**spec, "schema": schema}}
    raise APIError(
        f"text.format type {str(kind)[:40]!r} is not supported (text, json_object, json_schema)",
        param="text.format",
    )


def _renamed(e: APIError) -> APIError:
    """A chat 400 naming the Responses field instead (messages -> input, ...)."""
    if e.param is not None:
        head = e.param.partition(".")[0]
        if head in _PARAMS:
            e.param = _PARAMS[head]
    return e


# ------------------------------------------------------------------ response
def _echo(req: ResponsesRequest, model_name: str) -> dict[str, Any]:
    """The request's settings, as every response object repeats them."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "model": model_name,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": req.tools or [],
        "text": {"format": fmt},
        "reasoning": req.reasoning,
        "truncation": req.truncation or "disabled",
        "top_logprobs": req.top_logprobs,
        "user": req.user,
        "previous_response_id": None,
        "background": False,
    }


_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _response(
    response_id: str,
    created: int,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        **echo,
        "output": output,
        "usage": usage,
    }


def _response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cached_tokens_by_tier": details.get("cached_tokens_by_tier", {}),
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _response_body(chat: dict[str, Any], echo: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body as a response object."""
    choice = chat["choices"][0]
    message = choice["message"]
    status = _STATUS.get(choice["finish_reason"], "completed")
    calls = message.get("tool_calls") or []
    output = []
    text = message.get("content") or ""
    if text or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content")
        output.append(_message_item(_new_id("msg"), status, [_text_part(text, logprobs)]))
    output += [
        _call_item(_new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"], "completed")
        for call in calls
    ]
    body = _response(_response_id(chat["id"]), chat["created"], echo, status, output, _usage(chat.get("usage")))
    body["kvtier"] = chat.get("kvtier")
    return body


# ------------------------------------------------------------------ stream
def _chunk(sse: str) -> dict[str, Any] | None:
    """A chat SSE event's payload; None for [DONE]."""
    data = sse.removeprefix("data:").strip()
    return None if data == "[DONE]" else json.loads(data)


class _EventWriter:
    """Responses SSE events, numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _events(chunks: AsyncIterator[Any], echo: dict[str, Any]) -> AsyncIterator[str]:
    """The chat stream `chunks` (SSE strings) as Responses events."""
    event = _EventWriter()
    first = _chunk(await anext(chunks))  # the role chunk: it names the request (at once)
    chat_id = first.get("id") if first else None
    response_id = _response_id(chat_id) if isinstance(chat_id, str) else _new_id("resp")
    created = first.get("created", 0) if first else 0

    def response(status: str, output: list[dict[str, Any]], usage: Any = None, error: Any = None) -> dict[str, Any]:
        return _response(response_id, created, echo, status, output, usage, error)

    yield event("response.created", response=response("in_progress", []))
    yield event("response.in_progress", response=response("in_progress", []))
    output = _StreamedOutput(event)
    finish: str | None = None
    usage = None
    data = first
    while data is not None:
        if "error" in data:  # decoding failed after the 200: the stream ends with it
            err = data["error"]
            yield event("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param"))
            error = {"code": "server_error", "message": err.get("message", "")}
            yield event("response.failed", response=response("failed", output.done, error=error))
            return
        if data.get("usage"):  # the last one (the usage chunk) counts the whole request
            usage = _usage(data["usage"])
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            for out in output.text(delta.get("content") or "", logprobs):
                yield out
            for call in delta.get("tool_calls") or []:
                for out in output.tool_call(call):
                    yield out
            finish = choice.get("finish_reason") or finish
        try:
            data = _chunk(await anext(chunks))
        except StopAsyncIteration:
            break
    status = _STATUS.get(finish or "", "completed")
    for out in output.close(status):
        yield out
    yield event("response.completed", response=response(status, output.done, usage))


class _StreamedOutput:
    """A stream's output items, one open at a time as OpenAI sends them: text opens a message
    item, a tool call's first delta a function_call item; each is done when the next opens,
    the last at the end. Logprobs of tokens that made no text yet go with the next text."""

    def __init__(self, event: _EventWriter) -> None:
        self.event = event
        self.done: list[dict[str, Any]] = []
        """The finished items, in output order."""
        self.current: _MessageItem | _CallItem | None = None
        self.calls: dict[int, _CallItem] = {}
        """The chat stream's tool call index -> its item."""
        self.unsent_logprobs: list[dict[str, Any]] = []

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        self.unsent_logprobs += logprobs
        if not delta:
            return []
        out = []
        if not isinstance(self.current, _MessageItem):
            out += self._open(_MessageItem())
        assert isinstance(self.current, _MessageItem)
        lps, self.unsent_logprobs = self.unsent_logprobs, []
        return out + self.current.add(self.event, delta, lps)

    def tool_call(self, delta: dict[str, Any]) -> list[str]:
        """Events for a chat tool-call delta: the first of a call (index, id, function.name)
        opens its item, later ones add argument text."""
        index = delta.get("index", len(self.calls))
        fn = delta.get("function") or {}
        out = []
        item = self.calls.get(index)
        if item is None:
            item = self.calls[index] = _CallItem(delta.get("id") or _new_id("call"), fn.get("name", ""))
            out += self._open(item)
        arguments = fn.get("arguments") or ""
        if item is not self.current:  # an earlier call's fragment: the chat stream sends calls in order
            logger.warning("/v1/responses: arguments of a finished tool call arrived; the response has them")
            item.arguments += arguments
            return out
        return out + item.add(self.event, arguments)

    def close(self, status: str) -> list[str]:
        """The last item's done events (an empty message when there was no output at all)."""
        out = self._open(_MessageItem()) if self.current is None and not self.done else []
        if isinstance(self.current, _MessageItem) and self.unsent_logprobs:
            lps, self.unsent_logprobs = self.unsent_logprobs, []
            out += self.current.add(self.event, "", lps)
        return out + self._close(status)

    def _open(self, item: _MessageItem | _CallItem) -> list[str]:
        """`item` becomes the next output item, once the open one is done."""
        out = self._close("completed")
        item.ids["output_index"] = len(self.done)
        self.current = item
        return out + item.open(self.event)

    def _close(self, status: str) -> list[str]:
        if self.current is None:
            return []
        out, done = self.current.close(self.event, status)
        self.done.append(done)
        self.current = None
        return out


class _MessageItem:
    """A message item with one output_text part."""

    def __init__(self) -> None:
        self.ids: dict[str, Any] = {"item_id": _new_id("msg"), "output_index": 0}
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []

    def open(self, event: _EventWriter) -> list[str]:
        item = _message_item(self.ids["item_id"], "in_progress", [])
        return [
            event("response.output_item.added", output_index=self.ids["output_index"], item=item),
            event("response.content_part.added", **self.ids, content_index=0, part=_text_part("", None)),
        ]

    def add(self, event: _EventWriter, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        self.text += delta
        self.logprobs += logprobs
        return [event("response.output_text.delta", **self.ids, content_index=0, delta=delta, logprobs=logprobs)]

    def close(self, event: _EventWriter, status: str) -> tuple[list[str], dict[str, Any]]:
        part = _text_part(self.text, self.logprobs)
        done = _message_item(self.ids["item_id"], status, [part])
        return [
            event("response.output_text.done", **self.ids, content_index=0, text=self.text, logprobs=self.logprobs),
            event("response.content_part.done", **self.ids, content_index=0, part=part),
            event("response.output_item.done", output_index=self.ids["output_index"], item=done),
        ], done


class _CallItem:
    """A function_call item whose arguments stream as they are generated."""

    def __init__(self, call_id: str, name: str) -> None:
        self.ids: dict[str, Any] = {"item_id": _new_id("fc"), "output_index": 0}
        self.call_id, self.name = call_id, name
        self.arguments = ""

    def open(self, event: _EventWriter) -> list[str]:
        item = _call_item(self.ids["item_id"], self.call_id, self.name, "", "in_progress")
        return [event("response.output_item.added", output_index=self.ids["output_index"], item=item)]

    def add(self, event: _EventWriter, arguments: str) -> list[str]:
        if not arguments:
            return []
        self.arguments += arguments
        return [event("response.function_call_arguments.delta", **self.ids, delta=arguments)]

    def close(self, event: _EventWriter, status: str) -> tuple[list[str], dict[str, Any]]:
        done = _call_item(self.ids["item_id"], self.call_id, self.name, self.arguments, "completed")
        return [
            event("response.function_call_arguments.done", **self.ids, name=self.name, arguments=self.arguments),
            event("response.output_item.done", output_index=self.ids["output_index"], item=done),
        ], done
