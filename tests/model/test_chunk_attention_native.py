"""The native chunk attention (kvt_chunk_attention, kvtier/model/csrc/paged_attention.c): many query
tokens of one sequence, each causal over its cached prefix and the chunk, straight from a bfloat16
paged pool. Against torch's SDPA over the gathered cache in float32: every GQA group, head dim,
block size, chunk length and prefix length it takes; tables outside the pool are errors; shapes it
does not take fall back to SDPA; both of its variants (bf16 dot products, float32 FMAs), and the
measured choice of torch's SDPA instead of the kernel. Also the torch path's split attention
(prefix + causal chunk merged by log-sum-exp) against one masked SDPA call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import attention, native
from kvtier.model.attention import TorchPagedAttention
from kvtier.sched.output import ScheduledSeq

needs_kernel = pytest.mark.skipif(
    native.chunk_attention_lib() is None, reason="no native chunk attention here (needs a C compiler and AVX512-BF16)"
)


VARIANTS = [attention.CHUNK_DPBF16, attention.CHUNK_FMA]  # bf16 dot products, float32 FMAs


def test_chunk_variant_override(monkeypatch):
    monkeypatch.setenv(attention.CHUNK_VARIANT_ENV, "fma")
    attention.chunk_variant.cache_clear()
    assert attention.chunk_variant(12, 4, 64) == attention.CHUNK_FMA
    monkeypatch.setenv(attention.CHUNK_VARIANT_ENV, "sdpa")
    attention.chunk_variant.cache_clear()
    assert attention.chunk_variant(12, 4, 64) == attention.CHUNK_SDPA
    monkeypatch.setenv(attention.CHUNK_VARIANT_ENV, "fast")
    attention.chunk_variant.cache_clear()
    with pytest.raises(ValueError, match=attention.CHUNK_VARIANT_ENV):
        attention.chunk_variant(12, 4, 64)
    attention.chunk_variant.cache_clear()


def reference(q: torch.Tensor, pool: torch.Tensor, table: list[int], start: int, group: int) -> torch.Tensor:
    """float32 SDPA over the gathered context, causal mask shifted by start: [n, Hq * D]."""
    n, _, dim = q.shape
    kv_heads = pool.shape[1]
    end = start + n
    kv = pool.index_select(2, torch.tensor(table)).reshape(2, kv_heads, -1, dim)[:, :, :end].float()
    k, v = kv[0].repeat_interleave(group, 0), kv[1].repeat_interleave(group, 0)
    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1).reshape(n, -1)


def chunk(backend: TorchPagedAttention, n: int, start: int, block_size: int, dtype: torch.dtype, seed: int):
    """A random pool, a shuffled block table, the chunk's metadata and q; the chunk's K/V written."""
    g = torch.Generator().manual_seed(seed)
    end = start + n
    num_table = -(-end // block_size)
    num_blocks = num_table + 7
    pool = torch.randn(2, backend.num_kv_heads, num_blocks, block_size, backend.head_dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:num_table].tolist()
    meta = backend.build_metadata(
        [ScheduledSeq("r", list(range(n)), start, table, True)], block_size, torch.device("cpu")
    )
    q = torch.randn(n, backend.num_heads, backend.head_dim, generator=g).to(dtype)
    k = torch.randn(n, backend.num_kv_heads, backend.head_dim, generator=g).to(dtype)
    v = torch.randn(n, backend.num_kv_heads, backend.head_dim, generator=g).to(dtype)
    backend.write_kv(k, v, pool, meta)
    return pool, table, meta, q, k, v


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """P rounds to bfloat16 before P @ V and the output to bfloat16: a few bfloat16 ulps of |out| <~ 1."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-5, atol=2**-6)


