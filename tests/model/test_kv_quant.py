"""Quantized KV cache: quantize/dequantize round trips, scales that grow with a block, what tiers
receive from the runner, static checkpoint scales, and the fingerprint that keeps KV dtypes apart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.model.hf_config import ModelLoadError
from kvtier.model.kv_quant import (
    KV_CACHE_DTYPES,
    QuantizedKVCache,
    WritePlan,
    dequantize,
    dequantize_reference,
    hadamard,
    quantize,
    resolve_kv_dtype,
)
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import BlockCopy, ScheduledSeq, SchedulerOutput

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
BS = 4

# |error| <= REL * |x| + ABS_STEPS * scale: fp8 rounds to 3 (e4m3) or 2 (e5m2) mantissa bits, so the
# relative error is at most 2^-4 / 2^-3; near zero the subnormal step bounds it. int8 rounds to
# the nearest multiple of the scale.
BOUNDS = {"fp8_e4m3": (2.0**-4, 2.0**-9), "fp8_e5m2": (2.0**-3, 2.0**-16), "int8": (0.0, 0.5)}


def bound(name: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rel, steps = BOUNDS[name]
    return rel * x.abs() + steps * scale + 1e-6


def block_values(seed: int, shape=(2, 3, 5, BS, 16)) -> torch.Tensor:
    """Values whose magnitude differs by orders of magnitude across (K/V, head, block)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.empty(shape[:3], dtype=torch.float32).uniform_(-3, 3, generator=g)
    return torch.randn(shape, generator=g) * magnitude[..., None, None]


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_is_within_the_dtypes_bound(name):
    spec = resolve_kv_dtype(name, torch.float32)
    x = block_values(0)
    scale = (x.abs().amax((-1, -2)) / spec.qmax)[..., None, None]
    q = quantize(x, scale, spec)
    assert q.dtype == spec.storage and q.element_size() == 1
    back = dequantize_reference(q, scale)
    assert (back - x).abs().le(bound(name, x, scale)).all()
    # the block's largest value is exactly representable: it maps to +-qmax
    assert q.float().abs().amax((-1, -2)).eq(spec.qmax).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_bit_cast_dequantize_equals_torchs_conversion(name, out_dtype):
    """The integer-op dequantization maps every fp8 byte (subnormals included) like torch does, and
    rounds value * scale once, from float32, to the output dtype."""
    spec = resolve_kv_dtype(name, torch.float32)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(spec.storage)
    finite = torch.isfinite(codes.float())
    codes = codes[finite].reshape(1, -1)
    for scale in (0.37, 1e-30, 128.0, 3.1e-7):
        scale = torch.tensor([[scale]])
        got = dequantize(codes, scale, out_dtype)
        assert torch.equal(got, (codes.float() * scale).to(out_dtype))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_saturates_instead_of_overflowing(name):
    spec = resolve_kv_dtype(name, torch.float32)
    q = quantize(torch.tensor([1e9, -1e9, float("inf")]), torch.tensor(1.0), spec)
    assert torch.isfinite(q.float()).all() and q.float().abs().eq(spec.qmax).all()


def make_cache(name: str, num_blocks: int = 6, heads: int = 2, dim: int = 8) -> QuantizedKVCache:
    spec = resolve_kv_dtype(name, torch.float32)
    data = torch.zeros(2, heads, num_blocks, BS, dim, dtype=spec.storage)
    return QuantizedKVCache(data, torch.zeros(2, heads, num_blocks), spec)


