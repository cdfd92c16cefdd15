"""Tool calling for /v1/chat/completions, as vLLM's server does it.

    tool_choice        how the output is produced                     how it is read
    "none"             free text; the tools are left out of the prompt  content only
    named function     constrained to that function's parameters       one tool call
    "required"         constrained to [{"name", "parameters"}, ...]    one call per item
    "auto"             free text (needs --enable-auto-tool-choice      the --tool-call-parser's
                       and --tool-call-parser, as in vLLM)             format, else content

Parsers for the formats of the families kvtier serves:
    hermes (Qwen 2/2.5/3, Hermes)   <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json (Llama 3.x)         {"name": ..., "parameters": {...}} (optionally after <|python_tag|>)
    mistral                         [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.server.protocol import APIError


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


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
    whatever its text (as vLLM: arguments cut short by max_tokens stay as they are, and
    finish_reason 'length' says so); a `required` list cut short is not valid JSON: no calls,
    the text stays content."""
    if mode == "named":
        try:
            return [ToolCall(name or "", json.dumps(json.loads(text), ensure_ascii=False))]
        except ValueError:
            return [ToolCall(name or "", text)]
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [
        ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in value
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


class ToolParser:
    """Reads tool calls out of free text in one model family's format."""

    name = ""
    start = ""
    """Text that opens a tool call: a stream holds back what follows it until the end."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content left, calls); no calls leaves the text as content."""
        raise NotImplementedError


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.start)].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        head, _, rest = text.partition(self.start)
        try:
            value = json.loads(rest.strip())
        except ValueError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [c for c in (_call(item) for item in items) if c is not None]
        if not calls:
            return text, []
        return head.strip() or None, calls


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser {name!r} (choose from {', '.join(sorted(PARSERS))})") from None


class ToolStream:
    """Per choice of a chat stream: which text may go out as content now and, at the end, the
    tool calls. Under a named or required tool choice all text is a call; under 'auto' the
    text from the parser's start marker on is held back until the choice ends."""

    def __init__(self, mode: str, name: str | None, parser: ToolParser | None) -> None:
        self.mode, self.name, self.parser = mode, name, parser
        self.text = ""
        self.sent = 0

    @property
    def active(self) -> bool:
        return self.mode in ("named", "required") or (self.mode == "auto" and self.parser is not None)

    def feed(self, delta: str) -> str:
        """The part of the text so far (after `delta`) that is safe to send as content."""
        self.text += delta
        if self.mode in ("named", "required"):
            return ""
        assert self.parser is not None
        hold = self._hold_from()
        out = self.text[self.sent : hold]
        self.sent = max(self.sent, hold)
        return out

    def _hold_from(self) -> int:
        assert self.parser is not None  # feed() under 'auto' (an active stream has a parser)
        text, start = self.text, self.parser.start
        if isinstance(self.parser, Llama3JsonParser):
            lead = text.lstrip()
            if not lead or lead.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(lead):
                return self.sent
            return len(text)
        pos = text.find(start, self.sent)
        if pos >= 0:
            return pos
        for k in range(min(len(start) - 1, len(text)), 0, -1):  # a marker cut between chunks
            if start.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the tool calls) once the choice has ended."""
        if self.mode in ("named", "required"):
            calls = read_constrained(self.text, self.mode, self.name)
            return ("" if calls else self.text), calls
        assert self.parser is not None  # called on active streams: 'auto' with a parser
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        rest = (content or "")[self.sent :] if content and len(content) > self.sent else ""
        return rest, calls


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
