"""The tool-call formats of --tool-call-parser (vLLM's names), read from text that grows.

Every parser has one method, `read(text, final, memo) -> Draft`: the content and the calls that
the text so far shows for certain. A stream calls it after each piece of output (kvtier's
ToolStream sends what is new since the last draft), the non-streamed answer once with
final=True; both read the same way, so a stream's pieces add up to the non-streamed message.
`memo` keeps a stream's JSON readers between calls (each piece is read once).

What a draft promises while final is False:
    content     a prefix of the final content: text before the first call, less trailing
                whitespace and any tail that may be the start of a call marker
    call.name   None until the name is complete
    arguments   a prefix of the final arguments text (JSON arguments are re-serialised as
                json.dumps(value, ensure_ascii=False) writes them, see tool_json.py)
    failed      the text is not the format: all of it is content, as vLLM's parsers fall back

The content of an answer with calls is the text before the first call (trailing whitespace
dropped; None if nothing is left); text after or between calls is dropped, as vLLM's
hermes/llama3_json/deepseek_v3 parsers drop it. Formats:

    hermes, qwen3_json (Qwen 2.5/3, Hermes)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json, llama4_json (Llama 3.x/4)   {"name": ..., "parameters": {...}}; ... at the start
                                             of the output or after <|python_tag|>
    mistral                                  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                             or [TOOL_CALLS]name[ARGS]{...} (newer tokenizers)
    pythonic (Llama 3.2/4, ToolACE)          [get(city="Oslo", days=3), put(x=[1, 2])]
    qwen3_coder, qwen3_xml (Qwen3-Coder)     <tool_call><function=name><parameter=p>value
                                             </parameter></function></tool_call>; values
                                             converted with the tool's JSON schema
                                             (these two: tool_parsers_text.py)
    granite (Granite 3.0/3.1)                <|tool_call|>[{"name": ..., "arguments": {...}}]
                                             (or <tool_call>[...])
    granite-20b-fc                           <function_call> {"name": ..., "arguments": {...}}
    deepseek_v3                              <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
                                             <｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
                                             ...<｜tool▁calls▁end｜>
    openai (gpt-oss, harmony)                <|channel|>commentary to=functions.name
                                             <|constrain|>json<|message|>{...}<|call|>; the
                                             final channel (and commentary to no one) is content,
                                             analysis is left out
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtier.server.tool_json import JsonReader

_SPACE = re.compile(r"[ \t\r\n]*")
_OK, _WAIT, _END, _FAIL = range(4)


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDraft:
    name: str | None
    """None until the name is complete."""
    arguments: str
    """A prefix of the final arguments text."""
    done: bool = False


@dataclass(slots=True)
class Draft:
    content: str
    calls: list[CallDraft] = field(default_factory=list)
    failed: bool = False


def _failed(text: str) -> Draft:
    return Draft(text, [], True)


# ---------------------------------------------------------------------- text helpers
def _skip_space(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m else pos


def _partial_tail(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """How many characters at the end of text[start:] may be the start of a marker."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def _first_of(text: str, start: int, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(p, m) for m in markers if (p := text.find(m, start)) >= 0]
    return min(found) if found else None


def _before(text: str, markers: tuple[str, ...], final: bool) -> tuple[str, int | None]:
    """(the content certain so far, where the first marker starts or None)."""
    first = _first_of(text, 0, markers)
    if first is not None:
        return text[: first[0]].rstrip(), first[0]
    if final:
        return text, None
    return text[: len(text) - _partial_tail(text, markers)].rstrip(), None


def _expect(text: str, pos: int, literals: tuple[str, ...], final: bool) -> tuple[int, str, int]:
    """Whitespace, then one of `literals` at pos: (_OK, which, the position after it); (_WAIT,
    "", pos) while the text so far may still become one; (_END, "", pos) at the end of a final
    text; else (_FAIL, "", pos)."""
    p = _skip_space(text, pos)
    for literal in literals:
        if text.startswith(literal, p):
            return _OK, literal, p + len(literal)
    if p == len(text):
        return (_END if final else _WAIT), "", p
    if not final and any(literal.startswith(text[p:]) for literal in literals):
        return _WAIT, "", p
    return _FAIL, "", p


def _json_at(memo: dict[Any, Any], text: str, start: int, calls_in: str | None, final: bool) -> JsonReader:
    """The JSON reader of the value at `start`, fed the text up to now."""
    reader = memo.get((start, calls_in))
    if reader is None:
        reader = memo[(start, calls_in)] = JsonReader(calls_in)
    if not reader.done and reader.error is None:
        reader.feed(text[start + reader.consumed :])
        if final:
            reader.close()
    return reader


def _calls_of(reader: JsonReader) -> list[CallDraft]:
    return [CallDraft(reader.name(c), reader.arguments(c), c.closed) for c in reader.calls]


def _object_args(reader: JsonReader) -> bool:
    """The value read is (so far) a JSON object, as arguments must be."""
    return reader.error is None and (not reader.text or reader.text.startswith("{"))


class _NotFormat(Exception):
    """The text is not the parser's format (read() answers _failed: all of it is content)."""


