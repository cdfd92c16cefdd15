"""OpenAI request models (pydantic) and the OpenAI error shape.

Requests validate strictly (a string where a number belongs is a 400, not a coercion; every
integer is range-checked, so none reaches the engine that does not fit 64 bits) and keep
fields they do not know aside: the server logs them, or refuses them under
--strict-request-fields (OpenAI's and vLLM's bookkeeping fields, KNOWN_NEUTRAL_FIELDS, pass). Fields OpenAI or vLLM has and
kvtier does not implement are accepted only at their neutral value: any other value is a 400
that names the field, never silently ignored. vLLM's extra fields kvtier implements, with vLLM's
names: `cache_salt`, `priority`, `ignore_eos`, `stop_token_ids`, `min_tokens`,
`skip_special_tokens`, `include_stop_str_in_output`, `top_k`, `min_p`, `repetition_penalty`,
`bad_words`, `allowed_token_ids`, `truncate_prompt_tokens`, `return_token_ids`,
`return_tokens_as_token_ids`, `request_id`, `stream_options.continuous_usage_stats`, `echo`
(completions, with `max_tokens` 0 too; and chat), and in chat `chat_template` and
`continue_final_message`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError


class APIError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_JSON_DEPTH = 64
"""Bodies nested deeper than this (objects and arrays) are a 400: no OpenAI request comes
close, and the parser, pydantic and templates all recurse."""

# a \uD800-\uDFFF escape: the only way a lone surrogate gets into a body that is strict UTF-8
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def parse_json_object(body: bytes, precheck: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 saying what is wrong with it: not UTF-8, not
    JSON, NaN/Infinity (not JSON), an integer too long to parse, nested deeper than
    MAX_JSON_DEPTH, or a string holding a lone UTF-16 surrogate (not Unicode text; it would
    fail in the tokenizer and in every JSON answer that echoes it). `precheck(obj)` runs
    first, straight after parsing: O(1) checks that spare a hostile body the walk."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"the body is not valid UTF-8 ({e.reason} at byte {e.start})", 400, code="invalid_json"
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity/1e400, too many digits for an int
        msg = str(e)
        if "integer string conversion" in msg:
            msg = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        where = None if isinstance(e, json.JSONDecodeError) else _bad_number_path(text)
        if where:
            raise APIError(f"{where}: {msg}", 400, param=where, code="invalid_json") from None
        raise APIError(f"the body is not valid JSON: {msg}", 400, code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError("the body must be a JSON object", 400, code="invalid_json")
    if precheck is not None:
        precheck(obj)
    _check_tree(obj, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return obj


class _BadNumber:
    """Where a number JSON cannot give Python stood, in `_bad_number_path`'s second parse."""


def _bad_number_path(text: str) -> str | None:
    """The path (e.g. `logit_bias.5`, `prompt.0`) of the first NaN, Infinity, out-of-range
    float or over-long integer in `text`, for the 400 to name the field; only after the strict
    parse failed, so the fast path parses once."""
    limit = sys.get_int_max_str_digits() or 1 << 62

    def parse_int(literal: str) -> Any:
        return _BadNumber() if len(literal.lstrip("-")) > limit else int(literal)

    def parse_float(literal: str) -> Any:
        value = float(literal)
        return value if math.isfinite(value) else _BadNumber()

    try:
        obj = json.loads(text, parse_constant=lambda _: _BadNumber(), parse_float=parse_float, parse_int=parse_int)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, tuple[str, ...]]] = [(obj, ())]
    while stack:  # depth-first, in document order
        node, path = stack.pop()
        if isinstance(node, _BadNumber):
            return ".".join(path)
        if len(path) < MAX_JSON_DEPTH and isinstance(node, (dict, list)):
            items = list(node.items() if isinstance(node, dict) else enumerate(node))
            stack.extend((v, path + (str(k),)) for k, v in reversed(items))
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is out of range; send a finite number")
    return value


def _too_deep() -> APIError:
    return APIError(f"the body is nested more than {MAX_JSON_DEPTH} levels deep", 400, code="invalid_json")


