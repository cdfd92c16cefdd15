"""Helpers of the engine tests."""

from __future__ import annotations


def clean(llm) -> None:
    """The engine's invariants hold and every device block is free again (nothing leaked)."""
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
