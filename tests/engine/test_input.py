"""The prompt-length rules EngineCore and the API server share (kvtier.engine.input), and the
future plumbing of EngineAdmin (kvtier.engine.admin): no model."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvtier.engine.admin import EngineAdmin, _after, _then
from kvtier.engine.input import (
    check_max_tokens,
    check_prompt_fits,
    kept_prompt_tokens,
    truncate_prompt,
    truncation_length,
)


def test_truncation_length_rule() -> None:
    assert truncation_length(None, 16) is None
    assert truncation_length(5, 16) == 5
    assert truncation_length(-1, 16) == 15
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be -1 or a positive integer, got 0$"):
        truncation_length(0, 16)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens \(16\) must be below this model's context of 16"):
        truncation_length(16, 16)


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    ids = list(range(10))
    assert truncate_prompt(ids, None, 16) is ids
    assert truncate_prompt(ids, 3, 16) == [7, 8, 9]
    assert truncate_prompt(ids, -1, 8) == ids[-7:]
    assert kept_prompt_tokens(10, 3, 16) == 3
    assert kept_prompt_tokens(2, 3, 16) == 2
    assert kept_prompt_tokens(10, None, 16) == 10


def test_prompt_length_checks() -> None:
    check_prompt_fits(15, 16)
    with pytest.raises(ValueError, match=r"^the prompt has 16 tokens; this model's context is 16 tokens"):
        check_prompt_fits(16, 16)
    check_max_tokens(10, 6, 16)
    check_max_tokens(10, None, 16)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 16 tokens; use max_tokens <= 6$"):
        check_max_tokens(10, 7, 16)


def test_admin_futures() -> None:
    first: Future = Future()
    last: Future = Future()
    both = _after(first, last)
    mapped = _then(both, lambda r: r + 1)
    last.set_result(1)
    assert not both.done()
    first.set_result(0)
    assert both.result(1) == 1 and mapped.result(1) == 2
    failed: Future = Future()
    after_failure = _after(failed, last)
    failed.set_exception(RuntimeError("sweep"))
    with pytest.raises(RuntimeError, match="sweep"):
        after_failure.result(1)


class _NoTiers:
    tiers = None


def test_admin_without_tiers() -> None:
    admin = EngineAdmin(_NoTiers())  # type: ignore[arg-type]
    assert not admin.has_tiers and not admin.checks_keys
    assert admin.retry_pending_purges() is None and admin.begin_check_keys() is None
    assert admin.key_check_interval_s is None and admin.drop_revoked() == []
