"""Shared by the quantized-weight and fused-decode tests (tests/model)."""

from __future__ import annotations

import pytest

FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
"""Byte offsets of each GGUF block type's float16 fields (scales, mins): random blocks set them
to finite values."""


def spy_fused_decode(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record every FusedDecode call from now on: True where the one-call step ran, False where it
    fell back (returned None) to the per-op path. The list fills as the calls come."""
    from kvtier.model.fused_decode import FusedDecode

    calls: list[bool] = []
    real_call = FusedDecode.__call__

    def spy(self, *args):
        out = real_call(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(FusedDecode, "__call__", spy)
    return calls
