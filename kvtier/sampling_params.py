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

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not 0.0 <= self.temperature <= 100.0
            or self.temperature != self.temperature
        ):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {rp!r}")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[0]!r}")
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            self.bad_words = list(self.bad_words)
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}")
        pl = self.prompt_logprobs
        if pl is not None and (not isinstance(pl, int) or isinstance(pl, bool) or not 0 <= pl <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {pl!r}")

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


GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json keys vLLM takes as sampling defaults -> SamplingParams fields."""


def generation_defaults(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json sets, as vLLM applies them
    (`--generation-config`): 'auto' reads the model directory's file, 'vllm' uses none (the
    library defaults), any other value is a directory holding generation_config.json. A
    request's own values win; these fill what it leaves out."""
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
