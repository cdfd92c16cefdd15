"""OpenAI requests -> engine requests, and their outputs back as bodies or SSE streams.

Every handler follows one path::

    check model and fields -> prompts (token ids) -> SamplingParams -> engine.add (all or none)
      -> stream:     SSE chunks as outputs arrive (abort on disconnect: the response's cleanup)
      -> non-stream: wait for the final outputs, racing the client's disconnect

A `model` that names a LoRA adapter takes the same path on a view of the server whose requests
run the adapter and whose answers carry its name (`OpenAIServing.for_model`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtier.engine.client import EngineClient, EngineDeadError, EngineStepError, RequestSpec, RequestStream
from kvtier.engine.detokenizer import StreamText
from kvtier.engine.input import kept_prompt_tokens, output_room, truncate_prompt
from kvtier.outputs import RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.server import responses as R
from kvtier.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, _SamplingFields
from kvtier.server.tenancy import Tenant, tenant_hash

if TYPE_CHECKING:
    from kvtier.lora import LoRARequest
    from kvtier.server.lora_adapters import LoRAAdapters
    from kvtier.server.template_procs import TemplateProcesses

logger = logging.getLogger("kvtier.server")

Prompt = tuple[str | None, list[int]]

DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
DEFAULT_MAX_SEQS_PER_REQUEST = 256


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine, so that one client cannot hold up the others."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    """Prompts in one /v1/completions batch (`prompt` as a list of strings or token lists)."""
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    """Sequences one request generates: prompts x `n`."""
    max_stop: int = 128
    """`stop` strings (OpenAI takes 4, vLLM any number; every stream scans each one per
    chunk; lm-eval and the SDKs send a handful)."""
    max_stop_token_ids: int = 256
    """`stop_token_ids` (each checked against every new token; a model has a few stop tokens)."""
    max_bad_words: int = SamplingParams.MAX_BAD_WORDS
    """`bad_words` (1024; each is tokenized twice, on the API server; vLLM sets no bound, lists
    in use have tens to hundreds)."""
    max_logit_bias: int = 1024
    """`logit_bias` entries (OpenAI takes up to 300 tokens)."""
    max_allowed_token_ids: int | None = None
    """`allowed_token_ids`; None: the tokenizer's vocabulary size (a longer list repeats ids),
    or 262144 without a tokenizer."""
    max_messages: int = 4096
    """Chat `messages` (long agent sessions run to hundreds; the body and context bound the rest)."""
    max_tools: int = 128
    """Chat `tools` (OpenAI's own limit is 128 functions)."""


class OpenAIServing:
    strict_request_fields: bool = False
    """--strict-request-fields: a field the request model does not know is a 400 naming it,
    not a warning in the log (OpenAI's bookkeeping fields, protocol.KNOWN_NEUTRAL_FIELDS, pass)."""

    on_structured_error: Callable[[str], None] | None = None
    """Called with a reason for each structured-outputs constraint refused before it ran (the
    app's kvtier:structured_output_errors_total)."""
    _grammar_checker: Any = None
    """A kvtier.structured.GrammarCompiler for this tokenizer: the pre-validation's (cached)."""
    return_tokens_as_token_ids: bool = False
    """--return-tokens-as-token-ids: logprobs name tokens `token_id:N` unless a request's
    `return_tokens_as_token_ids` says otherwise."""
    response_role: str = "assistant"
    """--response-role: the role of chat replies when add_generation_prompt is true (else the
    last message's role)."""
    force_include_usage: bool = False
    """--enable-force-include-usage: streams carry usage in every chunk and at the end, asked
    for or not (vLLM's meaning)."""
    request_logger: Any = None
    """--enable-log-requests: a kvtier.server.request_log.RequestLogger, or None."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        request_log: Any = None,
        limits: RequestLimits | None = None,
        model_aliases: tuple[str, ...] = (),
        on_added: Callable[[str, int | None], None] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self.template_procs: TemplateProcesses | None = None
        """Renders request templates in worker processes (started at the first one)."""
        if trust_request_chat_template:
            from kvtier.server.template_procs import TemplateProcesses

            self.template_procs = TemplateProcesses()
        """--trust-request-chat-template: requests may carry their own `chat_template`."""
        self.request_log = request_log
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_names = (model_name, *model_aliases)
        self.on_added = on_added
        self.structured_defaults: dict[str, Any] = {}
        """--structured-outputs-config's disable_any_whitespace / disable_additional_properties."""
        self.tool_parser: Any = None
        """--enable-auto-tool-choice --tool-call-parser NAME: a kvtier.server.tools.ToolParser."""
        self.defaults = dict(sampling_defaults or {})
        """generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and
        max_tokens, for what a request leaves out (vLLM's --generation-config auto)."""
        """on_added(engine request id, max_tokens) for each request the engine took."""
        self.max_model_len = max_model_len
        self.adapters: LoRAAdapters | None = None
        """The LoRA adapters requests may name as `model` (kvtier.server.lora_adapters)."""
        self.lora_request: LoRARequest | None = None
        """The adapter every request of this serving runs with: set only on an adapter's view
        (`for_model`), None for the base model."""
        self._views: dict[str, OpenAIServing] = {}
        self.limits = limits or RequestLimits()
        self.token_text = R.TokenText(tokenizer)
        self.token_id_text = R.TokenIdText(tokenizer)
        chars_per_token = getattr(tokenizer, "max_chars_per_token", None)
        self.max_text_chars: int | None = None if chars_per_token is None else max_model_len * chars_per_token
        """Longer text cannot fit in the context whatever it tokenizes to: rejected untokenized."""

    # ------------------------------------------------------------------ before validation
    def precheck_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """O(1) checks of a parsed /v1/completions body before anything walks it: too many
        prompts, or a token list longer than the context, is a 400 without touching each item."""
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return body
        if isinstance(prompt[0], (str, list)):
            self._check_num_prompts(len(prompt))
        elif len(prompt) > self.max_model_len and body.get("truncate_prompt_tokens") is None:
            raise _too_long(
                f"the prompt has {len(prompt)} token ids; this model's context is {self.max_model_len} tokens", "prompt"
            )
        return body

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest, tenant: Tenant, raw: Request) -> Response:
        adapter = self.for_model(req.model)
        if adapter is not None:
            return await adapter.completions(req, tenant, raw)
        self._check_common(req)
        texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
        num_prompts = 1 if isinstance(req.prompt, str) or _is_token_list(req.prompt) else len(req.prompt)
        self._check_num_prompts(num_prompts)
        self._check_num_seqs(num_prompts, req.n)
        if req.truncate_prompt_tokens is None:  # else cut to fit once tokenized
            for text in texts:
                self._check_text_fits(text, "prompt")
        prompts = await _off_loop(self._completion_prompts, req.prompt, chars=sum(map(len, texts)))
        request_id, engine_id, headers = _request_ids("cmpl", raw, req.request_id)
        prompts = self._truncate(prompts, req.truncate_prompt_tokens)
        echo_only = req.echo and req.max_tokens == 0  # the prompt alone: one token made and dropped
        if req.max_tokens == 0 and not req.echo:
            raise APIError(
                "max_tokens 0 generates nothing: it goes with echo=true (the prompt back, with its "
                "logprobs when `logprobs` is set)",
                param="max_tokens",
            )
        params = [self._params(req, ids, 1 if echo_only else req.max_tokens, req.logprobs) for _, ids in prompts]
        await self._check_structured(params, req.structured()[1])
        if req.echo and req.logprobs is not None:  # the prompt's logprobs come back with it
            for sp in params:
                sp.prompt_logprobs = max(sp.prompt_logprobs or 0, req.logprobs)
        streams = await self._add(engine_id, prompts, params, req, tenant, stream=req.stream)
        created = int(time.time())
        token_text = self._token_text(req)
        echo_texts = None
        if req.echo:
            echo_texts = [
                text if text is not None else (self.tokenizer.decode(ids, False) if self.tokenizer is not None else "")
                for text, ids in prompts
            ]
        if req.stream:
            include_usage, continuous = self._usage_options(req)
            gen = self._stream_completion(
                request_id,
                created,
                streams,
                params,
                include_usage,
                req.return_token_ids,
                continuous,
                token_text,
                _Echo(echo_texts, echo_only) if echo_texts is not None else None,
            )
            return _streaming(gen, self.engine, streams, headers)
        outs = await self._wait_final(streams, raw)
        return JSONResponse(
            R.completion_body(
                request_id,
                self.model_name,
                created,
                outs,
                req.n,
                token_text,
                req.return_token_ids,
                echo=req.echo,
                prompt_texts=echo_texts,
                echo_only=echo_only,
            ),
            headers=headers,
        )

    def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif _is_token_list(prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt is empty; give a string, a list of token ids, or a list of those", param="prompt")
        out: list[Prompt] = []
        for p in items:
            if isinstance(p, str):
                out.append((p, self._encode(p)))
            else:
                if not p:
                    raise APIError("a prompt is an empty list of token ids", param="prompt")
                out.append((None, list(p)))
        return out

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer (no tokenizer.json); send token ids", param="prompt")
        return self.tokenizer.encode(text)

    async def _stream_completion(
        self,
        request_id: str,
        created: int,
        streams: list[RequestStream],
        params: list[SamplingParams],
        include_usage: bool,
        return_token_ids: bool = False,
        continuous_usage: bool = False,
        token_text: R.TokenText | None = None,
        echo: _Echo | None = None,
    ) -> AsyncIterator[str]:
        # a chunk per engine step with new tokens whenever the client can use one without text:
        # logprobs or token ids asked for, or no tokenizer (every text delta empty), as vLLM does
        per_step = return_token_ids or self.tokenizer is None
        token_text = token_text or self.token_text
        finals: list[RequestOutput | None] = [None] * len(streams)
        texts: dict[int, StreamText] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        echoed: set[int] = set()
        async for p, out in _merged(streams):
            sp = params[p]
            for c in out.outputs:
                idx = p * sp.n + c.index
                if idx in done:
                    continue
                if c.finish_reason == "error":  # no "stop" chunk: the stream ends with the error
                    raise StructuredOutputFailed(_structured_failure(c))
                # echo: the prompt (and its logprobs, which come with the first tokens) opens the
                # choice; until then nothing of it is sent (outputs are cumulative: no loss)
                head, head_lp = "", None
                if echo is not None and idx not in echoed:
                    if (echo.only and not c.finished) or (
                        sp.logprobs is not None and out.prompt_logprobs is None and not out.finished
                    ):
                        continue
                    head = echo.texts[p]
                    head_lp = R.echo_logprobs(out, token_text) if sp.logprobs is not None else None
                    echoed.add(idx)
                st = texts.get(idx)
                if st is None:
                    st = texts[idx] = StreamText()
                delta = st.finish(c.text) if c.finished else st.update(c.text)
                if echo is not None and echo.only:
                    delta = ""  # the one token made is dropped
                start = sent_tokens.get(idx, 0)
                new_tokens = len(c.token_ids) > start
                if not (head or delta or c.finished or (new_tokens and (per_step or sp.logprobs is not None))):
                    continue
                shift = len(echo.texts[p]) if echo is not None else 0
                lp = (
                    None
                    if echo is not None and echo.only
                    else R.completion_logprobs(c, start, shift + len(st.sent) - len(delta), token_text)
                )
                if head_lp is not None:
                    lp = head_lp if lp is None else {k: head_lp[k] + lp[k] for k in head_lp}
                sent_tokens[idx] = len(c.token_ids)
                if c.finished:
                    done.add(idx)
                chunk = R.completion_chunk(
                    request_id,
                    self.model_name,
                    created,
                    idx,
                    head + delta,
                    c.finish_reason,
                    lp,
                    c.stop_reason,
                    list(c.token_ids[start:]) if return_token_ids else None,
                )
                if continuous_usage:
                    chunk["usage"] = _running_usage(
                        len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
                    )
                yield R.sse(chunk)
            if out.finished:
                finals[p] = out
        if include_usage:
            yield R.sse(
                R.usage_chunk(
                    request_id, self.model_name, created, "text_completion", [f for f in finals if f is not None]
                )
            )
        yield R.SSE_DONE

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, req: ChatCompletionRequest, tenant: Tenant, raw: Request) -> Response:
        adapter = self.for_model(req.model)
        if adapter is not None:
            return await adapter.chat(req, tenant, raw)
        self._check_common(req)
        if self.tokenizer is None:
            raise APIError(
                "chat needs a tokenizer with a chat template; this model has no tokenizer.json", param="messages"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self._check_num_seqs(1, req.n)
        from kvtier.server import tools as T

        mode, fname = T.check_tools(req.tools, req.tool_choice)
        if mode == "auto" and req.tools and self.tool_parser is None:
            raise APIError(
                "tool_choice 'auto' needs the server started with --enable-auto-tool-choice "
                "--tool-call-parser NAME (as vLLM); or use 'required', a named function or "
                "'none'",
                param="tool_choice",
            )
        tool_spec = T.constraint(req.tools or [], mode, fname)
        if tool_spec is not None and req.structured()[0] is not None:
            raise APIError(
                f"tool_choice {mode!r} constrains the output, and so does {req.structured()[1]}: give one",
                param="tool_choice",
            )
        chars = sum(
            len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
            for m in req.messages
            if m.content is not None
        )
        chars += len(json.dumps(req.tools)) if req.tools and mode != "none" else 0
        ids = await _off_loop(
            self._encode_chat,
            req,
            mode != "none",
            chars=chars + 64 * len(req.messages),
            render=True,
            untrusted=req.chat_template is not None and self.trust_request_chat_template,
        )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = req.top_logprobs or 0
        ids = self._truncate([(None, ids)], req.truncate_prompt_tokens)[0][1]
        # a parser whose call markers are special tokens reads them in the text, as vLLM keeps them
        keep = mode == "auto" and bool(getattr(self.tool_parser, "keep_special_tokens", False))
        params = [self._params(req, ids, max_tokens, num_top if req.logprobs else None, tool_spec, keep)]
        await self._check_structured(params, "tool_choice" if tool_spec is not None else req.structured()[1])
        tool_state = (mode, fname, T.for_request(self.tool_parser, req.tools) if mode == "auto" else None)
        request_id, engine_id, headers = _request_ids("chatcmpl", raw, req.request_id)
        streams = await self._add(
            engine_id, [(None, ids)], params, req, tenant, prompt_param="messages", stream=req.stream
        )
        created = int(time.time())
        role = self.response_role if req.add_generation_prompt else req.messages[-1].role
        echo = _chat_echo(req, role)
        if req.stream:
            include_usage, continuous = self._usage_options(req)
            gen = self._stream_chat(
                request_id,
                created,
                streams[0],
                params[0],
                num_top,
                include_usage,
                req.return_token_ids,
                continuous,
                kept_prompt_tokens(len(ids), params[0].truncate_prompt_tokens, self.max_model_len),
                tool_state,
                _ChatReply(role, echo, self._token_text(req)),
            )
            return _streaming(gen, self.engine, streams, headers)
        outs = await self._wait_final(streams, raw)
        body = R.chat_body(
            request_id,
            self.model_name,
            created,
            outs[0],
            num_top,
            self._token_text(req),
            req.return_token_ids,
            role=role,
        )
        for choice in body["choices"]:
            content, calls = T.tool_message(choice["message"]["content"], *tool_state)
            choice["message"]["content"] = content  # the text itself when no calls (harmony: its content)
            if calls:
                choice["message"]["tool_calls"] = [c.body() for c in calls]
                if choice["finish_reason"] == "stop" and tool_state[0] != "named":
                    choice["finish_reason"] = "tool_calls"  # auto, required; a named call stays "stop" (vLLM, OpenAI)
            if echo:
                choice["message"]["content"] = echo + (choice["message"]["content"] or "")
        return JSONResponse(body, headers=headers)

    def _encode_chat(self, req: ChatCompletionRequest, with_tools: bool = True) -> list[int]:
        """Render the template, check the text can fit, then tokenize (the template can drop
        or add text, so the bound is checked on what it renders). A request's `chat_template`
        needs --trust-request-chat-template; `chat_template_kwargs` may not set the template's
        own variables. Rendering is bounded (kvtier.model.tokenizer.RenderLimits): a template
        over its size, loop or time limits is a 400 naming `chat_template` (the request's) or
        `messages` (the model's)."""
        from jinja2 import TemplateError

        from kvtier.model.tokenizer import RESERVED_TEMPLATE_NAMES, TokenizerError

        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "chat_template: this server does not render request-supplied chat templates; "
                "start it with --trust-request-chat-template to allow them, or leave chat_template "
                "out to use the model's",
                param="chat_template",
            )
        clash = sorted(RESERVED_TEMPLATE_NAMES.intersection(req.chat_template_kwargs or {}))
        if clash:
            raise APIError(
                f"chat_template_kwargs cannot set {', '.join(clash)}: those are the chat template's "
                "own variables (pass a template with chat_template instead)",
                param="chat_template_kwargs",
            )
        messages = [m.for_template() for m in req.messages]
        try:
            if req.chat_template is not None and self.template_procs is not None:
                text = self.template_procs.render(  # in a worker process: it shares no GIL with the server
                    req.chat_template,
                    self.tokenizer.bos_token,
                    self.tokenizer.eos_token,
                    messages,
                    req.add_generation_prompt,
                    req.tools if with_tools else None,
                    req.continue_final_message,
                    dict(req.chat_template_kwargs or {}),
                )
            else:
                text = render_chat(self.tokenizer, req, with_tools)
        except TemplateError as e:
            where = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(f"the chat template failed on these messages: {e}", param=where) from None
        except TokenizerError as e:
            raise APIError(str(e), param="messages") from None
        self._check_text_fits(text, "messages", what="the rendered chat")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _stream_chat(
        self,
        request_id: str,
        created: int,
        stream: RequestStream,
        sp: SamplingParams,
        num_top: int,
        include_usage: bool,
        return_token_ids: bool = False,
        continuous_usage: bool = False,
        num_prompt_tokens: int = 0,
        tool_state: tuple[str, str | None, Any] = ("none", None, None),
        reply: _ChatReply | None = None,
    ) -> AsyncIterator[str]:
        from kvtier.server.tools import ToolStream

        reply = reply or _ChatReply("assistant", "", self.token_text)
        token_text = reply.token_text
        tool_streams = {i: ToolStream(*tool_state) for i in range(sp.n)}
        texts: dict[int, StreamText] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        final: RequestOutput | None = None
        for i in range(sp.n):  # the role first, as OpenAI does
            texts[i] = StreamText()
            chunk = R.chat_chunk(request_id, self.model_name, created, i, {"role": reply.role, "content": ""}, None)
            if continuous_usage:
                chunk["usage"] = _running_usage(num_prompt_tokens, 0)
            yield R.sse(chunk)
        for i in range(sp.n if reply.echo else 0):  # echo: the last message's content, as vLLM
            chunk = R.chat_chunk(request_id, self.model_name, created, i, {"content": reply.echo}, None)
            if continuous_usage:
                chunk["usage"] = _running_usage(num_prompt_tokens, 0)
            yield R.sse(chunk)
        async for _, out in _merged([stream]):
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.finish_reason == "error":  # no "stop" chunk: the stream ends with the error
                    raise StructuredOutputFailed(_structured_failure(c))
                st = texts[c.index]
                delta = st.finish(c.text) if c.finished else st.update(c.text)
                start = sent_tokens.get(c.index, 0)
                new_tokens = len(c.token_ids) > start
                if not (delta or c.finished or (new_tokens and (return_token_ids or sp.logprobs is not None))):
                    continue
                lp = R.chat_logprobs(c, start, num_top, token_text)
                sent_tokens[c.index] = len(c.token_ids)
                if c.finished:
                    done.add(c.index)
                message: dict[str, Any] = {"content": delta} if delta else {}
                reason = c.finish_reason
                ts = tool_streams[c.index]
                if ts.active:  # tool calls: content outside calls, a call's name then its argument fragments
                    message = ts.step(delta, c.finished)
                    if c.finished and ts.called and reason == "stop" and ts.mode != "named":
                        reason = "tool_calls"  # vLLM, OpenAI: a named call stays "stop"
                    if not message and not c.finished and not (return_token_ids or sp.logprobs is not None):
                        continue
                chunk = R.chat_chunk(
                    request_id,
                    self.model_name,
                    created,
                    c.index,
                    message,
                    reason,
                    lp,
                    c.stop_reason,
                    list(c.token_ids[start:]) if return_token_ids else None,
                )
                if continuous_usage:
                    chunk["usage"] = _running_usage(num_prompt_tokens, sum(len(o.token_ids) for o in out.outputs))
                yield R.sse(chunk)
            if out.finished:
                final = out
        if include_usage and final is not None:
            yield R.sse(R.usage_chunk(request_id, self.model_name, created, "chat.completion.chunk", [final]))
        yield R.SSE_DONE

    # ------------------------------------------------------------------ /tokenize, /detokenize
    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /tokenize: `prompt` (with `add_special_tokens`, default true) or `messages`
        (the chat template, with `add_generation_prompt`, `continue_final_message`,
        `chat_template`, `chat_template_kwargs`); `return_token_strs` adds each token's text."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer (no tokenizer.json)", param="prompt")
        from kvtier.server.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        if "messages" in body:
            chat = _validated(TokenizeChatRequest, body)
            req = ChatCompletionRequest.model_validate(
                {
                    "messages": [m.model_dump() for m in chat.messages],
                    "add_generation_prompt": chat.add_generation_prompt,
                    "continue_final_message": chat.continue_final_message,
                    "chat_template": chat.chat_template,
                    "chat_template_kwargs": chat.chat_template_kwargs,
                }
            )
            chars = sum(
                len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
                for m in req.messages
                if m.content is not None
            )
            ids = await _off_loop(
                self._encode_chat,
                req,
                chars=chars + 64 * len(req.messages),
                render=True,
                untrusted=req.chat_template is not None and self.trust_request_chat_template,
            )
            want_strs = chat.return_token_strs
        else:
            plain = _validated(TokenizeCompletionRequest, body)
            self._check_text_fits(plain.prompt, "prompt")
            ids = await _off_loop(
                self.tokenizer.encode, plain.prompt, plain.add_special_tokens, chars=len(plain.prompt)
            )
            want_strs = plain.return_token_strs
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if want_strs:
            out["token_strs"] = [self.token_text(t) for t in ids]
        return out

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's config (special tokens, class) and its chat
        template, what a client-side tokenizer (lm-eval's `remote` backend) needs."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer (no tokenizer.json)")
        tok = self.tokenizer
        info: dict[str, Any] = {
            k: v
            for k, v in tok.config.items()
            if k not in ("added_tokens_decoder", "chat_template")
            and isinstance(v, (str, int, float, bool, type(None), list, dict))
        }
        info.update(
            {
                "tokenizer_class": info.get("tokenizer_class", "PreTrainedTokenizerFast"),
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "pad_token": info.get("pad_token"),
                "model_max_length": self.max_model_len,
                "chat_template": tok.chat_template,
            }
        )
        return info

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /detokenize: `tokens` (ids in the vocabulary) -> `prompt` (their text)."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer (no tokenizer.json)", param="tokens")
        from kvtier.server.protocol import DetokenizeRequest

        req = _validated(DetokenizeRequest, body)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await _off_loop(self.tokenizer.decode, req.tokens, False, chars=len(req.tokens))
        return {"prompt": text}

    # ------------------------------------------------------------------ shared
    def for_model(self, model: str | None) -> OpenAIServing | None:
        """This serving as the LoRA adapter `model` names: a copy whose requests run the adapter
        and whose answers carry its name (`model`), kept while the adapter stays loaded. None
        for no model, a base model name, a name nothing serves (_check_common's 404) and on a
        view already: the base model's path costs one lookup."""
        if model is None or model in self.model_names or self.adapters is None or self.lora_request is not None:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            self._views.pop(model, None)  # unloaded
            return None
        view = self._views.get(model)
        if view is None or view.lora_request is not lora:
            view = copy.copy(self)
            view.model_name, view.model_names, view.lora_request, view._views = model, (model,), lora, {}
            self._views[model] = view
        return view

    def _token_text(self, req: _SamplingFields) -> R.TokenText:
        """How this request's logprobs name tokens: `token_id:N` with return_tokens_as_token_ids
        (the request's, else the server's default), else their text."""
        as_ids = req.return_tokens_as_token_ids
        return (
            self.token_id_text if (self.return_tokens_as_token_ids if as_ids is None else as_ids) else self.token_text
        )

    def _usage_options(self, req: _SamplingFields) -> tuple[bool, bool]:
        return _usage_options(req, self.force_include_usage)

    def _truncate(self, prompts: list[Prompt], keep: int | None) -> list[Prompt]:
        """truncate_prompt_tokens applied here, before the engine sees the request (the engine's
        own rule, kvtier.engine.input.truncate_prompt), so that usage, echo and the request log
        see the prompt the engine runs. A cut prompt loses its text."""
        try:
            cut = [list(truncate_prompt(ids, keep, self.max_model_len)) for _, ids in prompts]
        except ValueError as e:
            raise APIError(str(e), param="truncate_prompt_tokens") from None
        return [(text, ids) if len(kept) == len(ids) else (None, kept) for (text, ids), kept in zip(prompts, cut)]

    def _check_num_prompts(self, num_prompts: int) -> None:
        limit = self.limits.max_prompts_per_request
        if num_prompts > limit:
            raise APIError(
                f"prompt is a batch of {num_prompts} prompts; this server takes at most "
                f"{limit} per request (--max-prompts-per-request): split the batch into "
                "several requests",
                param="prompt",
                code="too_many_prompts",
            )

    def _check_num_seqs(self, num_prompts: int, n: int) -> None:
        limit = self.limits.max_seqs_per_request
        if isinstance(n, int) and num_prompts * n > limit:
            raise APIError(
                f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; this "
                f"server generates at most {limit} per request (--max-seqs-per-request): "
                "lower n or split the batch",
                param="n",
                code="too_many_sequences",
            )

    def _check_text_fits(self, text: str, param: str, what: str = "the prompt") -> None:
        """A 400 for text longer than any tokenization of it that fits the context."""
        limit = self.max_text_chars
        if limit is not None and len(text) > limit:
            raise _too_long(
                f"{what} has {len(text)} characters; this model's context is "
                f"{self.max_model_len} tokens and no text over {limit} characters fits "
                f"it (a token is at most {limit // self.max_model_len} characters): "
                "shorten it",
                param,
            )

    def _check_common(self, req: _SamplingFields) -> None:
        """Model name, fields the model does not know (logged, or a 400 under
        --strict-request-fields), fields kvtier does not implement, list lengths (RequestLimits);
        then bad_words tokenized here, so the engine thread only indexes them."""
        if req.model is not None and req.model not in self.model_names:
            shown = req.model if len(req.model) <= 100 else req.model[:100] + "..."
            raise APIError(
                f"the model {shown!r} does not exist; this server serves {self.model_name!r} (see /v1/models)",
                404,
                param="model",
                code="model_not_found",
            )
        self._check_ignored_fields(req)
        if req.request_id is not None and not valid_request_id(req.request_id):
            raise APIError("request_id must be 1-128 printable ASCII characters without spaces", param="request_id")
        bad = req.unsupported()
        if bad:
            raise APIError(f"{bad[0]} is not supported by kvtier; leave it out (or at its default)", param=bad[0])
        lim = self.limits
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else 262144
        caps: list[tuple[str, Any, int]] = [
            ("stop", req.stop if isinstance(req.stop, list) else None, lim.max_stop),
            ("stop_token_ids", req.stop_token_ids, lim.max_stop_token_ids),
            ("bad_words", None if req.bad_words is None else set(req.bad_words), lim.max_bad_words),
            ("logit_bias", req.logit_bias, lim.max_logit_bias),
            ("allowed_token_ids", req.allowed_token_ids, lim.max_allowed_token_ids or vocab),
        ]
        if isinstance(req, ChatCompletionRequest):
            caps += [
                ("messages", req.messages, lim.max_messages),
                ("tools", req.tools, lim.max_tools),
            ]
        for name, value, cap in caps:
            if value is not None and len(value) > cap:
                what = "distinct entries" if name == "bad_words" else "entries"
                raise APIError(
                    f"{name} has {len(value)} {what}; this server takes at most {cap}",
                    param=name,
                    code="too_many_items",
                )
        if req.bad_words and self.tokenizer is not None:
            from kvtier.model.sampler import tokenize_bad_words

            if any(not w.strip() for w in req.bad_words):
                raise APIError("bad_words must be a list of non-empty strings", param="bad_words")
            req.bad_words_ids = tokenize_bad_words(
                req.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)
            )

    def _check_ignored_fields(self, req: _SamplingFields) -> None:
        """vLLM's warning for fields the request model does not know; a 400 when strict."""
        ignored = req.ignored_fields()
        if not ignored:
            return
        shown = [name if len(name) <= 100 else name[:100] + "..." for name in ignored[:20]]
        if self.strict_request_fields:
            import difflib

            hint = difflib.get_close_matches(ignored[0], type(req).model_fields, n=1)
            raise APIError(
                f"unknown field {shown[0]!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; this server refuses fields it does not know (--strict-request-fields): {shown}",
                param=shown[0],
                code="unknown_field",
            )
        logger.warning("The following fields were present in the request but ignored: %s", set(shown))

    def _params(
        self,
        req: _SamplingFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        structured_spec: dict[str, Any] | None = None,
        keep_special_tokens: bool = False,
    ) -> SamplingParams:
        from kvtier.structured import StructuredOutputsParams

        spec, source = req.structured()
        if structured_spec is not None:
            spec, source = structured_spec, "tool_choice"
        if spec is not None and self.structured_defaults:
            spec = {**self.structured_defaults, **spec}
        try:
            structured = StructuredOutputsParams.coerce(spec)
        except ValueError as e:
            raise APIError(str(e), param=source) from None
        d = self.defaults
        room = max(output_room(len(prompt_ids), self.max_model_len), 1)  # too long: the engine's 400
        if max_tokens is None:  # as much as the context allows (or generation_config's max_new_tokens)
            max_tokens = min(d.get("max_tokens", room), room)
        try:
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
                top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                top_k=d.get("top_k", 0) if req.top_k is None else req.top_k,
                min_p=d.get("min_p", 0.0) if req.min_p is None else req.min_p,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                min_tokens=req.min_tokens,
                skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    d.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
                ),
                logit_bias=req.token_logit_bias(),
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                bad_words_token_ids=req.bad_words_ids,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                prompt_logprobs=req.prompt_logprobs,
                structured_outputs=structured,
            )
        except ValueError as e:
            raise _value_error(e) from None

    async def _check_structured(self, params: list[SamplingParams], param: str | None) -> None:
        """The request's structured-outputs constraint compiled and validated before the engine
        sees it (kvtier.structured.GrammarCompiler.check, cached): on a worker thread, never the
        event loop or the engine thread, under LIMITS.compile_timeout_s. One that cannot be
        honoured is a 400 naming `param` (the field it came in)."""
        from kvtier.structured import LIMITS, GrammarCompiler, StructuredOutputError

        spec = next((sp.structured_outputs for sp in params if sp.structured_outputs is not None), None)
        if spec is None or self.tokenizer is None:
            return  # without a tokenizer the engine refuses it (a 400 from _add)
        if self._grammar_checker is None:
            self._grammar_checker = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size, ())
        loop = asyncio.get_running_loop()
        try:
            work = loop.run_in_executor(_GRAMMAR_POOL, self._grammar_checker.check, spec)
            await asyncio.wait_for(work, LIMITS.compile_timeout_s)
            return
        except TimeoutError:
            reason = "timeout"
            error = APIError(
                f"structured_outputs: compiling the constraint took longer than {LIMITS.compile_timeout_s:g} s",
                param=param,
                code="structured_output_too_complex",
            )
        except StructuredOutputError as e:
            reason = e.reason
            error = APIError(str(e), param=param)
        if self.on_structured_error is not None:
            self.on_structured_error(reason)
        raise error

    async def _add(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        req: _SamplingFields,
        tenant: Tenant,
        prompt_param: str = "prompt",
        stream: bool = False,
    ) -> list[RequestStream]:
        tenancy = tenant.tenancy(req.cache_salt)
        specs = [
            RequestSpec(
                f"{request_id}-{p}",
                ids,
                dataclasses.replace(sp),
                tenancy=tenancy,
                priority=req.priority,
                prompt=text,
                stream=stream,
                lora_request=self.lora_request,
            )
            for p, ((text, ids), sp) in enumerate(zip(prompts, params))
        ]
        if self.request_logger is not None:
            for spec in specs:
                self.request_logger.log(spec.request_id, spec.prompt, spec.prompt_token_ids, spec.params)
        if self.request_log is not None:
            th = tenant_hash(tenant.name)
            for spec in specs:
                self.request_log.register(spec.request_id, th)
        if self.on_added is not None:  # before: a short request can end before add returns
            for spec in specs:
                self.on_added(spec.request_id, spec.params.max_tokens)
        try:
            return await self.engine.add(specs)
        except (ValueError, EngineDeadError) as e:
            if self.on_added is not None:
                for spec in specs:
                    self.on_added(spec.request_id, None)
            if isinstance(e, ValueError):
                raise _value_error(e, prompt_param) from None
            raise APIError(str(e), 503, type="server_error") from None

    async def _wait_final(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """The final outputs; aborts the requests if the client disconnects first."""

        async def final(stream: RequestStream) -> RequestOutput:
            while True:
                out = await stream.next()
                if out.finished:
                    return out

        async def finals() -> list[RequestOutput]:
            return [await final(s) for s in streams]  # each stream buffers: order is free

        work = asyncio.ensure_future(finals())
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientGone()
            try:
                outs = work.result()
            except EngineStepError as e:
                raise APIError(str(e), 500, type="server_error") from None
            failed = next((c for out in outs for c in out.outputs if c.finish_reason == "error"), None)
            if failed is not None:
                raise _structured_failure(failed)
            return outs
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            _abort_unfinished(self.engine, streams)


def _validated(model: Any, body: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from kvtier.server.protocol import validation_error

    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def render_chat(tokenizer: Any, req: ChatCompletionRequest, with_tools: bool = True) -> str:
    """The chat text the server tokenizes for `req` (with add_special_tokens=False), rendered in
    this process by the tokenizer's template or the request's own; a KV-aware router
    (kvtier.integrations.ray_serve) computes a request's token ids with it too."""
    return str(
        tokenizer.apply_chat_template(
            [m.for_template() for m in req.messages],
            req.add_generation_prompt,
            tools=req.tools if with_tools else None,
            chat_template=req.chat_template,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        )
    )


def valid_request_id(rid: str) -> bool:
    """An X-Request-Id kvtier takes: 1-128 printable ASCII characters, no spaces."""
    return _REQUEST_ID.fullmatch(rid) is not None


def _request_ids(prefix: str, raw: Request, body_id: str | None = None) -> tuple[str, str, dict[str, str] | None]:
    """(the id the response carries, the engine's id, headers for the response): as vLLM,
    `prefix-<id>` with the client's id, the X-Request-Id header's when it sent a usable one
    (the middleware echoes it), else the body's `request_id` (then sent back as X-Request-Id),
    else a random id for both. A client's id gets a random suffix in the engine: two clients
    may send the same one at once."""
    rid = raw.headers.get("x-request-id")
    headers = None
    if rid is None or not valid_request_id(rid):
        rid, headers = body_id, None if body_id is None else {"X-Request-Id": body_id}
    if rid is not None:
        public = f"{prefix}-{rid}"
        return public, f"{public}.{uuid.uuid4().hex[:12]}", headers
    public = f"{prefix}-{uuid.uuid4().hex}"
    return public, public, None


def _usage_options(req: _SamplingFields, force: bool = False) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): vLLM's stream_options; the running usage in
    every chunk needs include_usage too, as in vLLM. `force` (--enable-force-include-usage):
    both, whatever the request says (vLLM 0.32)."""
    opts = req.stream_options
    if force:
        return True, True
    if opts is None:
        return False, False
    return opts.include_usage, opts.include_usage and opts.continuous_usage_stats


@dataclasses.dataclass(frozen=True, slots=True)
class _Echo:
    """A completions stream's echo: each prompt's text (by prompt index); `only`: max_tokens 0,
    the prompt alone."""

    texts: list[str]
    only: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _ChatReply:
    """How a chat stream speaks: the reply's role, the echoed text ("" for none), how logprobs
    name tokens."""

    role: str
    echo: str
    token_text: R.TokenText


def _chat_echo(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's content (text parts joined by newlines) when its
    role is the reply's, else ""."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    if last.role != role or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content)


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _too_long(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param, code="context_length_exceeded")


_INLINE_CHARS = 16 << 10


_GRAMMAR_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-grammar-check")
"""Structured-outputs pre-validation (compiling a new constraint, bounded by llguidance's
limits): threads of its own, so it neither stalls the event loop nor takes the default pool."""

_RENDER_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtier-chat-template")
"""Chat-template renders off the event loop: a few threads of their own, so renders (each
bounded in time by RenderLimits) cannot take every thread of the default pool."""


async def _off_loop(
    fn: Callable[..., Any], *args: Any, chars: int, render: bool = False, untrusted: bool = False
) -> Any:
    """fn(*args) (templates, tokenization): inline when small, else on a worker thread, so a
    long prompt does not stall the event loop (and every stream it serves); the tokenizer lets
    go of the GIL while it encodes. `render`: fn renders a chat template (it runs on
    _RENDER_POOL); `untrusted`: a request's own template, whose work the character count
    does not bound, so never inline."""
    if chars <= _INLINE_CHARS and not untrusted:
        return fn(*args)
    if render:
        return await asyncio.get_running_loop().run_in_executor(_RENDER_POOL, fn, *args)
    return await asyncio.to_thread(fn, *args)


class ClientGone(Exception):
    """The client disconnected before its response was ready (nobody reads the answer)."""


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they arrive, until all finished."""
    if len(streams) == 1:
        while True:
            out = await streams[0].next()
            yield 0, out
            if out.finished:
                return
    tasks: dict[asyncio.Task, int] = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.__getitem__):
                i = tasks.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    tasks[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in tasks:
            task.cancel()


def _abort_unfinished(engine: EngineClient, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            engine.abort(s.request_id)


def _streaming(
    gen: AsyncIterator[str], engine: EngineClient, streams: list[RequestStream], headers: dict[str, str] | None = None
) -> Response:
    return _CleanupStreamingResponse(
        gen,
        cleanup=lambda: _abort_unfinished(engine, streams),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


class StreamStalled(Exception):
    """The client read nothing of a stream for `stall_timeout_s`."""


class _CleanupStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `cleanup` (then each `also_cleanup`) however it ends:
    done, client gone, cancelled, stalled. (The body generator's own `finally` runs only when
    the generator is finalised.)

    `stall_timeout_s` (None: no bound): a send that cannot complete for that long (the
    client's socket buffer and the transport's are full: it does not read) ends the stream;
    its requests are aborted (their blocks freed) and `on_stalled` is called once. While a
    send waits, the body generator is not pulled, so no further output is rendered; the
    engine's outputs wait in the request's stream until the abort."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(_errors_as_events(content), **kwargs)
        self.cleanup = cleanup
        self.also_cleanup: list[Callable[[], None]] = []
        self.stall_timeout_s: float | None = None
        self.on_stalled: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.stall_timeout_s

        async def bounded_send(message: Any) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise StreamStalled from None

        try:
            await super().__call__(scope, receive, send if timeout is None else bounded_send)
        except StreamStalled:
            if self.on_stalled is not None:
                self.on_stalled()
        finally:
            self.cleanup()
            for fn in self.also_cleanup:
                fn()


async def _errors_as_events(content: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once the 200 is sent, an engine failure can only be reported in the stream."""
    try:
        async for item in content:
            yield item
    except (EngineStepError, EngineDeadError) as e:
        yield R.sse(APIError(str(e), 500, type="server_error").body())
        yield R.SSE_DONE
    except StructuredOutputFailed as e:
        yield R.sse(e.error.body())
        yield R.SSE_DONE


class StructuredOutputFailed(Exception):
    """A streamed choice whose grammar failed while decoding: the stream ends with `error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(str(error))
        self.error = error


def _structured_failure(c: Any) -> APIError:
    """The client's error for a choice that ended with finish_reason "error" (its grammar failed
    while decoding): a 500 with code structured_output_failed, OpenAI's shape for server errors."""
    reason = (
        c.stop_reason if isinstance(c.stop_reason, str) else "structured_outputs: the grammar failed while decoding"
    )
    return APIError(reason, 500, type="server_error", code="structured_output_failed")


_PARAM_NAMES = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "logprobs",
    "min_tokens",
    "stop_token_ids",
    "stop",
    "seed",
    "prompt_logprobs",
    "prompt",
    "cache_salt",
    "token id",
    "request id",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "priority",
    "structured_outputs",
)


def _value_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """An engine or SamplingParams ValueError as a 400; `param` guessed from the message."""
    msg = str(e)
    param = next((p for p in _PARAM_NAMES if msg.startswith((p + " ", p + ":"))), None)
    if param in ("token id", "prompt"):
        param = prompt_param
    elif param == "request id":
        param = None
    code = None
    if "context" in msg and ("exceeds" in msg or "tokens; this model" in msg):
        code, param = "context_length_exceeded", prompt_param
    if param is None and msg.startswith("the prompt"):
        param = prompt_param
    return APIError(msg, 400, param=param, code=code)
