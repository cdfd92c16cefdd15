"""An incremental JSON reader for streamed tool calls: fed a model's text as it grows, it
validates one JSON value and writes it out again as `json.dumps(value, ensure_ascii=False)`
would (", " and ": " separators, strings re-escaped, numbers as Python prints them), a piece at
a time and only what no later text can change. So the arguments of a call stream as fragments
whose concatenation is the final arguments text, exactly.

    text in:   {"name":"f",  "arguments":{"a":[1,2.50]}}
    canonical: {"name": "f", "arguments": {"a": [1, 2.5]}}
                        ^ name span           ^ arguments span

Besides the canonical text, the reader finds the call objects in the value ({"name": ...,
"arguments" or "parameters": ...}: the value itself, the items of an array, or either) and
records where each one's name and arguments are in the canonical text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
ARGUMENT_KEYS = ("arguments", "parameters")

# what the reader expects next
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER, _STRING, _NUMBER_TOKEN, _LITERAL = range(9)


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass(slots=True)
class CallSpans:
    """One call object's name and arguments, as offsets into the canonical text (an end of
    None: not yet closed)."""

    name_start: int | None = None
    name_end: int | None = None
    args_start: int | None = None
    args_end: int | None = None
    closed: bool = False


class JsonReader:
    """Reads one JSON value from text fed in pieces (`feed`), then `close` at the end of the
    output. `calls_in`: None (no call objects), "value" (the value is one call object),
    "array" (an array of them) or "either"."""

    def __init__(self, calls_in: str | None = None) -> None:
        self.calls_in = calls_in
        self.consumed = 0
        """Characters fed and read; once `done`, `consumed` is where the value ends."""
        self.done = False
        self.error: str | None = None
        self.calls: list[CallSpans] = []
        self._out: list[str] = []
        self._size = 0
        self._joined = ""
        self._stack: list[str] = []
        self._state = _VALUE
        self._token = ""  # a number or literal being read
        self._escape = ""  # an escape sequence being read
        self._high = ""  # a high surrogate waiting for its low half
        self._string_start = 0
        self._is_key = False
        self._key = ""
        self._call_depth: int | None = None  # len(stack) inside a call object
        self._member: str | None = None  # "name" or "args" for the call member being read

    # ------------------------------------------------------------------ results
    @property
    def text(self) -> str:
        """The canonical text so far."""
        if len(self._joined) != self._size:
            self._joined = "".join(self._out)
            self._out = [self._joined]
        return self._joined

    def name(self, call: CallSpans) -> str | None:
        """The call's name once its string has closed (None before, or if it is no string or
        an empty one)."""
        if call.name_end is None or call.name_start is None:
            return None
        value = json.loads(self.text[call.name_start : call.name_end])
        return value if isinstance(value, str) and value else None

    def arguments(self, call: CallSpans) -> str:
        """The call's arguments text so far: its canonical JSON, or a string argument's own text
        (a model that writes "arguments": "{\\"a\\": 1}"); "{}" for a closed call without them."""
        if call.args_start is None:
            return "{}" if call.closed else ""
        text = self.text[call.args_start : call.args_end if call.args_end is not None else self._size]
        if text.startswith('"'):
            return json.loads(text if call.args_end is not None else text + '"')
        return text

    # ------------------------------------------------------------------ reading
    def feed(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n and not self.done and self.error is None:
            i = self._step(text, i)
        self.consumed += i

    def close(self) -> None:
        """The output ended: a number at the very end is complete; anything else open is not."""
        if self.error is None and not self.done and self._state == _NUMBER_TOKEN:
            self._end_number()

    def _emit(self, piece: str) -> None:
        self._out.append(piece)
        self._size += len(piece)

    def _fail(self, why: str) -> int:
        self.error = why
        return 0

    def _step(self, text: str, i: int) -> int:
        c = text[i]
        state = self._state
        if state == _STRING:
            return self._string_step(text, i)
        if state == _NUMBER_TOKEN:
            if c in _NUMBER_CHARS:
                self._token += c
                return i + 1
            self._end_number()
            return i
        if state == _LITERAL:
            self._token += c
            word = _LITERALS[self._token[0]]
            if not word.startswith(self._token):
                return self._fail(f"not JSON: {self._token!r}")
            if self._token == word:
                self._emit(word)
                self._end_value()
            return i + 1
        if c in _WS:
            return i + 1
        if state == _COLON:
            if c != ":":
                return self._fail("expected ':'")
            self._emit(": ")
            self._state = _VALUE
            self._start_member()
            return i + 1
        if state == _AFTER:
            top = self._stack[-1]
            if c == ",":
                self._emit(", ")
                self._state = _KEY if top == "{" else _VALUE
                return i + 1
            if c == ("}" if top == "{" else "]"):
                return self._close(c, i)
            return self._fail(f"expected ',' or {'}' if top == '{' else ']'!r}")
        if state in (_KEY, _KEY_OR_CLOSE):
            if c == '"':
                self._start_string(is_key=True)
                return i + 1
            if c == "}" and state == _KEY_OR_CLOSE:
                return self._close(c, i)
            return self._fail("expected a key")
        if c == "]" and state == _VALUE_OR_CLOSE:
            return self._close(c, i)
        return self._start_value(c, i)

    def _start_value(self, c: str, i: int) -> int:
        if c in "{[":
            if c == "{" and self._opens_call():
                self.calls.append(CallSpans())
                self._call_depth = len(self._stack) + 1
            elif c == "[" and not self._stack and self.calls_in in ("array", "either"):
                pass
            elif (not self._stack and self.calls_in is not None) or (
                len(self._stack) == 1 and self._call_depth is None and self.calls_in in ("array", "either")
            ):
                return self._fail("expected a tool call object")
            self._stack.append(c)
            self._emit(c)
            self._state = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
            return i + 1
        if self.calls_in is not None and (not self._stack or (len(self._stack) == 1 and self._call_depth is None)):
            return self._fail("expected a tool call object")
        if c == '"':
            self._start_string(is_key=False)
            return i + 1
        if c == "-" or c.isdigit():
            self._token, self._state = c, _NUMBER_TOKEN
            return i + 1
        if c in _LITERALS:
            self._token, self._state = c, _LITERAL
            return i + 1
        return self._fail(f"not JSON: {c!r}")

    def _opens_call(self) -> bool:
        if self.calls_in is None or self._call_depth is not None:
            return False
        if not self._stack:
            return self.calls_in in ("value", "either")
        return len(self._stack) == 1 and self._stack[0] == "["

    def _start_member(self) -> None:
        """A value of the call object starts (after its key's ':')."""
        if self._call_depth is None or len(self._stack) != self._call_depth:
            return
        self._member = None
        call = self.calls[-1]
        if self._key == "name" and call.name_start is None:
            call.name_start, self._member = self._size, "name"
        elif self._key in ARGUMENT_KEYS and call.args_start is None:
            call.args_start, self._member = self._size, "args"

    def _start_string(self, is_key: bool) -> None:
        self._is_key = is_key
        self._string_start = self._size
        self._emit('"')
        self._state = _STRING

    def _string_step(self, text: str, i: int) -> int:
        c = text[i]
        if self._escape:
            self._escape += c
            if self._escape[1] != "u":
                ch = _ESCAPES.get(c)
                if ch is None:
                    return self._fail(f"bad escape {self._escape!r}")
                self._escape = ""
                self._add_char(ch)
            elif len(self._escape) == 6:
                digits = self._escape[2:]
                self._escape = ""
                if not all(d in "0123456789abcdefABCDEF" for d in digits):
                    return self._fail("bad \\u escape")
                self._add_char(chr(int(digits, 16)))
            return i + 1
        if c == "\\":
            self._escape = c
            return i + 1
        self._flush_high()
        if c == '"':
            self._emit('"')
            if self._is_key:
                if len(self._stack) == self._call_depth:  # only a call object's keys matter
                    self._key = json.loads(self.text[self._string_start :])
                self._state = _COLON
            else:
                self._end_value()
            return i + 1
        if c < " ":
            return self._fail("a control character in a string")
        m = _STRING_RUN.match(text, i)
        assert m is not None
        self._emit(_escaped(m.group()))
        return m.end()

    def _add_char(self, ch: str) -> None:
        """A character from an escape: surrogate pairs are joined; a lone surrogate stays an
        escape (it has no UTF-8 form)."""
        if "\udc00" <= ch <= "\udfff" and self._high:
            ch = chr(0x10000 + ((ord(self._high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
            self._high = ""
        else:
            self._flush_high()
            if "\ud800" <= ch <= "\udbff":
                self._high = ch
                return
        self._emit(f"\\u{ord(ch):04x}" if "\ud800" <= ch <= "\udfff" else _escaped(ch))

    def _flush_high(self) -> None:
        if self._high:
            self._emit(f"\\u{ord(self._high):04x}")
            self._high = ""

    def _end_number(self) -> None:
        token = self._token
        if _NUMBER.fullmatch(token) is None:
            self._fail(f"not a JSON number: {token!r}")
            return
        self._emit(json.dumps(json.loads(token)))
        self._end_value()

    def _close(self, c: str, i: int) -> int:
        self._stack.pop()
        self._emit(c)
        if self._call_depth is not None and len(self._stack) == self._call_depth - 1:
            call = self.calls[-1]
            call.closed = True
            self._call_depth = None
            if call.name_end is None or self.name(call) is None:
                return self._fail('a tool call needs a "name" (a non-empty string)')
        self._end_value()
        return i + 1

    def _end_value(self) -> None:
        """A value has ended (the stack is as it was before it started)."""
        if self._call_depth is not None and len(self._stack) == self._call_depth and self._member is not None:
            call = self.calls[-1]
            if self._member == "name":
                call.name_end = self._size
            else:
                call.args_end = self._size
            self._member = None
        if not self._stack:
            self.done = True
            self._state = _AFTER
        else:
            self._state = _AFTER