def _check_tree(obj: dict[str, Any], check_strings: bool) -> None:
    """Depth, level by level without recursion; then, only when the body has surrogate
    escapes at all, lone surrogates (keys count), named by path, e.g. `messages.0.content`."""
    level: list[Any] = [obj]
    for _ in range(MAX_JSON_DEPTH):
        level = [
            v
            for node in level
            for v in (node.values() if type(node) is dict else node)
            if type(v) is list or type(v) is dict
        ]
        if not level:
            break
    else:
        raise _too_deep()
    if check_strings:
        _find_surrogate(obj, ())


def _find_surrogate(node: Any, path: tuple[str, ...]) -> None:
    """Recursive, so only after the depth is known to be bounded."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            raise _surrogate_error(path, key, f"a key of {'.'.join(path) or 'the body'}")
        if isinstance(value, (dict, list)):
            _find_surrogate(value, path + (str(key),))
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise _surrogate_error(path + (str(key),), value, ".".join(path + (str(key),)))


def _surrogate_error(path: tuple[str, ...], text: str, where: str) -> APIError:
    m = _SURROGATE.search(text)
    assert m is not None
    return APIError(
        f"{where} contains a lone UTF-16 surrogate (U+{ord(m.group()):04X} at "
        f"character {m.start()}), which is not Unicode text; send valid UTF-8 or "
        r"paired \uD8xx\uDCxx escapes",
        400,
        param=".".join(path) or None,
        code="invalid_unicode",
    )


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first offending field."""
    errors = e.errors(include_url=False)
    # a value out of range rather than "not a string" from the first alternative of a union
    first = next((err for err in errors if not err["type"].endswith("_type")), errors[0])
    loc = [str(p) for p in first.get("loc", ())]
    # unions report each alternative as a loc element (e.g. 'str', 'list[int]'): keep field path
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    msg = first.get("msg", "invalid value")
    text = f"{param}: {msg}" if param else msg
    if e.error_count() > 1:
        text += f" (and {e.error_count() - 1} more errors)"
    return APIError(text, 400, param=param)


def _is_type_name(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "list", "dict")
        or "[" in part
        or part.startswith(("function-", "constrained-", "json-or-python"))
    )


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


I32_MAX = (1 << 31) - 1
"""The largest count, length or token id a request may give (every vocabulary and context is
far below it); larger integers are a 400 at the edge, before anything serializes them."""
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

Count = Annotated[int, Field(ge=0, le=I32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=I32_MAX)]
"""A token id as the edge takes it: the engine checks it against the vocabulary."""
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]