@needs_kernel
@pytest.mark.parametrize(
    "n,start", [(1, 0), (2, 0), (5, 3), (16, 0), (17, 16), (40, 7), (64, 333), (300, 1000), (14, 2042)]
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_sdpa_for_chunk_and_prefix_lengths(n, start, variant):
    backend = TorchPagedAttention(12, 4, 64)
    backend.bind_pool(torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    backend.native_chunk_max_tokens = 0  # every chunk to the chunk kernel (bind_pool times it against decode rows)
    backend.chunk_variant = variant
    pool, table, meta, q, k, v = chunk(backend, n, start, 16, torch.bfloat16, seed=n * 1000 + start)
    got = backend._chunk_native(q, pool, meta.prefills[0]) if n > 1 else None
    if n == 1:  # one token is a decode row, not a chunk
        assert meta.decode is not None and not meta.prefills
        return
    assert got is not None
    assert_bf16_close(got, reference(q, pool, table, start, 3))
    assert_bf16_close(backend.forward(q, k, v, pool, meta), reference(q, pool, table, start, 3))


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(4, 4, 32, 16), (8, 1, 64, 32), (16, 2, 128, 16), (32, 8, 64, 48), (6, 2, 256, 16), (6, 3, 96, 32)],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_sdpa_across_groups_head_dims_and_block_sizes(heads, kv_heads, dim, block_size, variant):
    backend = TorchPagedAttention(heads, kv_heads, dim)
    backend.bind_pool(torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    backend.native_chunk_max_tokens = 0  # every chunk to the chunk kernel (bind_pool times it against decode rows)
    backend.chunk_variant = variant
    for n, start in [(3, 50), (37, 0), (70, 130)]:
        pool, table, meta, q, _k, _v = chunk(backend, n, start, block_size, torch.bfloat16, seed=heads + n)
        got = backend._chunk_native(q, pool, meta.prefills[0])
        assert got is not None
        assert_bf16_close(got, reference(q, pool, table, start, heads // kv_heads))


@needs_kernel
@pytest.mark.parametrize("rows_faster", [False, True])
def test_short_chunks_go_to_the_chunk_kernel_on_a_bfloat16_pool_only(rows_faster, monkeypatch):
    # bind_pool times decode rows against the chunk kernel once per process; fix the verdict here
    monkeypatch.setattr(attention, "decode_rows_beat_chunk_kernel", lambda *a, **k: rows_faster)
    # and the kernel against torch's SDPA (a CPU with AMX picks SDPA: test_sdpa_choice_... below)
    monkeypatch.setattr(attention, "chunk_variant", lambda *a, **k: attention.CHUNK_DPBF16)
    backend = TorchPagedAttention(12, 4, 64)
    seq = ScheduledSeq("r", [1, 2, 3, 4], 100, list(range(7)), True)
    backend.bind_pool(torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    meta = backend.build_metadata([seq], 16, torch.device("cpu"))
    if rows_faster:  # short chunks over a prefix then go to the decode kernel as rows
        assert not meta.prefills and meta.decode is not None
        return
    assert len(meta.prefills) == 1 and meta.decode is None
    backend.bind_pool(torch.float32, torch.float32, torch.device("cpu"))  # float32: decode rows serve
    meta = backend.build_metadata([seq], 16, torch.device("cpu"))
    assert not meta.prefills and meta.decode is not None and meta.decode.token_idx.tolist() == [0, 1, 2, 3]


@needs_kernel
def test_shapes_it_does_not_take_fall_back_and_bad_tables_are_errors():
    backend = TorchPagedAttention(4, 2, 48)  # dim 48: not a multiple of 32
    pool, table, meta, q, k, v = chunk(backend, 20, 10, 16, torch.bfloat16, seed=1)
    assert backend._chunk_native(q, pool, meta.prefills[0]) is None
    assert_bf16_close(backend.forward(q, k, v, pool, meta), reference(q, pool, table, 10, 2))
    backend = TorchPagedAttention(4, 2, 64)
    pool, table, meta, q, _k, _v = chunk(backend, 20, 10, 16, torch.bfloat16, seed=2)
    meta.prefills[0].block_ids[1] = pool.shape[2]
    with pytest.raises(IndexError, match="outside the pool"):
        backend._chunk_native(q, pool, meta.prefills[0])
    f32 = TorchPagedAttention(4, 2, 64)
    pool, _table, meta, q, _k, _v = chunk(f32, 20, 10, 16, torch.float32, seed=3)
    assert f32._chunk_native(q, pool, meta.prefills[0]) is None  # float32 keeps torch's float32 math


@pytest.mark.skipif(attention._FLASH_WITH_LSE is None, reason="this torch has no CPU flash kernel with lse")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,start", [(9, 16), (100, 37), (600, 900)])
def test_split_attention_matches_one_masked_call(dtype, n, start, monkeypatch):
    backend = TorchPagedAttention(12, 4, 64)
    with native.disabled("paged_attention"):
        pool, table, meta, q, k, v = chunk(backend, n, start, 16, dtype, seed=n)
        got = backend.forward(q, k, v, pool, meta)
        monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
        want = backend.forward(q, k, v, pool, meta)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, reference(q, pool, table, start, 3), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-7)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_steps_prefills_in_one_batch_call_equal_the_per_sequence_calls(variant):
    """Several prefill chunks (from position 0 and over cached prefixes) and a decode in one step:
    kvt_chunk_attention_batch gives exactly what one call per sequence (`_chunk_native`) gives, and
    the decode row is left to the decode kernel."""
    backend = TorchPagedAttention(12, 4, 64)
    backend.bind_pool(torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    backend.native_chunk_max_tokens = 0  # the 5-token chunk too (bind_pool may time rows faster)
    backend.chunk_variant = variant
    g = torch.Generator().manual_seed(7)
    bs, num_blocks = 16, 160
    pool = torch.randn(2, 4, num_blocks, bs, 64, generator=g).to(torch.bfloat16)
    free = torch.randperm(num_blocks, generator=g).tolist()
    shapes = [(37, 0), (128, 512), (1, 300), (5, 80), (61, 17)]  # (tokens, start); (1, 300) decodes
    seqs = []
    for i, (n, start) in enumerate(shapes):
        table = [free.pop() for _ in range(-(-(start + n) // bs))]
        seqs.append(ScheduledSeq(f"r{i}", list(range(n)), start, table, True))
    meta = backend.build_metadata(seqs, bs, torch.device("cpu"))
    assert meta.prefill_batch is not None and len(meta.prefills) == 4 and meta.decode is not None
    total = sum(n for n, _ in shapes)
    q = torch.randn(total, 12, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(total, 4, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(total, 4, 64, generator=g).to(torch.bfloat16)
    backend.write_kv(k, v, pool, meta)
    batched = backend._chunk_native_batch(q, pool, meta.prefill_batch)
    got = backend.forward(q, k, v, pool, meta)
    for p, (seq, (_n, start)) in zip(meta.prefills, [(s, sh) for s, sh in zip(seqs, shapes) if sh[0] > 1]):
        one = backend._chunk_native(q[p.token_start : p.token_end], pool, p)
        assert torch.equal(batched[p.token_start : p.token_end], one)
        assert torch.equal(got[p.token_start : p.token_end], one)
        assert_bf16_close(one, reference(q[p.token_start : p.token_end], pool, seq.block_ids, start, 3))
    row = meta.decode.token_idx[0]
    assert_bf16_close(got[row : row + 1], reference(q[row : row + 1], pool, seqs[2].block_ids, 300, 3))


def test_measured_choice_is_one_of_the_three(monkeypatch):
    """Without the variable, chunk_variant times both kernel variants and torch's SDPA on this CPU
    and names one of them (which one depends on the CPU: SDPA wins where torch uses AMX tiles)."""
    monkeypatch.delenv(attention.CHUNK_VARIANT_ENV, raising=False)
    attention.chunk_variant.cache_clear()
    try:
        assert attention.chunk_variant(12, 4, 64, repeats=1) in (
            attention.CHUNK_DPBF16,
            attention.CHUNK_FMA,
            attention.CHUNK_SDPA,
        )
    finally:
        attention.chunk_variant.cache_clear()


@needs_kernel
def test_sdpa_choice_leaves_the_chunk_kernel_out_and_matches(monkeypatch):
    """With CHUNK_SDPA bound (the kernel lost to torch's SDPA on this CPU), a step's prefills build
    no kernel batch, go through torch's SDPA on the gathered blocks, and equal the reference; short
    chunks over a prefix go to the decode rows as on a CPU without the chunk kernel."""
    monkeypatch.setenv(attention.CHUNK_VARIANT_ENV, "sdpa")
    attention.chunk_variant.cache_clear()
    try:
        backend = TorchPagedAttention(12, 4, 64)
        backend.bind_pool(torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    finally:
        attention.chunk_variant.cache_clear()
    assert backend.chunk_variant == attention.CHUNK_SDPA
    assert backend.native_chunk_max_tokens == attention.NATIVE_CHUNK_MAX_TOKENS
    g = torch.Generator().manual_seed(11)
    bs, num_blocks = 16, 160
    pool = torch.randn(2, 4, num_blocks, bs, 64, generator=g).to(torch.bfloat16)
    free = torch.randperm(num_blocks, generator=g).tolist()
    shapes = [(37, 0), (128, 512), (1, 300), (61, 17)]
    seqs = []
    for i, (n, start) in enumerate(shapes):
        table = [free.pop() for _ in range(-(-(start + n) // bs))]
        seqs.append(ScheduledSeq(f"r{i}", list(range(n)), start, table, True))
    meta = backend.build_metadata(seqs, bs, torch.device("cpu"))
    assert meta.prefill_batch is None and len(meta.prefills) == 3
    total = sum(n for n, _ in shapes)
    q = torch.randn(total, 12, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(total, 4, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(total, 4, 64, generator=g).to(torch.bfloat16)
    backend.write_kv(k, v, pool, meta)
    assert backend._chunk_native(q[:37], pool, meta.prefills[0]) is None
    got = backend.forward(q, k, v, pool, meta)
    for p, (seq, (_n, start)) in zip(meta.prefills, [(s, sh) for s, sh in zip(seqs, shapes) if sh[0] > 1]):
        want = reference(q[p.token_start : p.token_end], pool, seq.block_ids, start, 3)
        assert_bf16_close(got[p.token_start : p.token_end], want)
