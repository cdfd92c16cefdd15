"""Tokenizer and chat template from a model directory (tokenizer.json + tokenizer_config.json), or
from a GGUF file's tokenizer metadata (kvtier.model.gguf).

Uses the `tokenizers` library for encoding and a sandboxed jinja2 environment for the chat
template, configured like transformers renders it, so no transformers import is needed.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
    pass


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


def has_tokenizer(path: str | Path) -> bool:
    """Whether `path` (a model directory or GGUF file) carries a tokenizer `Tokenizer` can load."""
    from kvtier.model import gguf

    path = Path(path)
    return gguf.is_gguf(path) or (path / "tokenizer.json").is_file()


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        from kvtier.model import gguf

        model_dir = Path(model_dir)
        if gguf.is_gguf(model_dir):  # built from the file's tokenizer metadata
            self._tok, cfg = gguf.open_checkpoint(str(model_dir)).tokenizer_parts()
        else:
            path = model_dir / "tokenizer.json"
            if not path.is_file():
                raise TokenizerError(
                    f"no tokenizer.json in {model_dir}; pass token ids instead of text, or add the "
                    "model's fast tokenizer file (tokenizer.json)"
                )
            self._tok = _HFTokenizer.from_file(str(path))
            cfg_path = model_dir / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.config = cfg
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and model_dir.is_dir() and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled: Template | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is not None:
            self.eos_token_ids = (eos_id,)
        self.all_special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Releases the GIL while the Rust tokenizer runs (the batch API
        does, `encode` does not), so a long text encoded on a worker thread does not stall
        the other threads (an event loop, the engine)."""
        if not isinstance(text, str):
            raise TokenizerError(f"prompt must be a string, got {type(text).__name__}")
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            m = _SURROGATE.search(text)
            if m is None:
                raise
            raise TokenizerError(
                f"the text has a lone UTF-16 surrogate (U+{ord(m.group()):04X} "
                f"at character {m.start()}); it is not Unicode text"
            ) from None

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the characters of text that one token stands for, or None when
        there is none: a text of more than `n * max_chars_per_token` characters has more than
        `n` tokens, so a server can reject it as too long without tokenizing it.

        The bound is the longest vocabulary entry (added tokens included), times how much the
        normalizer can shrink text. None where unbounded text can become few tokens: a
        normalizer or pre-tokenizer that drops characters (Strip, BERT's, whitespace
        splitters), or an unknown token that swallows whole words or runs (WordPiece,
        WordLevel, unk-fusing BPE or Unigram without byte fallback)."""
        spec = json.loads(self._tok.to_str())
        shrink = _normalizer_shrink(spec.get("normalizer"))
        if (
            shrink is None
            or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
            or not _model_has_no_swallowing_unk(spec.get("model") or {})
        ):
            return None
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return math.ceil(longest * shrink)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja) as the chat template from now on; a syntax error raises
        TokenizerError here rather than at the first request."""
        from jinja2 import TemplateError

        try:
            compiled = _jinja_env().from_string(template)
        except TemplateError as e:
            raise TokenizerError(f"the chat template does not compile: {e}") from None
        self.chat_template, self._compiled = template, compiled

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered by the model's chat template (or `chat_template`, a Jinja
        string given with the request). `continue_final_message` ends the text inside the
        last message (an assistant turn to be continued), as transformers does: rendered
        without a generation prompt and cut after that message's content."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise TokenizerError(
                "this model has no chat template (tokenizer_config.json has no "
                "'chat_template'); use generate() with a plain prompt"
            )
        if continue_final_message and add_generation_prompt:
            raise TokenizerError(
                "continue_final_message and add_generation_prompt cannot both be "
                "true: a conversation either continues the last message or "
                "starts a new turn"
            )
        validate_messages(messages)
        if chat_template is None:
            if self._compiled is None:
                self._compiled = _jinja_env().from_string(template)  # template is self.chat_template
            compiled = self._compiled
        else:
            compiled = _jinja_env().from_string(chat_template)
        text = compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise TokenizerError("continue_final_message needs a last message with text content")
            for part in (final, final.strip()):
                if part in text:
                    return text[: text.rindex(part) + len(part)]
            raise TokenizerError(
                "continue_final_message: the chat template does not render the "
                "last message's content verbatim, so it cannot be continued"
            )
        return text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _normalizer_shrink(spec: dict[str, Any] | None) -> float | None:
    """How many characters of input one character of normalized text can come from at most;
    None when a normalizer may delete characters outright."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1.0
    if kind in ("NFC", "NFKC"):
        return 4.0  # canonical composition: at most 4 code points into 1 (e.g. U+1F82)
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None
        return max(1.0, len(pattern["String"]) / len(content))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, anything new


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _model_has_no_swallowing_unk(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "BPE":
        return spec.get("unk_token") is None or spec.get("byte_fallback") or not spec.get("fuse_unk")
    if kind == "Unigram":
        return bool(spec.get("byte_fallback"))
    return False  # WordPiece, WordLevel: an unknown word of any length is one token


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise TokenizerError(f"message {i} must be a dict with a 'role' and a 'content'")
        if not isinstance(m["role"], str):
            raise TokenizerError(f"message {i}: role must be a string")


def _jinja_env() -> ImmutableSandboxedEnvironment:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_byte_tokenizer(out_dir: str | Path) -> int:
    """Write a byte-level tokenizer (256 byte tokens + <s>, </s>, <pad>, role markers) with a
    chat template into out_dir; returns its vocabulary size. Needs only `tokenizers`."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": BYTE_CHAT_TEMPLATE,
                "model_max_length": 8192,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    return tok.get_vocab_size(with_added_tokens=True)