KNOWN_NEUTRAL_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
"""OpenAI/vLLM request fields kvtier does not model and that change nothing it computes
(bookkeeping for the caller's platform): taken silently, also under --strict-request-fields."""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Every integer is range-checked here (a 400 naming the field), so nothing past the edge
    sees one that does not fit 64 bits. Fields the model does not know are kept in
    `model_extra` (not used): `ignored_fields()` lists them for the server's warning, or its
    400 under --strict-request-fields."""

    model_config = ConfigDict(strict=True, extra="allow")

    _bad_words_ids: list[list[int]] | None = PrivateAttr(None)
    """`bad_words` tokenized by the server (once for all of a request's prompts)."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=I32_MAX)
    min_p: float | None = None
    n: int = Field(1, ge=1, le=I32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    """A 64-bit integer (the sampler's generator takes no more)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # kvtier / vLLM extras
    cache_salt: str | None = None
    priority: int = Field(0, ge=I64_MIN, le=I64_MAX)
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """Add each choice's generated token ids (and, outside streams, the prompt's) to the
    response; in a stream, each chunk carries the ids of the tokens it delivers."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name tokens `token_id:N` instead of their text (None: the server's
    default, --return-tokens-as-token-ids)."""
    request_id: str | None = None
    """vLLM's: the request's id (the response's id is `cmpl-<it>` / `chatcmpl-<it>`, as with
    an X-Request-Id header, which wins when both are sent); 1-128 printable ASCII characters."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Bias] | None = None
    """Token id (as a string of ASCII digits, OpenAI's shape) -> bias added to its logit, in
    [-100, 100]."""
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=I32_MAX)
    prompt_logprobs: Count | None = None
    """vLLM's: the prompt tokens' log-probabilities (top-k at each position) in the response."""
    # vLLM fields accepted at their neutral value only
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None

    _NOT_IMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "guided_whitespace_pattern",
        "logits_processors",
        "vllm_xargs",
        "kv_transfer_params",
    )
    _GUIDED: ClassVar[dict[str, str]] = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }

    def unsupported(self) -> list[str]:
        """Fields given with a value kvtier does not implement."""
        bad = [name for name in self._NOT_IMPLEMENTED if getattr(self, name) is not None]
        if self.guided_decoding_backend not in (None, "auto", "llguidance", "guidance"):
            bad.append("guided_decoding_backend")
        if self.use_beam_search:
            bad.append("use_beam_search")
        if self.length_penalty != 1.0:
            bad.append("length_penalty")
        if not self.spaces_between_special_tokens:
            bad.append("spaces_between_special_tokens")
        return bad

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the structured-outputs constraint as StructuredOutputsParams fields, the request field
        it came from): vLLM's `structured_outputs`, its older `guided_*` fields, or OpenAI's
        `response_format`; more than one is a 400."""
        found: list[tuple[dict[str, Any], str]] = []
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, dict):
                raise APIError(
                    'structured_outputs must be an object, e.g. {"json": {...schema...}}', param="structured_outputs"
                )
            spec = {k: v for k, v in self.structured_outputs.items() if v is not None and k != "disable_fallback"}
            found.append((spec, "structured_outputs"))
        for name, kind in self._GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append(({kind: value}, name))
        rf = getattr(self, "response_format", None)
        if rf:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(({"json_object": True}, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        "response_format.json_schema.schema must be a JSON schema object", param="response_format"
                    )
                found.append(({"json": schema}, "response_format"))
            elif kind not in (None, "text"):
                raise APIError(
                    f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                    param="response_format",
                )
        if len(found) > 1:
            raise APIError(f"{found[0][1]} and {found[1][1]} both constrain the output; give one", param=found[1][1])
        return found[0] if found else (None, None)

    @property
    def bad_words_ids(self) -> list[list[int]] | None:
        """`bad_words` tokenized by the server (`tokenize_bad_words`), or None."""
        return self._bad_words_ids

    @bad_words_ids.setter
    def bad_words_ids(self, ids: list[list[int]] | None) -> None:
        self._bad_words_ids = ids

    def ignored_fields(self) -> list[str]:
        """The body's fields this model does not know (misspelt or not implemented), less the
        known-neutral ones (KNOWN_NEUTRAL_FIELDS)."""
        return sorted(k for k in self.model_extra or () if k not in KNOWN_NEUTRAL_FIELDS)

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer keys; a key that is not a token id (only ASCII decimal
        digits, at most I32_MAX) is a 400."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not (0 < len(key) <= 10 and key.isascii() and key.isdigit()) or int(key) > I32_MAX:
                raise APIError(
                    f'logit_bias: the key {key[:40]!r} is not a token id (a decimal number, e.g. "1234")',
                    400,
                    param="logit_bias",
                )
            out[int(key)] = value
        return out


PromptInput = str | list[TokenId] | list[str] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Count | None = 16
    logprobs: Count | None = None
    echo: bool = False
    """The prompt starts each choice's text (and its logprobs, with `logprobs`); with
    `max_tokens` 0 only the prompt comes back (one token is generated and dropped, as vLLM)."""
    best_of: Count | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; fields beyond role/content/name (tool calls, ...) pass through to the
    template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(p.text for p in self.content)
        elif self.content is None:
            msg["content"] = ""
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """A Jinja chat template for this request, in place of the model's."""
    continue_final_message: bool = False
    """End the prompt inside the last message (continue it) instead of opening a new turn;
    needs add_generation_prompt=false."""
    echo: bool = False
    """vLLM's: the last message's content starts the reply when its role is the reply's."""
    documents: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.documents is not None:
            bad.append("documents")
        return bad


class TokenizeCompletionRequest(_Strict):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's /tokenize with messages (rendered by the chat template first)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body (kvtier.server.lora_adapters)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str
    """The adapter's PEFT directory, on the server's machine."""
    load_inplace: bool = False
    """Replace an adapter loaded under this name (its files read again, under a new id)."""
    is_3d_lora_weight: bool = False
    """vLLM's MoE adapter layout: kvtier serves no MoE LoRA, so true is a 400."""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter body."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_int_id: int | None = Field(None, ge=1, le=I64_MAX)
    """When given, it must be the loaded adapter's id (a 404 otherwise)."""
