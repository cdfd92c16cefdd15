"""Tool calling for /v1/chat/completions, as vLLM's server does it.

    tool_choice        how the output is produced                     how it is read
    "none"             free text; the tools are left out of the prompt  content only
    named function     constrained to that function's parameters       one tool call
    "required"         constrained to [{"name", "parameters"}, ...]    one call per item
    "auto"             free text (needs --enable-auto-tool-choice      the --tool-call-parser's
                       and --tool-call-parser, as in vLLM)             format, else content

The formats of --tool-call-parser are in tool_parsers.py and tool_parsers_text.py (PARSERS
below names them). A stream sends a call as vLLM does: its first delta carries index, id, type
and function.name (and the arguments so far), later ones only function.arguments fragments,
which add up to the non-streamed arguments exactly; text outside calls streams as content.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtier.server.protocol import APIError
from kvtier.server.tool_json import JsonReader
from kvtier.server.tool_parsers import (
    CallDraft,
    DeepSeekV3Parser,
    Draft,
    Granite20bFCParser,
    GraniteParser,
    HarmonyParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolParser,
    new_call_id,
)
from kvtier.server.tool_parsers_text import PythonicParser, Qwen3CoderParser

__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolStream", "make_parser", "tool_message"]

log = logging.getLogger(__name__)

PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3Parser,
    "granite": GraniteParser,
    "granite-20b-fc": Granite20bFCParser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "openai": HarmonyParser,
    "pythonic": PythonicParser,
    "qwen": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_json": HermesParser,
    "qwen3_xml": Qwen3CoderParser,
}
"""--tool-call-parser names: vLLM 0.32's for these formats (it aliases llama4_json to
llama3_json, qwen3_json to hermes, qwen3_xml to qwen3_coder), and kvtier's older "qwen"."""


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser {name!r} (choose from {', '.join(sorted(PARSERS))})") from None


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[str, str | None]:
    """(mode, function name): mode is 'none', 'auto', 'required' or 'named'; a 400 for a
    malformed `tools` or a `tool_choice` naming no given function."""
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise APIError(
                f'tools.{i}: a tool is {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}}}',
                param="tools",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools.{i}.function.parameters must be a JSON schema object", param="tools")
        names.append(fn["name"])
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice {tool_choice!r}: use none, auto, required or a named function", param="tool_choice"
            )
        if tool_choice == "required" and not tools:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(
            'tool_choice names a function as {"type": "function", "function": {"name": ...}}', param="tool_choice"
        )
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "named", name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constraint(tools: list[dict[str, Any]], mode: str, name: str | None) -> dict[str, Any] | None:
    """The JSON schema the output is held to (StructuredOutputsParams fields), or None."""
    if mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == name)
        return {"json": _parameters(tool)}
    if mode == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return {"json": {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}}
    return None


def read_constrained(text: str, mode: str, name: str | None) -> list[ToolCall]:
    """The tool calls of an output generated under `constraint`. A named call is a call
    whatever its text, its arguments the text as generated (as vLLM: arguments cut short by
    max_tokens stay as they are, and finish_reason 'length' says so); a `required` list cut
    short is not valid JSON: no calls, the text stays content."""
    draft = _constrained_draft(mode, name)(text, True, {})
    if draft.failed:
        return []
    return [ToolCall(c.name or "", c.arguments) for c in draft.calls]


Reader = Callable[[str, bool, dict[Any, Any]], Draft]


def _constrained_draft(mode: str, name: str | None) -> Reader:
    if mode == "named":
        return lambda text, final, memo: Draft("", [CallDraft(name or "", text, final)])

    def required(text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        reader = memo.get("required")
        if reader is None:
            reader = memo["required"] = JsonReader("array")
        reader.feed(text[reader.consumed :])
        if reader.error is not None or (final and (not reader.done or not reader.calls)):
            return Draft(text, [], True)
        return Draft("", [CallDraft(reader.name(c), reader.arguments(c), c.closed) for c in reader.calls])

    return required


def for_request(parser: ToolParser | None, tools: list[dict[str, Any]] | None) -> ToolParser | None:
    """The server's --tool-call-parser for one request's tools (qwen3_coder reads values by
    their schema)."""
    return parser.bind(tools) if parser is not None else None


class ToolStream:
    """Per choice of a chat stream: the delta message each piece of output makes. Under a named
    or required tool choice all text is calls; under 'auto' the parser's drafts of the text so
    far say what is content and what is calls, and each step sends what is new."""

    def __init__(self, mode: str, name: str | None, parser: ToolParser | None) -> None:
        self.mode, self.name, self.parser = mode, name, parser
        self.text = ""
        self._read: Reader | None = None
        if mode in ("named", "required"):
            self._read = _constrained_draft(mode, name)
        elif mode == "auto" and parser is not None:
            self._read = parser.read
        self._memo: dict[Any, Any] = {}
        self._content = ""  # content sent
        self._args: list[str] = []  # per call sent: the arguments sent
        self._plain = False  # the text turned out not to be calls: all of it is content
        self._stopped = False  # ... after a call went out: nothing more is sent

    @property
    def active(self) -> bool:
        return self._read is not None

    @property
    def called(self) -> bool:
        """A tool call has gone out."""
        return bool(self._args)

    def step(self, delta: str, finished: bool) -> dict[str, Any]:
        """The delta message ({"content": ...} and/or {"tool_calls": [...]}) for the choice's
        next piece of text; empty when nothing can go out yet. `finished`: the last piece."""
        assert self._read is not None  # called on active streams
        self.text += delta
        if self._stopped:
            return {}
        draft = Draft(self.text) if self._plain else self._read(self.text, finished, self._memo)
        if draft.failed:
            if self._args:
                self._stopped = True
                log.debug("tool calls: the output stopped being calls after one went out")
                return {}
            self._plain = True
            draft = Draft(self.text)
        message: dict[str, Any] = {}
        if len(draft.content) > len(self._content):
            if draft.content.startswith(self._content):
                message["content"] = draft.content[len(self._content) :]
                self._content = draft.content
            else:  # a parser broke its promise: keep what went out
                log.warning("tool calls: content %r does not extend what was sent", draft.content[:80])
        deltas = [d for i, call in enumerate(draft.calls) if (d := self._call_delta(i, call)) is not None]
        if deltas:
            message["tool_calls"] = deltas
        return message

    def _call_delta(self, index: int, call: CallDraft) -> dict[str, Any] | None:
        if index > len(self._args) or (index == len(self._args) and call.name is None):
            return None
        if index == len(self._args):
            self._args.append(call.arguments)
            function = {"name": call.name, "arguments": call.arguments}
            return {"index": index, "id": new_call_id(), "type": "function", "function": function}
        sent = self._args[index]
        if len(call.arguments) <= len(sent):
            return None
        if not call.arguments.startswith(sent):  # a parser broke its promise: keep what went out
            log.warning("tool call %d: arguments %r do not extend what was sent", index, call.arguments[:80])
            return None
        self._args[index] = call.arguments
        return {"index": index, "function": {"arguments": call.arguments[len(sent) :]}}


def tool_message(
    text: str, mode: str, name: str | None, parser: ToolParser | None
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole chat output."""
    if mode in ("named", "required"):
        calls = read_constrained(text, mode, name)
        return (None if calls else text), calls
    if mode == "auto" and parser is not None:
        return parser.parse(text)
    return text, []
