"""SamplingParams, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.structured import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 is greedy. `n` samples share the prompt's KV blocks. `stop` strings end the
    output (and are not included in it); `stop_token_ids` and EOS end it too unless
    `ignore_eos` (their text is left out of `text` unless `include_stop_str_in_output`).
    `logprobs=k` returns the top-k log-probabilities of each generated token (the model's raw
    distribution, before penalties and temperature, as vLLM's default).

    Logits processing, in vLLM's order and with vLLM's formulas: `min_tokens` masks EOS and
    `stop_token_ids` until that many tokens are out; `logit_bias` adds to chosen tokens;
    `allowed_token_ids` masks every other token; `bad_words` masks the token that would
    complete a bad word; then `repetition_penalty` (divides positive logits, multiplies negative
    ones, of tokens seen in the prompt or the output), `frequency_penalty` (minus the count in
    the output) and `presence_penalty` (minus once per token in the output).
    `truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: as many as fit).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    """Log-probabilities of the prompt's tokens (each with the top-k at its position); the
    request then computes its whole prompt (no prefix-cache or tier reuse), as in vLLM."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar
    (kvtier.structured; needs llguidance)."""
    bad_words_token_ids: list[list[int]] | None = None
    """`bad_words` tokenized (each with and without a leading space); the engine fills it."""

    MAX_N = 128
    MAX_LOGPROBS = 20
    MAX_INT = (1 << 31) - 1
    """The bound of every count and token id (max_tokens, top_k, min_tokens, ...)."""
    MAX_BAD_WORDS = 1024
    """Distinct `bad_words` one request may give (each costs two tokenizations)."""

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """A ValueError naming the first field out of range or of the wrong type: integers are
        ints (not bools) within [.., MAX_INT] (the seed within 64 bits), floats finite and in
        range, token ids in [0, MAX_INT] (the engine checks them against its vocabulary)."""
        if not _is_int(self.n) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= self.MAX_INT):
            raise ValueError(f"max_tokens must be an integer in [1, {self.MAX_INT}], got {_short(self.max_tokens)}")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise ValueError(f"seed must be a 64-bit integer, got {_short(self.seed)}")
        if (
            not _is_number(self.temperature)
            or not 0.0 <= self.temperature <= 100.0
            or self.temperature != self.temperature
        ):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {_short(self.top_p)}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= self.MAX_INT:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer up to {self.MAX_INT}, got {_short(self.top_k)}"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {_short(self.min_p)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {_short(self.logprobs)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.MAX_INT:
            raise ValueError(f"min_tokens must be an integer in [0, {self.MAX_INT}], got {_short(self.min_tokens)}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        self._check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {_short(v)}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {_short(rp)}")
        if self.logit_bias is not None:
            try:
                bias = {_digits_as_int(k): v for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            self._check_token_ids("logit_bias", list(bias))
            bad = [v for v in bias.values() if not _is_number(v) or not -100.0 <= v <= 100.0]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {_short(bad[0])}")
            self.logit_bias = {k: float(v) for k, v in bias.items()}
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            self._check_token_ids("allowed_token_ids", ids)
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            self.bad_words = list(dict.fromkeys(self.bad_words))  # distinct, in order
            if len(self.bad_words) > self.MAX_BAD_WORDS:
                raise ValueError(
                    f"bad_words has {len(self.bad_words)} distinct words; at most {self.MAX_BAD_WORDS} are allowed"
                )
        if self.bad_words_token_ids is not None:
            words = [list(w) for w in self.bad_words_token_ids]
            for w in words:
                self._check_token_ids("bad_words", w)
            self.bad_words_token_ids = [w for w in words if w]
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1) or t > self.MAX_INT):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {_short(t)}")
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or not 0 <= pl <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {_short(pl)}")

    def _check_token_ids(self, name: str, ids: list[Any] | None) -> None:
        bad = next((t for t in ids or () if not _is_int(t) or not 0 <= t <= self.MAX_INT), None)
        if bad is not None:
            raise ValueError(f"{name}: {_short(bad)} is not a token id (an integer in [0, {self.MAX_INT}])")

    @property
    def processes_logits(self) -> bool:
        """Whether any processing beyond temperature and truncation applies (min_tokens aside)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_token_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def child(self, index: int) -> SamplingParams:
        """Params for the index-th of n parallel samples (its own seed, n=1)."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _digits_as_int(key: Any) -> Any:
    """A logit_bias key of ASCII decimal digits (JSON's shape) as an int; anything else as is."""
    if isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit():
        return int(key)
    return key


def _is_number(value: Any) -> bool:
    """A real number (bools are not), NaN included: the range checks refuse NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """A value for an error message, cut to 40 characters (a 4,300-digit integer stays readable)."""
    if isinstance(value, int) and abs(value) >= 1 << 128:  # str() of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json keys vLLM takes as sampling defaults -> SamplingParams fields."""


def generation_defaults(
    model: str, generation_config: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json sets, as vLLM applies them
    (`--generation-config`): 'auto' reads the model directory's file, 'vllm' uses none (the
    library defaults), any other value is a directory holding generation_config.json. A
    request's own values win; these fill what it leaves out. `override` (vLLM's
    --override-generation-config) sets or replaces some of them, by generation_config.json key
    (max_new_tokens) or SamplingParams field (max_tokens)."""
    defaults = _file_generation_defaults(model, generation_config)
    for key, value in (override or {}).items():
        field = GENERATION_CONFIG_KEYS.get(key, key)
        if field not in GENERATION_CONFIG_KEYS.values():
            known = ", ".join(GENERATION_CONFIG_KEYS)
            raise ValueError(f"override_generation_config: unknown key {key!r} (known: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"override_generation_config: {key} must be a number, got {value!r}")
        defaults[field] = value
    if defaults:
        SamplingParams(**defaults)  # a bad value fails at start, not on the first request
    return defaults


def _file_generation_defaults(model: str, generation_config: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    if generation_config == "vllm":
        return {}
    folder = Path(model) if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config not in ("auto",):
            raise ValueError(f"--generation-config {generation_config}: no generation_config.json there")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    return {
        field: data[key]
        for key, field in GENERATION_CONFIG_KEYS.items()
        if isinstance(data, dict) and data.get(key) is not None
    }
