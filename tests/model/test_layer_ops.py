"""The fused bfloat16 layer ops (csrc/layer_ops.c) against the torch ops of kvtier.model.llama they
replace: the same bf16 roundings, so equal except where a float32 value of another summation order
(the norm's mean) or exp approximation (SiLU) lands next to a rounding boundary (one bf16 ulp, and
rarely); sizes they do not take fall back; a bfloat16 runner gives the same logits with and without
them up to that rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import layer_ops, native
from kvtier.model.llama import RMSNorm, RotaryEmbedding, apply_rope
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

needs_kernels = pytest.mark.skipif(
    native.layer_ops_lib() is None, reason="no native layer ops here (needs a C compiler and AVX-512)"
)


def assert_bf16_equalish(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 1e-3) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp_min(2**-60) * 2**-7
    assert (diff <= ulp).all(), f"off by more than one ulp: {diff.max()}"
    assert (got != want).float().mean().item() <= max_mismatch


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_add_then_norm(rows):
    norm = RMSNorm(768, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_bf16(768, seed=1, scale=0.5) + 1)
    x, res = _bf16(rows, 768, seed=2, scale=3), _bf16(rows, 768, seed=3, scale=3)
    want_res = res + x
    want = norm(want_res)
    got_res = res.clone()
    got = layer_ops.add_rms_norm(x, got_res, norm.weight, norm.eps)
    assert torch.equal(got_res, want_res)  # the add rounds once, as torch's
    assert_bf16_equalish(got, want)
    assert_bf16_equalish(layer_ops.add_rms_norm(x, None, norm.weight, norm.eps), norm(x))
    # RMSNorm.add_norm: the same pair either way
    n1, r1 = norm.add_norm(x, res.clone())
    with native.disabled("layer_ops"):
        n2, r2 = norm.add_norm(x, res.clone())
    assert torch.equal(r1, r2)
    assert_bf16_equalish(n1, n2)


@needs_kernels
def test_rope_in_place_matches_apply_rope_on_a_strided_view():
    arch = SimpleNamespace(head_dim=64, rope_theta=10000.0, rope_scaling=None)  # what RotaryEmbedding reads
    rope = RotaryEmbedding(arch, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 4095, 8000])
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    qkv = _bf16(5, (12 + 8) * 64, seed=4, scale=2)
    qk = qkv[:, : 16 * 64].view(5, 16, 64)  # a view into the projection's output, as the layer has
    with native.disabled("layer_ops"):
        want = apply_rope(qk, cos, sin)
    v_before = qkv[:, 16 * 64 :].clone()
    got = apply_rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(got, want)  # every rounding where torch's are
    assert torch.equal(qkv[:, 16 * 64 :], v_before)


@needs_kernels
def test_silu_mul_matches_torch():
    gate_up = _bf16(33, 2 * 2048, seed=5, scale=4)
    gate, up = gate_up.split(2048, dim=-1)
    assert_bf16_equalish(layer_ops.silu_mul(gate_up, 2048), F.silu(gate) * up)


@needs_kernels
def test_sizes_and_dtypes_they_do_not_take_fall_back():
    w = torch.ones(40, dtype=torch.bfloat16)
    assert layer_ops.add_rms_norm(_bf16(2, 40, seed=6), None, w, 1e-5) is None  # 40 % 16
    assert layer_ops.add_rms_norm(_bf16(2, 64, seed=6).float(), None, torch.ones(64), 1e-5) is None
    assert layer_ops.silu_mul(_bf16(2, 2 * 40, seed=7), 40) is None
    cos = torch.ones(2, 1, 12, dtype=torch.bfloat16)
    assert not layer_ops.rope_(_bf16(2, 3, 24, seed=8), cos, cos)  # dim / 2 % 16


@needs_kernels
def test_bf16_runner_logits_with_and_without_the_fused_ops(tiny_model_dirs):
    for family in ("llama", "qwen3"):  # qwen3: q/k norms before the rope
        runner = ModelRunner(tiny_model_dirs[family], dtype="bfloat16", device="cpu", block_size=4, num_blocks=16)
        ids = [(11 * i + 5) % 512 for i in range(13)]
        prefill = SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, [0, 1, 2, 3], sample=True)], block_copies=[])
        fused = runner.execute(prefill)
        with native.disabled("layer_ops"):
            plain = runner.execute(prefill)
        torch.testing.assert_close(fused, plain, atol=0.02 * plain.abs().max().item(), rtol=0)
        assert fused.argmax() == plain.argmax()
