"""The native paged decode attention (kvtier/model/csrc/paged_attention.c) against torch's SDPA
path over the same paged cache: every KV storage, query dtype, GQA group, block size and context
length it takes, agreeing to float32 rounding; errors for tables outside the pool; shapes it does
not take fall back to SDPA."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import native
from kvtier.model.attention import TorchPagedAttention
from kvtier.model.kv_quant import QuantizedKVCache, resolve_kv_dtype
from kvtier.sched.output import ScheduledSeq

pytestmark = pytest.mark.skipif(
    native.paged_attention_lib() is None, reason="no native decode attention here (needs a C compiler and AVX-512)"
)

KV_DTYPES = ["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_rot", "int8_tok", "fp8_e4m3_rot"]
LENGTHS = [1, 3, 16, 17, 40, 333]


def make_cache(
    name: str, model_dtype: torch.dtype, heads: int, num_blocks: int, block_size: int, dim: int, seed: int
) -> torch.Tensor | QuantizedKVCache:
    """A pool of random K/V: [2, heads, num_blocks, block_size, dim], per-block scales that vary."""
    g = torch.Generator().manual_seed(seed)
    spec = resolve_kv_dtype(name, model_dtype)
    x = torch.randn(2, heads, num_blocks, block_size, dim, generator=g)
    if not spec.quantized:
        return x.to(model_dtype) if spec.storage == model_dtype else QuantizedKVCache(x.to(spec.storage), None, spec)
    if spec.per_token:  # one float16 scale per token
        scales = (torch.empty(2, heads, num_blocks, block_size).uniform_(0.5, 2.0, generator=g) / spec.qmax).half()
        codes = (x / 3 / scales.float()[..., None]).clamp(-spec.qmax, spec.qmax).round().to(torch.int8)
        return QuantizedKVCache(codes, scales, spec)
    scales = torch.empty(2, heads, num_blocks).uniform_(0.5, 2.0, generator=g) / spec.qmax
    codes = (x / 3 / scales[..., None, None]).clamp(-spec.qmax, spec.qmax)
    codes = codes.round().to(torch.int8) if spec.storage == torch.int8 else codes.to(spec.storage)
    return QuantizedKVCache(codes, scales, spec)


def decode_both(
    backend: TorchPagedAttention,
    cache,
    lengths: list[int],
    block_size: int,
    num_blocks: int,
    q_dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for i, length in enumerate(lengths):
        n = -(-length // block_size)
        seqs.append(ScheduledSeq(f"r{i}", [1], length - 1, order[:n], True))
        order = order[n:]
    meta = backend.build_metadata(seqs, block_size, torch.device("cpu"))
    q = torch.randn(len(lengths), backend.num_heads, backend.head_dim, generator=g).to(q_dtype)
    got = backend._decode(q, cache, meta.decode, block_size)
    assert (backend._decode_native(q, cache, meta.decode) is not None) == (backend.head_dim % 16 == 0)
    with native.disabled("paged_attention"):
        want = backend._decode(q, cache, meta.decode, block_size)
    return got, want


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # both round float32 results to bfloat16: at most an ulp or two apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-7)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", KV_DTYPES)
def test_matches_sdpa_for_every_kv_dtype(name, q_dtype):
    backend = TorchPagedAttention(num_heads=12, num_kv_heads=4, head_dim=64)
    cache = make_cache(name, q_dtype, 4, 64, 16, 64, seed=1)
    got, want = decode_both(backend, cache, LENGTHS, 16, 64, q_dtype, seed=2)
    assert_close(got, want)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"), [(4, 4, 32, 16), (8, 2, 16, 4), (16, 1, 128, 32), (6, 3, 48, 8)]
)
@pytest.mark.parametrize("name", ["auto", "fp8_e4m3", "int8"])
def test_matches_sdpa_across_groups_head_dims_and_block_sizes(name, heads, kv_heads, dim, block_size):
    backend = TorchPagedAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    num_blocks = sum(-(-n // block_size) for n in LENGTHS) + 3
    cache = make_cache(name, torch.float32, kv_heads, num_blocks, block_size, dim, seed=3)
    got, want = decode_both(backend, cache, LENGTHS, block_size, num_blocks, torch.float32, seed=4)
    assert_close(got, want)


def test_static_scales_are_read_like_dynamic_ones():
    backend = TorchPagedAttention(num_heads=4, num_kv_heads=2, head_dim=32)
    cache = make_cache("fp8_e4m3", torch.float32, 2, 40, 16, 32, seed=5)
    cache.scales[0].fill_(0.01)
    cache.scales[1].fill_(0.02)
    cache.static_scales = (0.01, 0.02)
    got, want = decode_both(backend, cache, [5, 100, 33], 16, 40, torch.float32, seed=6)
    assert_close(got, want)


def test_a_head_dim_it_does_not_take_falls_back_to_sdpa():
    backend = TorchPagedAttention(num_heads=4, num_kv_heads=2, head_dim=24)  # not a multiple of 16
    cache = make_cache("auto", torch.float32, 2, 10, 4, 24, seed=7)
    got, want = decode_both(backend, cache, [3, 9], 4, 10, torch.float32, seed=8)
    assert torch.equal(got, want)


def test_a_block_table_outside_the_pool_is_an_error():
    backend = TorchPagedAttention(num_heads=4, num_kv_heads=2, head_dim=32)
    cache = make_cache("int8", torch.float32, 2, 8, 4, 32, seed=9)
    meta = backend.build_metadata([ScheduledSeq("a", [1], 5, [0, 8], True)], 4, torch.device("cpu"))
    with pytest.raises(IndexError, match="outside the pool"):
        backend._decode(torch.randn(1, 4, 32), cache, meta.decode, 4)