def _required(text: str, pos: int, literal: str, final: bool) -> int | None:
    """Whitespace, then `literal` at pos, as the format requires: the position after it; None
    while the text so far may still become it. Raises _NotFormat."""
    status, _, end = _expect(text, pos, (literal,), final)
    if status == _OK:
        return end
    if status == _WAIT:
        return None
    raise _NotFormat


def _json_calls(
    memo: dict[Any, Any], text: str, start: int, calls_in: str | None, final: bool, calls: list[CallDraft]
) -> int | None:
    """Adds the call(s) of the JSON value at `start` to `calls`: where the value ends, None
    while it is still coming."""
    reader = _json_at(memo, text, start, calls_in, final)
    if reader.error is not None or (final and not reader.done):
        raise _NotFormat
    calls += _calls_of(reader)
    return start + reader.consumed if reader.done else None


def _json_args(
    memo: dict[Any, Any], text: str, start: int, name: str, final: bool, calls: list[CallDraft]
) -> int | None:
    """Adds a call named `name` whose arguments are the JSON object at `start` to `calls`:
    where the object ends, None while it is still coming."""
    reader = _json_at(memo, text, start, None, final)
    if not _object_args(reader) or (final and not reader.done):
        raise _NotFormat
    calls.append(CallDraft(name, reader.text, reader.done))
    return start + reader.consumed if reader.done else None


# ---------------------------------------------------------------------- parsers
class ToolParser:
    """Reads tool calls out of free text in one model family's format (see the module doc)."""

    name: ClassVar[str] = ""
    keep_special_tokens: ClassVar[bool] = False
    """The format's markers are special tokens the output must keep (vLLM's adjust_request
    turns skip_special_tokens off for these parsers)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def bind(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """This parser for a request with these tools (a format that reads values by their
        schema needs them)."""
        return type(self)(tools)

    def read(self, text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; no calls leaves the text as content."""
        draft = self.read(text, True, {})
        if draft.failed or not draft.calls:
            return (text if draft.failed else draft.content), []
        return draft.content or None, [ToolCall(c.name or "", c.arguments) for c in draft.calls]


