"""The native KV kernels (kvtier/model/csrc/kv_quant.c) against the torch ops they stand in for:
the same bytes and scales after every write, the same values from every gather, the same logits
from a runner, and the same errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvtier.model import native
from kvtier.model.kv_quant import QuantizedKVCache, WritePlan, resolve_kv_dtype
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
HEADS, NUM_BLOCKS, BS, DIM = 3, 12, 8, 16

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: the native kernels cannot be built here",
)


def test_the_kernels_build_and_load_on_this_machine():
    assert native.kv_quant_lib() is not None
    with native.disabled():
        assert native.kv_quant_lib() is None
    assert native.kv_quant_lib() is not None


def pair(name: str, static: tuple[float, float] | None = None) -> tuple[QuantizedKVCache, QuantizedKVCache]:
    spec = resolve_kv_dtype(name, torch.float32)
    caches = []
    for _ in range(2):
        data = torch.zeros(2, HEADS, NUM_BLOCKS, BS, DIM, dtype=spec.storage)
        scales = torch.zeros(2, HEADS, NUM_BLOCKS)
        if static is not None:
            scales[0], scales[1] = static
        caches.append(QuantizedKVCache(data, scales, spec, static))
    return caches[0], caches[1]


def same_state(a: QuantizedKVCache, b: QuantizedKVCache) -> bool:
    return torch.equal(a.data.view(torch.int8), b.data.view(torch.int8)) and torch.equal(
        a.scales.view(torch.int32), b.scales.view(torch.int32)
    )


def as_model_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as the model hands it over: a view with room between tokens (the fused qkv)."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 2, x.shape[2], dtype=x.dtype)
    wide[:, 1:-1] = x
    return wide[:, 1:-1]


def random_step(g: torch.Generator, dtype: torch.dtype, fill: list[int]) -> tuple[torch.Tensor, ...]:
    """A step of several sequences: each writes a run of tokens (a prefill chunk, or one decode
    token) at the next free slots of its own blocks; values change magnitude from step to step,
    some are huge, some zero."""
    slots: list[int] = []
    for seq in range(3):  # sequence s owns blocks 4s .. 4s+3
        n = int(torch.randint(1, 2 * BS, (1,), generator=g)) if torch.rand(1, generator=g) < 0.3 else 1
        for _ in range(n):
            if fill[seq] == 4 * BS:  # its blocks are full: reuse them (slot 0 starts a block afresh)
                fill[seq] = int(torch.randint(0, 4, (1,), generator=g)) * BS
            slots.append(4 * seq * BS + fill[seq])
            fill[seq] += 1
    num_tokens = len(slots)
    magnitude = 10.0 ** float(torch.empty(1).uniform_(-4, 4, generator=g))
    k = torch.randn(num_tokens, HEADS, DIM, generator=g) * magnitude
    v = torch.randn(num_tokens, HEADS, DIM, generator=g) * magnitude * torch.rand(num_tokens, 1, 1, generator=g)
    k[torch.rand(num_tokens, generator=g) < 0.1] = 0.0
    if torch.rand(1, generator=g) < 0.1:
        k[0, 0, 0] = 1e30  # saturates at the largest scale
    return as_model_rows(k.to(dtype)), as_model_rows(v.to(dtype)), torch.tensor(slots)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", QUANTIZED)
def test_writes_and_gathers_match_the_torch_ops_bit_for_bit(name, in_dtype):
    fast, ref = pair(name)
    g = torch.Generator().manual_seed(hash((name, str(in_dtype))) % 1000)
    fill = [0, 0, 0]
    for _ in range(60):
        k, v, slots = random_step(g, in_dtype, fill)
        fast.write(k, v, slots)
        with native.disabled():
            ref.write(k, v, slots, WritePlan.build(slots, BS))
        assert same_state(fast, ref)
    ids = torch.randint(0, NUM_BLOCKS, (40,), generator=g)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fast.gather(ids, out_dtype)
        with native.disabled():
            want = ref.gather(ids, out_dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", QUANTIZED)
def test_static_scales_match_the_torch_ops(name):
    fast, ref = pair(name, static=(0.05, 0.2))
    g = torch.Generator().manual_seed(3)
    fill = [0, 0, 0]
    for _ in range(10):
        k, v, slots = random_step(g, torch.bfloat16, fill)
        fast.write(k, v, slots)
        with native.disabled():
            ref.write(k, v, slots)
        assert same_state(fast, ref)
    assert fast.scales[0].eq(0.05).all() and fast.scales[1].eq(0.2).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_block_split_across_one_steps_tokens_is_regrouped_like_torch(name):
    """Tokens of one block that are not adjacent in the step: the kernel hands them back and the
    torch ops treat them as one group."""
    fast, ref = pair(name)
    k = torch.randn(3, HEADS, DIM) * torch.tensor([1.0, 100.0, 10.0])[:, None, None]
    slots = torch.tensor([BS + 1, 5 * BS + 2, BS + 2])
    for cache in (fast, ref):
        cache.write(k[:1] * 0.1, k[:1] * 0.1, torch.tensor([BS]))
    fast.write(k, k, slots)
    with native.disabled():
        ref.write(k, k, slots)
    assert same_state(fast, ref)


def test_slots_and_block_ids_out_of_range_are_errors_that_change_nothing():
    fast, _ = pair("fp8_e4m3")
    before = fast.data.clone(), fast.scales.clone()
    k = torch.ones(2, HEADS, DIM)
    with pytest.raises(IndexError, match="slot"):
        fast.write(k, k, torch.tensor([0, NUM_BLOCKS * BS]))
    assert torch.equal(fast.data.view(torch.int8), before[0].view(torch.int8))
    assert torch.equal(fast.scales, before[1])
    with pytest.raises(IndexError, match="block id"):
        fast.gather(torch.tensor([0, NUM_BLOCKS]), torch.float32)


def runner_logits(model_dir, name: str) -> list[torch.Tensor]:
    """A prefill in two chunks, then six decode steps."""
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", block_size=4, num_blocks=32, kv_cache_dtype=name)
    blocks = list(range(10))
    ids = list(range(3, 24))
    outs = [runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", ids[:13], 0, blocks, True)]))]
    outs.append(runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", ids[13:], 13, blocks, True)])))
    for i in range(6):
        seq = ScheduledSeq("a", [40 + i], len(ids) + i, blocks, True)
        outs.append(runner.execute(SchedulerOutput(seqs=[seq])))
    return outs


@pytest.mark.parametrize("name", QUANTIZED)
def test_runner_logits_are_bit_identical_with_and_without_the_kv_kernels(tiny_llama_dir, name):
    fast = runner_logits(tiny_llama_dir, name)
    with native.disabled("kv_quant"):
        ref = runner_logits(tiny_llama_dir, name)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.parametrize("name", QUANTIZED)
def test_rounding_matches_torch_at_every_grid_point_and_tie(name):
    """Every representable value, every midpoint between two (round half to even) and the floats
    just either side of it, subnormals and the saturation limit included."""
    spec = resolve_kv_dtype(name, torch.float32)
    if name == "int8":
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(spec.storage).float()
        grid = grid[torch.isfinite(grid)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat(
        [
            grid,
            mid,
            torch.nextafter(mid, mid + 1),
            torch.nextafter(mid, mid - 1),
            torch.tensor([spec.qmax * 1.01, -spec.qmax * 3, 1e-45, -1e-45, 0.0, -0.0]),
        ]
    )
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    num_tokens = values.numel() // (HEADS * DIM)
    k = values[: num_tokens * HEADS * DIM].view(num_tokens, HEADS, DIM)
    rest = values[num_tokens * HEADS * DIM :]
    k = torch.cat([k, torch.cat([rest, torch.zeros(HEADS * DIM - rest.numel())]).view(1, HEADS, DIM)])
    slots = torch.arange(k.shape[0])
    fast, ref = pair(name, static=(1.0, 1.0))
    fast.write(k, -k, slots)
    with native.disabled():
        ref.write(k, -k, slots)
    assert same_state(fast, ref)


@pytest.mark.parametrize("name", ["auto", "bfloat16", *QUANTIZED])
def test_block_lists_move_the_same_bytes_as_one_block_at_a_time(tiny_llama_dir, name):
    """read_block_list / write_block_list (what a store and a restore use) against read_block /
    write_block, with the kernels and without."""
    src = ModelRunner(tiny_llama_dir, dtype="float32", device="cpu", block_size=4, num_blocks=32, kv_cache_dtype=name)
    src.execute(SchedulerOutput(seqs=[ScheduledSeq("a", list(range(3, 23)), 0, list(range(5)), True)]))
    blocks = [0, 3, 1, 4]
    singles = [src.read_block(b) for b in blocks]
    listed = src.read_block_list(blocks)
    with native.disabled():
        listed_ref = src.read_block_list(blocks)
    for a, b, c in zip(singles, listed, listed_ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    assert listed[0].data_ptr() != listed[1].data_ptr()  # one tensor per block: tiers free them one by one

    dst = ModelRunner(tiny_llama_dir, dtype="float32", device="cpu", block_size=4, num_blocks=32, kv_cache_dtype=name)
    ref = ModelRunner(tiny_llama_dir, dtype="float32", device="cpu", block_size=4, num_blocks=32, kv_cache_dtype=name)
    targets = [20, 7, 31, 2]
    dst.write_block_list(targets, listed)
    for b, kv in zip(targets, singles):
        ref.write_block(b, kv)
    assert torch.equal(dst.kv_pool.view(torch.uint8), ref.kv_pool.view(torch.uint8))
    if dst.kv_scales is not None:
        assert torch.equal(dst.kv_scales, ref.kv_scales)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst.read_block_list(targets), singles)
    )

    with pytest.raises(IndexError):
        dst.write_block_list([32], listed[:1])
    with pytest.raises(IndexError):
        dst.read_block_list([0, -1])
    with pytest.raises(ValueError):
        dst.write_block_list([1, 2], listed[:1])
