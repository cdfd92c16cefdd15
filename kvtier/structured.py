"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, a
choice of strings or a grammar (Lark or GBNF), as vLLM's `StructuredOutputsParams`.

The grammar engine is llguidance (an optional extra, `pip install kvtier[structured]`): a Rust
library with no Python dependencies that computes the allowed-token mask of a grammar state
quickly and releases the GIL while it does. (xgrammar, vLLM's default, needs
torch, transformers and triton; outlines-core needs its own vocabulary index per schema.)

Per sequence a `Matcher` follows the tokens generated so far. Each step the engine asks it for
the mask of allowed next tokens (computed on a helper thread while the forward pass runs), the
sampler masks the logits with it, and the sampled token is fed back. When the grammar is
complete only EOS stays allowed, so the sequence ends there.

Hostile constraints are bounded (`LIMITS`): the number of choices, the size of any
constraint's text and a JSON schema's nesting are checked when the params are built (a
ValueError naming the field); llguidance's parser limits (`parser_limits`, its "fuel") bound
what compiling and matching may cost, and `GrammarCompiler.check` compiles a constraint and
computes its first mask once, so a grammar llguidance gives up on (too many lexer states,
too many parser items, a `$ref` that only loops) is refused before it runs. The server calls
`check` on a worker thread under `LIMITS.compile_timeout_s`; the result is cached, so the
engine's `matcher()` is cheap. A grammar that still fails while decoding ends its sequence
with finish_reason "error" (kvtier.engine.core), never "stop". Error texts are short: the
first line of llguidance's message, never a Rust backtrace.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ConstraintLimits:
    """What one structured-outputs constraint may ask for."""

    max_choices: int = 1024
    """`choice`: at most this many strings."""
    max_bytes: int = 64 * 1024
    """The constraint's text (schema, regex, grammar, or all choices together), in UTF-8 bytes."""
    max_schema_depth: int = 64
    """A JSON schema's nesting of objects and arrays."""
    compile_timeout_s: float = 10.0
    """The server's deadline for compiling (validating) a new constraint off the event loop."""
    probe_tokens: int = 4
    """Validation follows the grammar this many tokens (the lowest allowed id each step): a
    lexer or parser that blows up does so at its first tokens, mostly."""
    max_error_chars: int = 300
    """An error message of llguidance's is cut to its first line and this many characters."""


LIMITS = ConstraintLimits()


class StructuredOutputError(ValueError):
    """A constraint that cannot be honoured. `reason`: a short label (the
    kvtier:structured_output_errors_total `reason`): too_large, too_deep, invalid, too_complex,
    timeout."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


def short_error(text: str) -> str:
    """llguidance's error text fit for a client: its first line, trimmed (a Rust panic's
    backtrace and the parser state dump never reach one)."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "unknown error")
    line = line.removeprefix("<non-verbose/>").strip() or "unknown error"
    cap = LIMITS.max_error_chars
    return line if len(line) <= cap else line[: cap - 3] + "..."


