"""Tokenizer and chat template from a model directory (tokenizer.json + tokenizer_config.json), or
from a GGUF file's tokenizer metadata (kvtier.model.gguf).

Uses the `tokenizers` library for encoding and a sandboxed jinja2 environment for the chat
template, configured like transformers renders it, so no transformers import is needed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

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
        limits: RenderLimits | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered by the model's chat template (or `chat_template`, a Jinja
        string given with the request). `continue_final_message` ends the text inside the
        last message (an assistant turn to be continued), as transformers does: rendered
        without a generation prompt and cut after that message's content.

        Every render is bounded by `limits` (default RenderLimits()): a template that builds a
        value or output over `max_chars`, iterates `range` over `max_range_items` in all, or
        runs past `timeout_s` raises jinja2's SecurityError (a TemplateError). A request's
        `chat_template` is untrusted: its render is also interrupted mid-loop at the deadline
        (a line tracer on this thread while it renders). `kwargs` naming a render variable or
        a template global (RESERVED_TEMPLATE_NAMES) raise TokenizerError."""
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
        clash = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
        if clash:
            raise TokenizerError(
                f"chat_template_kwargs cannot set {', '.join(clash)}: the chat template's own variables"
            )
        validate_messages(messages)
        variables = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        with _rendering(limits or RenderLimits(), untrusted=chat_template is not None) as budget:
            if chat_template is None:
                if self._compiled is None:
                    self._compiled = _jinja_env().from_string(template)  # template is self.chat_template
                compiled = self._compiled
            else:
                with _template_faults():
                    compiled = _jinja_env(untrusted=True).from_string(chat_template)
            text = budget.render(compiled, variables)
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


RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "bos_token",
        "eos_token",
        "chat_template",
        "continue_final_message",
        "limits",
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "namespace",
        "cycler",
        "joiner",
        "lipsum",
    }
)
"""Names chat_template_kwargs may not set: apply_chat_template's arguments, the variables it
renders with and the template's globals (a kwarg would replace them, e.g. the budgeted range)."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one chat-template render (see Tokenizer.apply_chat_template)."""

    max_chars: int = 4 << 20
    """The longest string, list or int (in digits, roughly) a template may build, and the
    longest text it may render."""
    max_range_items: int = 1_000_000
    """Items all of a render's `range` calls may produce together (nested loops multiply)."""
    timeout_s: float = 2.0
    """Wall-clock seconds one render (compile included) may take."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    """Where time is read (injectable for tests)."""


class _Budget:
    """One render's state: what is left of its `range` items and its deadline."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.range_left = limits.max_range_items
        self.deadline = limits.clock() + limits.timeout_s

    def fail(self, what: str) -> NoReturn:
        from jinja2.sandbox import SecurityError

        raise SecurityError(f"the chat template {what}")

    def check_time(self) -> None:
        if self.limits.clock() > self.deadline:
            self.fail(f"ran past its {self.limits.timeout_s:g} s limit")

    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.limits.max_chars:
            self.fail(f"built {what} over {self.limits.max_chars} items (chars)")

    def checked(self, value: Any) -> Any:
        """`value`, refused when it is a string/list/int over the size cap."""
        self.check_size(_size(value, self.limits.max_chars))
        return value

    def range(self, *args: Any) -> range:
        r = range(*args)
        self.range_left -= len(r)
        if self.range_left < 0:
            self.fail(f"iterated range() over {self.limits.max_range_items} items in all")
        self.check_time()
        return r

    def check_args(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Refuse integer arguments over the size cap (widths, counts: "x".ljust(10**9),
        center(10**9)) before the call allocates anything."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and abs(a) > self.limits.max_chars:
                self.fail(f"passed {a} where at most {self.limits.max_chars} is allowed")

    def check_format(self, fmt: Any) -> None:
        """Refuse a %- or str.format format string with a width or precision over 6 digits."""
        if isinstance(fmt, str) and _HUGE_FIELD.search(fmt):
            self.fail("used a format width or precision over 6 digits")

    def binop(self, op: str, left: Any, right: Any) -> None:
        """Refuse `left op right` when its result would be over the size cap, before it is computed."""
        cap = self.limits.max_chars
        if op == "*":
            if isinstance(left, int) and not isinstance(right, int):
                left, right = right, left
            if isinstance(right, int) and not isinstance(left, (int, float)):
                self.check_size(_size(left, cap) * max(right, 0))
            elif isinstance(left, int) and isinstance(right, int):
                self.check_size((left.bit_length() + right.bit_length()) // 3, "a number")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            self.check_size(left.bit_length() * min(right, cap + 1) // 3, "a number")
        elif op == "+" and not isinstance(left, (int, float)):
            self.check_size(_size(left, cap) + _size(right, cap))
        elif op == "%" and isinstance(left, str):
            self.check_format(left)
            self.check_args(right if isinstance(right, tuple) else (right,), {})
        self.check_time()

    def render(self, compiled: Any, variables: dict[str, Any]) -> str:
        """compiled's text for `variables`, refused once it grows over the size cap; errors the
        template causes (a division by zero, a bad operand, runaway recursion) become
        TemplateError so they are the template's fault, not the server's."""
        parts, total = [], 0
        with _template_faults():
            for part in compiled.generate(variables):
                total += len(part)
                self.check_size(total, "a text")
                self.check_time()
                parts.append(part)
        return "".join(parts)


@contextlib.contextmanager
def _template_faults() -> Iterator[None]:
    """Errors a template's own code causes while it compiles or renders (a division by zero, a
    bad operand, nesting or recursion too deep) raised as TemplateError: the template's fault."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateError:
        raise
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, SyntaxError) as e:
        raise TemplateError(f"{type(e).__name__}: {e}") from None


_HUGE_FIELD = re.compile(r"%[-#0 +]*\d*\.?\d{7,}|%[-#0 +]*\*|\{[^{}]*:[^{}]*\d{7,}")
"""A %-format or str.format field with a width or precision of 7+ digits (or a `*` width)."""

_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("kvtier_template_budget", default=None)


def _size(value: Any, cap: int) -> int:
    """Roughly how many items (chars, elements, digits) `value` holds, counting the strings inside
    lists, tuples and dicts; stops counting past `cap`."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return value.bit_length() // 3
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        n = len(value)
        for item in value:
            if n > cap:
                break
            if isinstance(item, (str, list, tuple, dict)):
                n += _size(item, cap - n)
        return n
    return 1


def _budget() -> _Budget:
    """The current render's budget (a fresh default one outside a render: compiling folds
    constant filter calls, and those are bounded too)."""
    return _BUDGET.get() or _Budget(RenderLimits())


class _rendering:
    """Context manager: `budget` is the current render's (in this thread) for its duration;
    `untrusted` also installs a line tracer on template code that raises at the deadline, so a
    request's template cannot loop past it (the model's own template, trusted, skips the
    tracer's cost and is checked at each call, operator, range and output chunk)."""

    YIELD_EVERY_S = 0.002
    YIELD_S = 0.0005
    """A request's template yields the GIL for YIELD_S after each YIELD_EVERY_S of rendering:
    a pure-Python loop otherwise holds it for whole switch intervals (5 ms) each time the
    event loop or the engine thread (in-process engine) wants it back, and they crawl behind
    it (16x the latency of the other clients before this; see docs/benchmarks.md, session 28)."""

    def __init__(self, limits: RenderLimits, untrusted: bool) -> None:
        self.budget = _Budget(limits)
        self.untrusted = untrusted
        self._next_yield = time.perf_counter() + self.YIELD_EVERY_S

    def __enter__(self) -> _Budget:
        self._token = _BUDGET.set(self.budget)
        if self.untrusted:
            self._previous = sys.gettrace()
            sys.settrace(self._trace)
        return self.budget

    def __exit__(self, *exc: object) -> None:
        if self.untrusted:
            sys.settrace(self._previous)
        _BUDGET.reset(self._token)

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None
        self.budget.check_time()
        return self._trace_lines

    def _trace_lines(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.budget.check_time()
            if time.perf_counter() >= self._next_yield:
                time.sleep(self.YIELD_S)  # the GIL to whoever waits for it (wall time: not the budget's clock)
                self._next_yield = time.perf_counter() + self.YIELD_EVERY_S
        return self._trace_lines


@functools.cache
def _env_class() -> type[ImmutableSandboxedEnvironment]:
    """The bounded sandbox: ImmutableSandboxedEnvironment whose `*`, `**`, `+`, `%`, `~`, calls
    and filters check the current render's _Budget (sizes before and after, the deadline)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generator(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # `~`: str_join, bounded
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})
        code_generator_class = _Generator

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept fast
                budget.check_size(len(left) + len(right))
                return left + right
            budget.binop(operator, left, right)
            return budget.checked(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget = _budget()
            if __obj is not _budgeted_range:
                budget.check_args(args, kwargs)
                budget.check_time()
                if getattr(__obj, "__name__", None) in ("format", "format_map"):
                    budget.check_format(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None))
            return budget.checked(super().call(__context, __obj, *args, **kwargs))

        def bounded_concat(self, parts: Sequence[Any]) -> str:
            budget = _budget()
            texts = [str(p) for p in parts]
            budget.check_size(sum(map(len, texts)), "a text")
            return "".join(texts)

    return BoundedSandbox


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a filter) refusing integer arguments and results over the size cap, and (the
    `format` filter) huge format widths; past the deadline it raises."""
    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(fn) is None else 2  # the value (after the context/environment)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.check_args(args[skip:], kwargs)
        if name == "format" and len(args) >= skip:
            budget.check_format(args[skip - 1])
        budget.check_time()
        return budget.checked(fn(*args, **kwargs))

    return wrapper


def _jinja_env(untrusted: bool = False) -> ImmutableSandboxedEnvironment:
    """The bounded sandbox, configured like transformers'. `untrusted` (a request's template)
    also intercepts `+`: the model's own template concatenates message text with `+` on its
    common path, and a trusted template does not double strings in a loop."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _env_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    if untrusted:
        env.intercepted_binops = env.intercepted_binops | {"+"}
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lipsum(n=10**9) loops outside the template's code
    env.globals["range"] = _budgeted_range
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _budgeted_range(*args: Any) -> range:
    """range() for templates: its items count against the render's budget."""
    return _budget().range(*args)


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


def build_word_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = 8192) -> None:
    """Write a word-level tokenizer into out_dir: id i <-> the word "w{i}" (0, 1, 2: <unk>, <s>,
    </s>), words split on whitespace, no BOS added. Text made of such words round-trips to the
    same ids, so a router or client that tokenizes text sees exactly the ids the engine caches
    (the fleet tests and benchmarks, the vLLM connector tests). Needs only `tokenizers`."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import models, pre_tokenizers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {(specials[i] if i < 3 else f"w{i}"): i for i in range(vocab_size)}
    tok = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


class _TemplateHost:
    """What Tokenizer.apply_chat_template reads of its tokenizer, for a request's template
    rendered away from the tokenizer (render_request_template)."""

    chat_template: str | None = None
    _compiled: Any = None

    def __init__(self, bos_token: str | None, eos_token: str | None) -> None:
        self.bos_token, self.eos_token = bos_token, eos_token


def render_request_template(
    chat_template: str,
    bos_token: str | None,
    eos_token: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    continue_final_message: bool,
    limits: RenderLimits | None,
    kwargs: dict[str, Any],
) -> str:
    """Tokenizer.apply_chat_template for a request's own `chat_template`, from its inputs alone
    (picklable: what a template worker process runs, kvtier.server.template_procs)."""
    host: Any = _TemplateHost(bos_token, eos_token)
    return Tokenizer.apply_chat_template(
        host,
        messages,
        add_generation_prompt,
        tools,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        limits=limits,
        **kwargs,
    )