def write(cache: QuantizedKVCache, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> None:
    slot_mapping = torch.tensor(slots)
    cache.write(k, v, slot_mapping, WritePlan.build(slot_mapping, BS))


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_writes_grow_the_block_scale_and_keep_earlier_tokens_within_bounds(name):
    """Tokens written one at a time, each larger than the last: every write requantizes the
    block's earlier tokens to the grown scale, and all stay within (twice) the round-trip bound."""
    cache = make_cache(name)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randn(2, 2, 2, 8, generator=g) * 4.0**i for i in range(BS)]  # [K/V, T=2, H, D]
    block_of_seq = [3, 1]
    for i, kv in enumerate(tokens):
        write(cache, kv[0], kv[1], [b * BS + i for b in block_of_seq])
    want = torch.stack(tokens, 1)  # [2, pos, T, H, D]
    got = cache.gather(torch.tensor(block_of_seq), torch.float32)  # [2, H, n, bs, D]
    got = got.permute(0, 3, 2, 1, 4)  # [2, pos, n, H, D]
    scale = cache.scales[:, :, block_of_seq].permute(0, 2, 1)[:, None, :, :, None]  # [2, 1, n, H, 1]
    assert scale.gt(0).all()
    assert (got - want).abs().le(2 * bound(name, want, scale)).all()
    # the scale covers the block's largest value exactly
    amax = want.abs().amax((1, 4)).permute(0, 2, 1)  # [2, H, n]: of each (K/V, head, block)
    torch.testing.assert_close(cache.scales[:, :, block_of_seq], amax / cache.kv_dtype.qmax)


@pytest.mark.parametrize("name", QUANTIZED)
def test_one_step_mixes_blocks_that_grow_and_blocks_whose_scale_fits(name):
    """Per step, some blocks take their token as is and others are rewritten; each block's bytes
    are the same as when its sequence is written alone."""
    together, alone = make_cache(name), make_cache(name)
    g = torch.Generator().manual_seed(2)
    growing = [torch.randn(2, 1, 2, 8, generator=g) * 3.0**i for i in range(BS)]
    shrinking = [torch.randn(2, 1, 2, 8, generator=g) * 3.0**-i for i in range(BS)]
    for i in range(BS):
        kv = torch.cat((growing[i], shrinking[i]), 1)  # [K/V, T=2, H, D]
        write(together, kv[0], kv[1], [3 * BS + i, 1 * BS + i])
        write(alone, growing[i][0], growing[i][1], [3 * BS + i])
        write(alone, shrinking[i][0], shrinking[i][1], [1 * BS + i])
    assert torch.equal(together.data.view(torch.int8), alone.data.view(torch.int8))
    assert torch.equal(together.scales, alone.scales)
    want = torch.stack(shrinking, 1)[:, :, 0]  # [2, pos, H, D]
    got = together.gather(torch.tensor([1]), torch.float32)[:, :, 0].transpose(1, 2)
    scale = together.scales[:, :, 1][:, None, :, None]
    assert (got - want).abs().le(bound(name, want, scale)).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_write_at_slot_zero_starts_the_block_afresh(name):
    """A reused block forgets its previous owner's large scale: small new values keep their precision."""
    cache = make_cache(name)
    big = torch.full((BS, 2, 8), 1000.0)
    write(cache, big, big, [2 * BS + i for i in range(BS)])
    small = torch.randn(2, 2, 8) * 0.01
    write(cache, small, small, [2 * BS, 2 * BS + 1])
    assert cache.scales[:, :, 2].max() < 1.0
    got = cache.gather(torch.tensor([2]), torch.float32)[0, :, 0, :2].transpose(0, 1)  # K, [2 tokens, H, D]
    assert (got - small).abs().le(bound(name, small, cache.scales[0, :, 2][None, :, None])).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_unchanged_scale_rewrites_earlier_tokens_to_the_same_bytes(name):
    cache = make_cache(name)
    first = torch.randn(2, 2, 8) * 3.0
    write(cache, first, first, [0, 1])
    before = cache.data[:, :, 0, :2].view(torch.int8).clone()
    tiny = torch.full((1, 2, 8), 1e-3)
    write(cache, tiny, tiny, [2])
    assert torch.equal(cache.data[:, :, 0, :2].view(torch.int8), before)


# -- the runner -------------------------------------------------------------------------------


def make_runner(model_dir: Path, kv_cache_dtype: str, num_blocks: int = 48) -> ModelRunner:
    return ModelRunner(
        model_dir, dtype="float32", device="cpu", block_size=BS, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype
    )