class _MarkedParser(ToolParser):
    """A format whose calls follow a marker (one of `opens`), read by one scan: the content is
    the text before the first marker; at each marker `_calls_at` reads the call(s) there, then
    the scan goes on at the next marker after them (the text between is dropped). A final text
    with a marker but no call is not the format."""

    opens: ClassVar[tuple[str, ...]] = ()

    def read(self, text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        return self._scan(text, final, memo)

    def _scan(self, text: str, final: bool, memo: dict[Any, Any], at: int | None = None) -> Draft:
        """`at`: where the calls start when the caller knows it (a format whose calls may also
        open the output without a marker); None: at the first marker."""
        if at is None:
            content, pos = _before(text, self.opens, final)
            if pos is None:
                return Draft(content)
        else:
            content, pos = text[:at].rstrip(), at
        calls: list[CallDraft] = []
        try:
            while pos is not None:
                end = self._calls_at(text, pos, final, memo, calls)
                found = None if end is None else _first_of(text, end, self.opens)
                pos = found[0] if found else None
        except _NotFormat:
            return _failed(text)
        if final and not calls:
            return _failed(text)
        return Draft(content, calls)

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        """Adds the call(s) at the marker at `pos` to `calls`: where the next marker may be,
        None to stop (the text so far ends inside a call, or the format reads no further).
        Raises _NotFormat."""
        raise NotImplementedError


class _MarkedJsonParser(_MarkedParser):
    """Calls as JSON after a marker: `opens` starts a call region, the JSON value there holds
    the call(s) (`calls_in` as JsonReader takes it), `close` (if any) must follow it; text up to
    the next marker is dropped."""

    close: ClassVar[str | None] = None
    calls_in: ClassVar[str] = "value"

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        start = pos + next(len(m) for m in self.opens if text.startswith(m, pos))
        end = _json_calls(memo, text, start, self.calls_in, final, calls)
        if end is None or self.close is None:
            return end
        status, _, end = _expect(text, end, (self.close,), final)
        if status == _FAIL:
            raise _NotFormat
        return end if status == _OK else None


class HermesParser(_MarkedJsonParser):
    name = "hermes"
    keep_special_tokens = True
    opens = ("<tool_call>",)
    close = "</tool_call>"


class GraniteParser(_MarkedJsonParser):
    name = "granite"
    keep_special_tokens = True
    opens = ("<|tool_call|>", "<tool_call>")
    calls_in = "either"


class Granite20bFCParser(_MarkedJsonParser):
    name = "granite-20b-fc"
    opens = ("<function_call>",)


class Llama3JsonParser(_MarkedParser):
    """JSON objects separated by ';' at the start of the output or after <|python_tag|>; what
    follows the last one is dropped."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    opens = (tag,)

    def read(self, text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        lead = _skip_space(text, 0)
        return self._scan(text, final, memo, lead if text.startswith("{", lead) else None)

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        start = pos + len(self.tag) if text.startswith(self.tag, pos) else pos
        while (end := _json_calls(memo, text, start, "value", final, calls)) is not None:
            while end < len(text) and text[end] in " \t\r\n;":
                end += 1
            if not text.startswith("{", end):
                break
            start = end
        return None


class MistralParser(_MarkedParser):
    """[TOOL_CALLS] then a JSON list of calls (or one call), or the newer tokenizers'
    [TOOL_CALLS]name[ARGS]{...}, once per call."""

    name = "mistral"
    keep_special_tokens = True
    tag = "[TOOL_CALLS]"
    opens = (tag,)
    args_tag = "[ARGS]"
    _name = re.compile(r"[A-Za-z0-9_.\-]*")

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        start = _skip_space(text, pos + len(self.tag))
        if start == len(text):
            return None
        if text[start] in "[{":
            return _json_calls(memo, text, start, "either", final, calls)
        m = self._name.match(text, start)
        name_end = m.end() if m else start
        if name_end == len(text) and not final:
            return None
        if name_end == start or not text.startswith(self.args_tag, name_end):
            if not final and self.args_tag.startswith(text[name_end:]):
                return None
            raise _NotFormat
        return _json_args(memo, text, name_end + len(self.args_tag), text[start:name_end], final, calls)


class DeepSeekV3Parser(_MarkedParser):
    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"
    opens = (calls_begin,)

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        p = pos + len(self.calls_begin)
        while True:
            status, which, p = _expect(text, p, (self.call_begin, self.calls_end), final)
            if status in (_WAIT, _END) or which == self.calls_end:
                return None
            if status == _FAIL:
                raise _NotFormat
            sep = text.find(self.sep, p)
            newline = text.find("\n", sep + len(self.sep)) if sep >= 0 else -1
            if newline < 0:
                if final:
                    raise _NotFormat
                return None
            name = text[sep + len(self.sep) : newline].strip()
            if not name or any(ch.isspace() for ch in name):
                raise _NotFormat
            start = _required(text, newline, "```json", final)
            if start is None:
                return None
            end = _json_args(memo, text, start, name, final, calls)
            if end is None:
                return None
            status, _, p = _expect(text, end, ("```",), final)
            if status == _OK:
                status, _, p = _expect(text, p, (self.call_end,), final)
            if status == _FAIL:
                raise _NotFormat
            if status != _OK:
                return None


class HarmonyParser(ToolParser):
    """gpt-oss: messages `[<|start|>assistant]<|channel|>C [to=R] [<|constrain|>T]<|message|>
    body<|end|>` (or <|call|>, <|return|>). A message to functions.NAME is a call with a JSON
    body (a malformed one ends the calls); the final channel (or commentary to no one) is
    content, joined by newlines as vLLM does; others (analysis, other recipients) are left out.
    Output that does not start as harmony is plain content."""

    name = "openai"
    keep_special_tokens = True
    start_tag, channel_tag, message_tag = "<|start|>", "<|channel|>", "<|message|>"
    ends = ("<|end|>", "<|call|>", "<|return|>")
    _recipient = re.compile(r"to=([^\s<]+)")
    _channel = re.compile(r"<\|channel\|>([^\s<]+)")

    def read(self, text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        heads = (self.start_tag, self.channel_tag)
        p = _skip_space(text, 0)
        if not text.startswith(heads, p):
            if not final and any(h.startswith(text[p:]) for h in heads):
                return Draft("")
            return Draft(text)
        contents: list[str] = []
        calls: list[CallDraft] = []
        while True:
            head = p + len(self.start_tag) if text.startswith(self.start_tag, p) else p
            m = text.find(self.message_tag, head)
            if m < 0:
                break  # a header still coming (or cut off at the end: left out)
            kind, fname = self._kind(text[head:m])
            body = m + len(self.message_tag)
            if kind == "call":  # a malformed call is left out, and what follows it
                reader = _json_at(memo, text, body, None, final)
                if not _object_args(reader) or (final and not reader.done):
                    break
                status, _, end = _expect(text, body + reader.consumed, self.ends, final)
                if reader.done and status == _FAIL:
                    break
                calls.append(CallDraft(fname, reader.text, reader.done))
                if status != _OK:
                    break
                p = end
            else:
                found = _first_of(text, body, self.ends)
                if found is None:
                    if kind == "content":
                        cut = 0 if final else _partial_tail(text, self.ends, body)
                        contents.append(text[body : len(text) - cut])
                    break
                if kind == "content":
                    contents.append(text[body : found[0]])
                p = found[0] + len(found[1])
            p = _skip_space(text, p)
            if not text.startswith(heads, p):
                break  # the end, or text after the last message (left out)
        return Draft("\n".join(contents), calls)

    def _kind(self, header: str) -> tuple[str, str]:
        recipient = self._recipient.search(header)
        channel = self._channel.search(header)
        to = recipient.group(1) if recipient else None
        if to is not None and to.startswith("functions.") and len(to) > len("functions."):
            return "call", to[len("functions.") :]
        ch = channel.group(1) if channel else None
        if ch == "final" or (ch == "commentary" and to is None):
            return "content", ""
        return "other", ""