def _depth(value: Any, cap: int) -> int:
    """The nesting depth of dicts and lists in `value`, counted without recursion and no
    further than cap + 1."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > cap:
            return deepest
        stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, dict or string), `json_object` (any JSON
    object), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or
    llama.cpp's GBNF). As vLLM's: JSON may carry any whitespace between tokens unless
    `disable_any_whitespace` (then the compact `, ` and `: ` forms only);
    `disable_additional_properties` closes every object of the schema that does not say."""

    json: Any = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    """vLLM's; not implemented: a value is refused."""
    structural_tag: str | None = None
    """vLLM's; not implemented: a value is refused."""

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported by kvtier; leave it out")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")
        self._check_limits()

    def _check_limits(self) -> None:
        """LIMITS: the number of choices, the constraint's size and a schema's depth (cheap:
        no recursion, no compiling); a StructuredOutputError naming the field and the cap."""
        cap = LIMITS.max_bytes
        if self.choice is not None:
            if len(self.choice) > LIMITS.max_choices:
                raise StructuredOutputError(
                    f"structured_outputs.choice has {len(self.choice)} strings; at most {LIMITS.max_choices}",
                    "too_large",
                )
            size = sum(len(c.encode()) for c in self.choice)
            if size > cap:
                raise StructuredOutputError(
                    f"structured_outputs.choice is {size} bytes in all; at most {cap}", "too_large"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and len(value.encode()) > cap:
                raise StructuredOutputError(
                    f"structured_outputs.{name} is {len(value.encode())} bytes; at most {cap}", "too_large"
                )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                if len(schema.encode()) > cap:
                    raise StructuredOutputError(
                        f"structured_outputs.json is {len(schema.encode())} bytes; at most {cap}", "too_large"
                    )
                schema = _parse_schema(schema)
            depth = _depth(schema, LIMITS.max_schema_depth)
            if depth > LIMITS.max_schema_depth:
                raise StructuredOutputError(
                    f"structured_outputs.json nests deeper than {LIMITS.max_schema_depth} levels", "too_deep"
                )
            if isinstance(self.json, dict):
                try:
                    size = len(json.dumps(schema).encode())
                except (TypeError, ValueError) as e:
                    raise StructuredOutputError(f"structured_outputs.json is not JSON: {e}") from None
                if size > cap:
                    raise StructuredOutputError(f"structured_outputs.json is {size} bytes; at most {cap}", "too_large")

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """From itself, a dict of its fields (as it travels between processes), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r} (known: {', '.join(KINDS)})")
            return cls(**{k: v for k, v in value.items() if v is not None})
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")

    def key(self) -> str:
        """A stable text naming the constraint (the compiled-grammar cache key)."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            value = _parse_schema(value) if value.strip() else value
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        return f"{kind}:{flags}:" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint; ValueError for a malformed one."""
        llg = _llguidance()
        M = llg.LLMatcher
        options = {"whitespace_flexible": not self.disable_any_whitespace}
        try:
            if self.json is not None:
                schema = _parse_schema(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, dict):
                    raise ValueError("structured_outputs.json must be a JSON object (a schema)")
                if self.disable_additional_properties:
                    schema = _closed(schema)
                return M.grammar_from_json_schema(schema, overrides=options)
            if self.json_object:
                return M.grammar_from_json_schema({"type": "object"}, overrides=options)
            if self.regex is not None:
                return M.grammar_from_regex(self.regex)
            if self.choice is not None:
                return llg.grammar_from("choice", json.dumps(self.choice))
            return llg.grammar_from("grammar", self.grammar)
        except RecursionError:  # a backstop: _check_limits bounds a schema's depth first
            raise StructuredOutputError("structured_outputs: the constraint nests too deeply", "too_deep") from None
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance's own errors (a Rust panic too): first line
            raise StructuredOutputError(f"structured_outputs: {short_error(str(e))}") from None


def _parse_schema(text: str) -> Any:
    """A schema given as text, parsed; StructuredOutputError when it is not JSON or nests
    too deeply for the parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise StructuredOutputError(
            f"structured_outputs.json nests deeper than {LIMITS.max_schema_depth} levels", "too_deep"
        ) from None
    except ValueError as e:
        raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {e}") from None


def _closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not set
    it (recursive: the schema's depth is bounded by LIMITS.max_schema_depth first)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            "structured outputs need llguidance: pip install 'kvtier[structured]' (or pip install llguidance)"
        ) from None
    return llguidance


def parser_limits() -> Any:
    """llguidance's limits for every grammar kvtier compiles or matches: its defaults (the
    "fuel" of the lexer, the parser's items per step, the grammar's size), with short errors."""
    return _llguidance().LLParserLimits(verbose_errors=False)


class GrammarCompiler:
    """Matchers for one tokenizer: the llguidance tokenizer built once, each constraint's
    grammar validated once (cached by its key, refusals too), a fresh matcher per sequence.
    Thread-safe: the server calls `check` on worker threads, the engine `matcher`."""

    MAX_CACHED = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._grammars: dict[str, str | StructuredOutputError] = {}
        self._lock = threading.Lock()

    def _ll(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                backend = getattr(self.tokenizer, "backend_json", None)
                if backend is None:
                    raise ValueError("structured outputs need a Hugging Face `tokenizers` tokenizer")
                self._ll_tokenizer = llg.LLTokenizer(
                    backend(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._ll_tokenizer

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar of `spec`: compiled under `parser_limits()` and its first mask
        computed once, so a grammar llguidance cannot follow from the start is refused here.
        StructuredOutputError (a ValueError) naming what is wrong; the answer is cached."""
        key = spec.key()
        with self._lock:
            cached = self._grammars.get(key)
        if isinstance(cached, StructuredOutputError):
            raise StructuredOutputError(str(cached), cached.reason)
        if cached is not None:
            return cached
        try:
            result: str | StructuredOutputError = self._compile(spec, key)
        except StructuredOutputError as e:
            result = e
        except ValueError as e:
            result = StructuredOutputError(str(e))
        with self._lock:
            if len(self._grammars) >= self.MAX_CACHED:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = result
        if isinstance(result, StructuredOutputError):
            raise StructuredOutputError(str(result), result.reason)
        return result

    def _compile(self, spec: StructuredOutputsParams, key: str) -> str:
        text = spec.grammar_text()
        kind = key.split(":", 1)[0]
        llg = _llguidance()
        limits = parser_limits()
        try:
            error = llg.LLMatcher.validate_grammar(text, self._ll(), limits=limits)
            if error:
                raise StructuredOutputError(
                    f"structured_outputs: the {kind} constraint is not valid: {short_error(error)}"
                )
            m = llg.LLMatcher(self._ll(), text, log_level=0, limits=limits)
            _probe(m, LIMITS.probe_tokens)
        except StructuredOutputError:
            raise
        except RecursionError:
            raise StructuredOutputError("structured_outputs: the constraint nests too deeply", "too_deep") from None
        except Exception as e:  # noqa: BLE001 - a Rust panic surfaces as one: its first line only
            raise StructuredOutputError(
                f"structured_outputs: the {kind} constraint failed: {short_error(str(e))}"
            ) from None
        if m.is_error():
            raise StructuredOutputError(
                f"structured_outputs: the {kind} constraint is too complex to follow: {short_error(m.get_error())}",
                "too_complex",
            )
        return text

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile and validate `spec` (cached): StructuredOutputError when it cannot be
        honoured. The server runs it on a worker thread before the engine sees the request."""
        self.grammar(spec)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        llg = _llguidance()
        m = llg.LLMatcher(self._ll(), self.grammar(spec), log_level=0, limits=parser_limits())
        if m.is_error():
            raise StructuredOutputError(f"structured_outputs: {short_error(m.get_error())}")
        return Matcher(m, self.vocab_size)


def _probe(m: Any, steps: int) -> None:
    """Follow `m` for up to `steps` tokens, each the lowest id its mask allows (EOS once
    nothing else is), leaving it in error if llguidance gives up on the grammar on the way."""
    for _ in range(steps):
        if m.is_error() or m.is_stopped():
            return
        bits = m.compute_bitmask()
        if m.is_error():
            return
        token = next((i * 8 + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1), None)
        if token is None or not m.consume_token(token):
            return


class Matcher:
    """One sequence's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self.vocab_size)

    def allowed(self):
        """A bool tensor [vocab]: the tokens the grammar allows next (all False once in error)."""
        return allowed_masks([self])[0]

    def consume(self, token_id: int) -> bool:
        """Feed the sampled token; False when the grammar refused it (then in error)."""
        return bool(self._m.consume_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar is complete (only EOS may follow)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        """Why the grammar failed (short_error's form), or None while it has not."""
        return short_error(self._m.get_error()) if self._m.is_error() else None


def allowed_masks(matchers: list[Matcher]):
    """The next-token masks of several sequences at once: a bool tensor [len(matchers), vocab]
    (a row is all False once its grammar is in error). One unpacking for all the bitmasks."""
    import torch

    vocab = matchers[0].vocab_size
    raws = [m._m.compute_bitmask() for m in matchers]
    width = max(len(r) for r in raws)
    bits = torch.frombuffer(bytearray(b"".join(r.ljust(width, b"\0") for r in raws)), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    mask = ((bits.view(len(raws), width, 1) >> shifts) & 1).view(len(raws), width * 8).bool()
    if mask.shape[1] >= vocab:
        return mask[:, :vocab]
    return torch.cat([mask, torch.zeros(len(raws), vocab - mask.shape[1], dtype=torch.bool)], dim=1)