def prefill(runner: ModelRunner, ids: list[int], blocks: list[int]) -> torch.Tensor:
    return runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, blocks, True)]))


def decode(runner: ModelRunner, token: int, pos: int, blocks: list[int]) -> torch.Tensor:
    return runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", [token], pos, blocks, True)]))


def test_pool_bytes_hold_at_least_1_9x_the_tokens_of_bfloat16_scales_included(tiny_llama_dir):
    bf16 = ModelRunner(
        tiny_llama_dir, dtype="float32", block_size=16, kv_cache_bytes=8 << 20, kv_cache_dtype="bfloat16"
    )
    for name in QUANTIZED:
        q = ModelRunner(tiny_llama_dir, dtype="float32", block_size=16, kv_cache_bytes=8 << 20, kv_cache_dtype=name)
        assert q.kv_pool.element_size() == 1
        pool_bytes = q.kv_pool.nbytes + q.kv_scales.nbytes
        assert pool_bytes <= 8 << 20
        assert q.num_blocks >= 1.9 * bf16.num_blocks
        assert q.tokens_per_gib >= 1.9 * bf16.tokens_per_gib
        assert q.kv_bytes_per_block == q.kv_data_bytes_per_block + q.kv_scale_bytes_per_block


def test_auto_is_the_model_dtype_and_shares_its_fingerprint(tiny_llama_dir):
    auto = make_runner(tiny_llama_dir, "auto")
    explicit = make_runner(tiny_llama_dir, "float32")
    assert auto.kv_pool.dtype == torch.float32 and auto.kv_scales is None
    assert isinstance(auto.kv_caches[0], torch.Tensor)  # the native path: plain tensors
    assert auto.fingerprint == explicit.fingerprint


def test_fingerprint_differs_for_every_kv_dtype(tiny_llama_dir):
    prints = {make_runner(tiny_llama_dir, name).fingerprint for name in KV_CACHE_DTYPES if name != "auto"}
    assert len(prints) == len(KV_CACHE_DTYPES) - 1


def test_unknown_kv_cache_dtype_lists_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match="fp8_e4m3"):
        make_runner(tiny_llama_dir, "fp4")


@pytest.mark.parametrize("name", QUANTIZED + ["bfloat16", "int8_rot", "int8_tok", "fp8_e4m3_rot"])
def test_quantized_runner_stays_close_to_full_precision(tiny_llama_dir, name):
    ids = list(range(3, 30))
    ref = make_runner(tiny_llama_dir, "auto")
    q = make_runner(tiny_llama_dir, name)
    blocks = list(range(8))
    want = [prefill(ref, ids, blocks)] + [decode(ref, 7 + i, len(ids) + i, blocks) for i in range(4)]
    got = [prefill(q, ids, blocks)] + [decode(q, 7 + i, len(ids) + i, blocks) for i in range(4)]
    tol = {
        "bfloat16": 0.02,
        "fp8_e4m3": 0.1,
        "int8": 0.1,
        "fp8_e5m2": 0.2,
        "int8_rot": 0.1,
        "int8_tok": 0.1,
        "fp8_e4m3_rot": 0.1,
    }[name]
    for w, g in zip(want, got):
        assert (w - g).abs().max() <= tol * w.abs().max()
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("name", QUANTIZED + ["int8_rot", "int8_tok"])
def test_tier_blocks_are_packed_quantized_bytes_and_restore_bit_exactly(tiny_llama_dir, name):
    """read_block gives the tiers the quantized bytes + scales (half of bf16 + 4 bytes per head); writing them into
    other blocks of a fresh runner continues decoding with bit-identical logits."""
    ids = list(range(5, 21))  # 16 tokens = 4 full blocks
    src = make_runner(tiny_llama_dir, name)
    prefill(src, ids, [0, 1, 2, 3, 4])
    packed = [src.read_block(b) for b in range(4)]
    assert all(p.dtype == torch.uint8 and p.numel() == src.kv_bytes_per_block for p in packed)
    bf16 = make_runner(tiny_llama_dir, "bfloat16")
    assert src.kv_bytes_per_block == bf16.kv_bytes_per_block // 2 + src.kv_scale_bytes_per_block
    batch = src.read_blocks([0, 1, 2, 3])
    assert torch.equal(batch, torch.stack(packed))

    dst = make_runner(tiny_llama_dir, name)
    dst_blocks = [9, 30, 4, 12]
    for b, p in zip(dst_blocks, packed):
        dst.write_block(b, p.clone())
    assert torch.equal(dst.read_blocks(dst_blocks), batch)
    other = make_runner(tiny_llama_dir, name)
    other.write_blocks([40, 41, 42, 43], batch)
    for i in range(3):
        want = decode(src, 100 + i, 16 + i, [0, 1, 2, 3, 5])
        got = decode(dst, 100 + i, 16 + i, dst_blocks + [7])
        also = decode(other, 100 + i, 16 + i, [40, 41, 42, 43, 44])
        assert torch.equal(want, got) and torch.equal(want, also)


