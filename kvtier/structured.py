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
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
            value = json.loads(value) if value.strip() else value
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        return f"{kind}:{flags}:" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint; ValueError for a malformed one."""
        llg = _llguidance()
        M = llg.LLMatcher
        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
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


def _closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not set it."""
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


class GrammarCompiler:
    """Matchers for one tokenizer: the llguidance tokenizer built once, each constraint's
    grammar validated once (cached by its key), a fresh matcher per sequence."""

    MAX_CACHED = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._grammars: dict[str, str] = {}
        self._lock = threading.Lock()

    def _ll(self):
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
        """The validated grammar of `spec`; ValueError naming what is wrong with it."""
        key = spec.key()
        with self._lock:
            cached = self._grammars.get(key)
        if cached is not None:
            return cached
        try:
            text = spec.grammar_text()
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(text, self._ll())
        if error:
            raise ValueError(f"structured_outputs: the {key.split(':', 1)[0]} constraint is not valid: {error}")
        with self._lock:
            if len(self._grammars) >= self.MAX_CACHED:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = text
        return text

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        llg = _llguidance()
        m = llg.LLMatcher(self._ll(), self.grammar(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return Matcher(m, self.vocab_size)


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
        return self._m.get_error() if self._m.is_error() else None


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
