"""The tool-call formats whose arguments are not JSON text (see tool_parsers.py for what a
parser promises): pythonic, Python calls read with ast and never evaluated; qwen3_coder, XML-ish
tags whose values are text converted with the tool's JSON schema."""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from kvtier.server.tool_parsers import (
    _OK,
    _WAIT,
    CallDraft,
    Draft,
    ToolParser,
    _expect,
    _failed,
    _first_of,
    _MarkedParser,
    _NotFormat,
    _partial_tail,
    _required,
    _skip_space,
)

# ---------------------------------------------------------------------- pythonic
_PY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_PY_KEYWORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t\r\n]*=(?!=)")
_PY_STRING = re.compile(
    r"[rRbBuUfF]{0,2}(?:\"\"\"(?:[^\"\\]|\\.|\"(?!\"\"))*\"\"\"|'''(?:[^'\\]|\\.|'(?!''))*'''"
    r"|\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*')",
    re.DOTALL,
)
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


def _py_value(node: ast.expr) -> Any:
    """A Python literal's value, as vLLM's pythonic parser takes them (no eval)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise _NotLiteral
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, (str, int, float)) for k in node.keys):
            raise _NotLiteral
        return {k.value: _py_value(v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_py_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in node.values):
        return "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _py_value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _NotLiteral


def _py_value_end(text: str, start: int) -> int | None:
    """Where the Python expression from `start` ends (at a ',' or ')' outside brackets and
    strings); None if the text ends first."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            if text.find(c, i + 1) < 0:
                return None  # no closing quote yet (checked before the slower match)
            m = _PY_STRING.match(text, i)
            if m is None:
                return None
            i = m.end()
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return i if c == ")" else -1
            depth -= 1
        elif c == "," and depth == 0:
            return i
        elif c == "#":
            return -1
        i += 1
    return None


class PythonicParser(ToolParser):
    """The whole output a Python list of calls with keyword arguments of literal values,
    parsed with ast (never evaluated); anything else is content."""

    name = "pythonic"

    def read(self, text: str, final: bool, memo: dict[Any, Any]) -> Draft:
        p = _skip_space(text, 0)
        if p == len(text):
            return Draft(text if final else "")
        if text[p] != "[":
            return Draft(text)
        calls: list[CallDraft] = []
        p += 1
        while True:
            p = _skip_space(text, p)
            if p == len(text):
                break
            if text[p] == "]" and calls:
                return _failed(text) if text[p + 1 :].strip() else Draft("", calls)
            m = _PY_NAME.match(text, p)
            if m is None:
                return _failed(text)
            if not final and m.end() == len(text) - 1 and text[-1] == ".":
                break  # a dotted name still coming
            status, _, q = _expect(text, m.end(), ("(",), final)
            if status == _WAIT or (m.end() == len(text) and not final):
                break
            if status != _OK:
                return _failed(text)
            call = CallDraft(m.group(), "{")
            calls.append(call)
            p = self._arguments(text, q, call, memo)
            if p < 0:
                return _failed(text)
            if not call.done:
                break
            status, which, p = _expect(text, p, (",", "]"), final)
            if status == _WAIT:
                break
            if status != _OK:
                return _failed(text)
            if which == "]":
                p -= 1
        if final:
            return _failed(text)
        return Draft("", calls)

    def _arguments(self, text: str, p: int, call: CallDraft, memo: dict[Any, Any]) -> int:
        """Reads `k=v, ...)` from p into call.arguments; the position after ')' once the call
        is done, the position reached otherwise, -1 if malformed."""
        pieces: list[str] = []
        seen: set[str] = set()
        while True:
            p = _skip_space(text, p)
            if p == len(text):
                break
            if text[p] == ")":
                call.done = True
                p += 1
                break
            m = _PY_KEYWORD.match(text, p)
            if m is None:
                rest = text[p:]
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*[ \t\r\n]*", rest):
                    break  # a keyword still coming
                return -1
            end = _py_value_end(text, m.end())
            if end is None:
                break
            if end < 0 or m.group(1) in seen:
                return -1
            piece = memo.get((m.end(), end))  # a stream reads each value once
            if piece is None:
                try:
                    value = _py_value(ast.parse(text[m.end() : end].strip(), mode="eval").body)
                except (SyntaxError, ValueError, _NotLiteral):
                    return -1
                piece = memo[(m.end(), end)] = f"{json.dumps(m.group(1))}: {json.dumps(value, ensure_ascii=False)}"
            seen.add(m.group(1))
            pieces.append(piece)
            p = end + 1 if text[end] == "," else end
        call.arguments = "{" + ", ".join(pieces) + ("}" if call.done else "")
        return p