def test_a_block_of_another_kv_dtype_is_refused(tiny_llama_dir):
    fp8 = make_runner(tiny_llama_dir, "fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fp8.write_block(0, make_runner(tiny_llama_dir, "bfloat16").read_block(0))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fp8.write_block(0, torch.zeros(fp8.kv_bytes_per_block // 2, dtype=torch.uint8))


@pytest.mark.parametrize("name", QUANTIZED + ["int8_tok"])
def test_partial_block_copy_carries_the_scale(tiny_llama_dir, name):
    runner = make_runner(tiny_llama_dir, name)
    prefill(runner, list(range(3, 13)), [0, 1, 2])  # block 2 holds tokens 8, 9
    runner.kv_scales[:, :, :, 5] = 123.0  # stale scale of the destination
    runner.execute(SchedulerOutput(seqs=[], block_copies=[BlockCopy(src_block=2, dst_block=5, num_tokens=2)]))
    assert torch.equal(runner.kv_scales[:, :, :, 5], runner.kv_scales[:, :, :, 2])
    assert torch.equal(runner.kv_pool[:, :, :, 5, :2].view(torch.int8), runner.kv_pool[:, :, :, 2, :2].view(torch.int8))


# -- static scales from the checkpoint -----------------------------------------------------------


def with_kv_scales(src: Path, dst: Path, scales: dict[int, tuple[float, float]]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_static_checkpoint_scales_replace_dynamic_ones(tiny_llama_dir, tmp_path):
    model_dir = with_kv_scales(tiny_llama_dir, tmp_path / "m", {0: (0.01, 0.02), 1: (0.03, 0.04)})
    runner = make_runner(model_dir, "fp8_e4m3")
    torch.testing.assert_close(torch.tensor(runner.static_kv_scales), torch.tensor([[0.01, 0.02], [0.03, 0.04]]))
    want = torch.tensor([[0.01, 0.02], [0.03, 0.04]])[:, :, None, None].expand_as(runner.kv_scales)
    torch.testing.assert_close(runner.kv_scales, want)
    prefill(runner, list(range(3, 30)), list(range(8)))
    torch.testing.assert_close(runner.kv_scales, want)  # writes never change them
    # int8 keeps the calibrated range (amax = scale * 448)
    int8 = make_runner(model_dir, "int8")
    torch.testing.assert_close(int8.kv_scales[0, 0, 0, 0], torch.tensor(0.01 * 448 / 127))
    # the plain model ignores them and loads as before
    assert make_runner(model_dir, "auto").kv_scales is None
    # checkpoint scales change the weights file, hence the fingerprint
    assert runner.fingerprint != make_runner(tiny_llama_dir, "fp8_e4m3").fingerprint


def test_static_scales_of_some_layers_only_are_an_error(tiny_llama_dir, tmp_path):
    model_dir = with_kv_scales(tiny_llama_dir, tmp_path / "m", {0: (0.01, 0.02)})
    with pytest.raises(ModelLoadError, match="layer 1"):
        make_runner(model_dir, "fp8_e4m3")


# -- rotated dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 128, 96, 80])
def test_hadamard_is_orthonormal_and_symmetric(dim):
    h = hadamard(dim)
    assert h.shape == (dim, dim) and h.dtype == torch.float32
    torch.testing.assert_close(h @ h, torch.eye(dim), atol=1e-6, rtol=0)
    assert torch.equal(h, h.t())


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_rotation_spreads_an_outlier_channel_and_cuts_the_error(name):
    """Keys with one channel 30x the others (what rope pairs do in real models): with one scale per
    block, int8 quantizes the other channels coarsely, and rotated its error falls several times;
    fp8 keeps its relative precision for small values anyway, and rotation leaves it about the
    same. Either way the cache gives back the unrotated keys."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 2, 64, generator=g)  # [T, Hkv, D]
    k[:, :, 5] *= 30
    v = torch.randn(64, 2, 64, generator=g)
    errors = {}
    for kv_name in (name, f"{name}_rot"):
        spec = resolve_kv_dtype(kv_name, torch.float32)
        data = torch.zeros(2, 2, 4, 16, 64, dtype=spec.storage)
        cache = QuantizedKVCache(data, torch.zeros(2, 2, 4), spec)
        assert (cache.rotation is not None) == spec.rotated
        cache.write(k, v, torch.arange(64))
        back = cache.gather(torch.arange(4), torch.float32).view(2, 2, 64, 64)
        got_k = back[0].transpose(0, 1)  # [T, Hkv, D]
        errors[kv_name] = ((got_k - k).norm() / k.norm()).item()
    if name == "int8":
        assert errors["int8_rot"] * 3 < errors["int8"]
    else:
        assert errors[f"{name}_rot"] < 1.5 * errors[name]


def test_per_token_scales_quantize_each_token_once_to_its_own_range(tiny_llama_dir):
    """int8_tok: a token's scale is its own (|value| max / 127, float16), a larger token written
    later into the same block leaves the earlier one's bytes and scale alone, and a block costs
    1.03x int8's bytes (1,056 against 1,028 per K/V head, scales included)."""
    spec = resolve_kv_dtype("int8_tok", torch.float32)
    data = torch.zeros(2, 1, 2, 4, 16, dtype=torch.int8)
    scales = torch.zeros(2, 1, 2, 4, dtype=torch.float16)
    cache = QuantizedKVCache(data, scales, spec)
    small = torch.randn(1, 1, 16) * 0.1
    cache.write(small, small, torch.tensor([0]))
    before = (data.clone(), scales.clone())
    big = torch.randn(1, 1, 16) * 50
    cache.write(big, big, torch.tensor([1]))
    assert torch.equal(data[:, :, 0, 0], before[0][:, :, 0, 0]) and torch.equal(scales[..., 0, 0], before[1][..., 0, 0])
    rotated = small.float() @ cache.rotation
    assert torch.equal(scales[0, 0, 0, 0], (rotated.abs().amax() / 127).half())
    back = cache.gather(torch.tensor([0]), torch.float32)[0, 0, 0, 0]
    assert (back - small[0, 0]).abs().max() <= 0.6 * rotated.abs().amax() / 127 * 16**0.5
    runner8, runner_tok = make_runner(tiny_llama_dir, "int8"), make_runner(tiny_llama_dir, "int8_tok")
    rows = runner8.kv_data_bytes_per_block // (BS * runner8.arch.head_dim)  # layers x K/V x KV heads
    assert runner8.kv_scale_bytes_per_block == rows * 4  # one float32 per block
    assert runner_tok.kv_scale_bytes_per_block == rows * BS * 2  # one float16 per token
    assert runner_tok.kv_data_bytes_per_block == runner8.kv_data_bytes_per_block
    # at block size 16 and head dim 64: (16 * 64 + 16 * 2) / (16 * 64 + 4) = 1,056 / 1,028 = 1.027