# ---------------------------------------------------------------------- qwen3_coder
_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (type, enum values, anyOf/oneOf/allOf); {"string"} when
    it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    t = schema.get("type")
    for name in [t] if isinstance(t, str) else t if isinstance(t, list) else []:
        if isinstance(name, str):
            types.add(_TYPE_ALIASES.get(name.strip().lower(), name.strip().lower()))
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add("null" if value is None else next((n for k, n in _ENUM_TYPES if isinstance(value, k)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            types |= schema_types(option)
    return types or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def coerce(value: str, types: set[str]) -> Any:
    """A parameter's text as the first of its schema's types it reads as (null, integer,
    number, boolean, object, array, string), as vLLM's coerce_to_schema_type."""
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in types:
            continue
        if t == "null" and value.lower() == "null":
            return None
        if t == "string":
            return value
        if t == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if t == "number":
            try:
                x = float(value)
            except ValueError:
                continue
            if math.isfinite(x):
                return int(x) if x == int(x) else x
        if t == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


class Qwen3CoderParser(_MarkedParser):
    """<tool_call><function=NAME><parameter=P>\\nVALUE\\n</parameter>...</function></tool_call>.
    A value ends at </parameter>, the next <parameter= or </function>; one newline either side
    of it is markup. Values are text converted with the tool's schema (`coerce`); a string
    value streams as it is written. A call cut off by the end of the output is closed there."""

    name = "qwen3_coder"
    keep_special_tokens = True
    opens = ("<tool_call>", "<function=")
    value_ends = ("</parameter>", "<parameter=", "</function>")
    _bad_name = re.compile(r"[{}<>\"' \t\r\n]")

    def _calls_at(self, text: str, pos: int, final: bool, memo: dict[Any, Any], calls: list[CallDraft]) -> int | None:
        p = pos + len("<tool_call>") if text.startswith("<tool_call>", pos) else pos
        start = _required(text, p, "<function=", final)
        if start is None:
            return None
        gt = text.find(">", start)
        name = text[start:gt] if gt >= 0 else text[start:]
        if self._bad_name.search(name) or (gt >= 0 and not name) or (gt < 0 and final):
            raise _NotFormat
        if gt < 0:
            return None
        call = CallDraft(name, "{")
        calls.append(call)
        p = self._parameters(text, gt + 1, final, call, memo)
        if not call.done:
            return None
        status, _, p = _expect(text, p, ("</tool_call>",), final)
        return None if status == _WAIT else p

    def _properties(self, name: str) -> dict[str, Any] | None:
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties")
                return props if isinstance(props, dict) and props else None
        return None

    def _parameters(self, text: str, p: int, final: bool, call: CallDraft, memo: dict[Any, Any]) -> int:
        props = self._properties(call.name or "")
        pieces: list[str] = []
        partial = ""
        while True:  # text between parameters is skipped
            found = _first_of(text, p, ("</function>", "<parameter="))
            if found is None or found[1] == "</function>":
                call.done = final or found is not None
                p = found[0] + len("</function>") if found else len(text)
                break
            p = found[0] + len("<parameter=")
            gt = text.find(">", p)
            if gt < 0:
                call.done = final
                break
            key = text[p:gt].strip()
            found = _first_of(text, gt + 1, self.value_ends)
            if found is None and not final:
                if props is None or key not in props or schema_types(props[key]) == {"string"}:
                    raw = text[gt + 1 : len(text) - _partial_tail(text, self.value_ends, gt + 1)]
                    raw = raw[1:] if raw.startswith("\n") else raw
                    raw = raw[:-1] if raw.endswith("\n") else raw
                    partial = f"{json.dumps(key, ensure_ascii=False)}: " + _escaped_prefix(memo, gt, raw)
                break
            end = found[0] if found else len(text)
            raw = text[gt + 1 : end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            value: Any = raw if props is None or key not in props else coerce(raw, schema_types(props[key]))
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            p = end + len("</parameter>") if found and found[1] == "</parameter>" else end
        body = ", ".join(pieces + ([partial] if partial else []))
        call.arguments = "{" + body + ("}" if call.done else "")
        return p


def _escaped_prefix(memo: dict[Any, Any], key: int, raw: str) -> str:
    """'"' and the JSON escape of `raw`, a string value growing in a stream (escaping goes
    character by character: only what is new since the last call is escaped)."""
    seen, escaped = memo.get(("escaped", key), ("", '"'))
    if not raw.startswith(seen):
        seen, escaped = "", '"'
    escaped += json.dumps(raw[len(seen) :], ensure_ascii=False)[1:-1]
    memo[("escaped", key)] = (raw, escaped)
    return escaped
