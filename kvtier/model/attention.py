"""Paged attention: per-step metadata and the attention backend interface.

KV pool layout (owned by the runner, one allocation for all layers)::

    kv_pool   [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]   (2 = K, V)
    kv_cache  = kv_pool[layer]  ->  [2, num_kv_heads, num_blocks, block_size, head_dim]

A token at position p of a sequence with block table bt lives at
slot = bt[p // block_size] * block_size + p % block_size of the flattened
[num_blocks * block_size] axis. Backends receive one layer's `kv_cache` view: a plain tensor
when the KV dtype is the model dtype, else a `QuantizedKVCache` (kvtier.model.kv_quant) holding
that view in the storage dtype plus per-(K/V, KV head, block) scales; `write_kv` quantizes into
it and every read goes through `gather_kv`, which dequantizes only the gathered blocks.
Heads outside blocks: a gather of blocks yields, per KV head, one contiguous [tokens, head_dim]
matrix, the layout SDPA reads fastest (decode attention of 64 sequences: 30% less time than with
a token-major [num_blocks, block_size, num_kv_heads, head_dim] layout).

The pool is zero-initialised: padded gathers read unused slots, and masked scores only give
zero weight if the values they multiply are finite.

Within one step, the flattened tokens of all sequences are split into
  - "prefill" sequences (more than one query token), attended one at a time:
      * bfloat16 model and pool, on CPUs with AVX512-BF16: one call of the native chunk kernel
        (kvt_chunk_attention in csrc/paged_attention.c), causal per query token, straight from the
        paged pool, from position 0 or over a cached prefix alike;
      * otherwise with SDPA: from position 0 directly over the new k/v (is_causal) -- over the
        gathered, dequantized blocks when the cache is quantized, so a prefix hit sees exactly what
        a recompute sees; over a cached prefix, on the gathered blocks, as two flash calls (the
        prefix, every key visible; the chunk, causal) merged by their log-sum-exps, or with one
        causal mask shifted by start_pos where torch lacks the flash kernel that returns them;
        chunks of up to NATIVE_CHUNK_MAX_TOKENS tokens run as rows of the decode kernel instead;
  - "decode" sequences (exactly one query token): on CPUs with AVX-512, one native kernel call
    (kvtier/model/csrc/paged_attention.c) that attends straight from the paged pool in any KV
    dtype, G query heads per KV head together, with no gathered or dequantized copy; elsewhere one
    padded gather and one SDPA call with a length mask.
"""

from __future__ import annotations

import array
import functools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.model import native
from kvtier.model.kv_quant import QuantizedKVCache, WritePlan, rotate
from kvtier.sched.output import ScheduledSeq

KVCache = torch.Tensor | QuantizedKVCache
"""One layer's paged KV cache as backends receive it (see the module docstring)."""


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one query token in this step."""

    token_start: int
    """Row of its first query token in the flattened batch."""
    token_end: int
    start_pos: int
    seq_len: int
    """Context length after this step (start_pos + query tokens)."""
    block_ids: torch.Tensor
    """[ceil(seq_len / block_size)] long (unused when start_pos == 0 and the cache is not quantized:
    then attention reads the new k/v)."""
    mask: torch.Tensor | None
    """Causal mask shifted by start_pos, True = visible: [G * n, seq_len] when `folded`, else
    [n, seq_len]. Built by the first layer that needs it (`TorchPagedAttention._causal_mask`: only
    the masked SDPA fallback does) and shared by the others; None until then, and always when
    start_pos == 0 (SDPA's is_causal does it)."""
    folded: bool
    """Whether the G query heads of a KV head are folded into the query axis (see
    TorchPagedAttention); only for short chunks, where the G-fold mask stays small."""
    batch: PrefillBatch | None = None
    """This chunk alone as the native chunk kernel's batch (its rows from 0), built by the first
    layer that calls the kernel for it and shared by the others."""


@dataclass(slots=True)
class PrefillBatch:
    """Every prefill chunk of a step for one call of the native chunk kernel
    (kvt_chunk_attention_batch): one parallel region per layer instead of one per sequence."""

    block_tables: torch.Tensor
    """[S, max_blocks] long, padded with block 0 past each sequence's table."""
    starts: torch.Tensor
    """[S] long: each chunk's first position."""
    row_starts: torch.Tensor
    """[S] long: each chunk's first row in the step's tokens."""
    num_tokens: torch.Tensor
    """[S] long."""


@dataclass(slots=True)
class DecodeBatch:
    """All sequences with exactly one query token in this step."""

    token_idx: torch.Tensor
    """[B] long: their rows in the flattened batch."""
    block_tables: torch.Tensor
    """[B, max_blocks] long, padded with block 0 (masked out)."""
    mask: torch.Tensor
    """[B, 1, 1, max_blocks * block_size] bool: key j visible iff j < seq_len."""
    seq_lens: torch.Tensor
    """[B] long: context lengths after this step (the native kernel reads these, not the mask)."""


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step, shared by every layer."""

    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor
    """[T] long: where each new token's K/V is written."""
    query_start_loc: list[int]
    """[num_seqs + 1]: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]."""
    seq_lens: list[int]
    """[num_seqs]: context length after this step."""
    block_tables: list[list[int]]
    """[num_seqs] the scheduler's block tables (not copied)."""
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    write_plan: WritePlan | None = None
    """Blocks touched by this step's writes (see `plan_writes`)."""
    prefill_batch: PrefillBatch | None = None
    """The prefills as one native chunk-kernel call, where there are several and the kernel is built."""

    def plan_writes(self) -> WritePlan:
        """The step's WritePlan, built by the first quantized write that needs one (the torch
        path; the native kernel plans for itself) and shared by the other layers."""
        if self.write_plan is None:
            self.write_plan = WritePlan.build(self.slot_mapping, self.block_size)
        return self.write_plan


class AttentionBackend(ABC):
    """Where attention kernels plug in. One instance per model, shared by all layers.

    Contract: `build_metadata` runs once per step before the forward pass; per layer, `write_kv`
    stores the new tokens' K/V through `meta.slot_mapping`, then `forward` attends each query token
    over its sequence's cached prefix plus the new tokens (causal), and may read the new k/v
    directly instead of the cache where that is cheaper.
    """

    def bind_pool(self, kv_dtype: torch.dtype, dtype: torch.dtype, device: torch.device) -> None:  # noqa: B027
        """Told once, when the runner allocates the pool, its storage dtype and the model's dtype,
        so that `build_metadata` can plan for the kernels that will serve. Optional."""

    @abstractmethod
    def build_metadata(
        self, seqs: Sequence[ScheduledSeq], block_size: int, device: torch.device
    ) -> AttentionMetadata: ...

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        """k, v: [T, num_kv_heads, head_dim]; kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
        (or a QuantizedKVCache of that shape)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (already in kv_cache).
        Returns [T, num_heads * head_dim]."""


FOLD_MAX_QUERY_TOKENS = 512
"""Prefill chunks (with cached prefix) up to this many tokens fold GQA heads into the query axis;
longer ones repeat KV per query head instead, so that one [n, seq_len] mask serves all heads."""


NATIVE_CHUNK_MAX_TOKENS = 8
"""Prefill chunks over a cached prefix up to this many tokens run as rows of the native paged
decode kernel (no gathered copy of the prefix) where the chunk kernel does not serve (a float32
or quantized pool), or where it serves but rows measure faster (`decode_rows_beat_chunk_kernel`);
longer ones measured faster through gather + SDPA (docs/benchmarks.md)."""


_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""SDPA's CPU flash kernel, which also returns the log-sum-exp of each query row's scores (what
`_attend_split` merges two partial attentions by); None on a torch without it (then chunks over a
cached prefix take one masked SDPA call)."""


CHUNK_DPBF16, CHUNK_FMA = 0, 1
"""The chunk kernel's two ways to multiply (KVT_CHUNK_* of csrc/paged_attention.c): bf16 dot
products (vdpbf16ps), or float32 FMAs on K/V widened once per 16-key chunk (for CPUs whose FMA
units outrun their bf16 dot products)."""
CHUNK_SDPA = 2
"""No chunk kernel: a chunk's attention runs torch's SDPA on its gathered blocks (`_prefill`). On a
CPU whose matrix units torch's kernels use (Intel AMX: bf16 tiles) that is faster than either
variant: 0.6-0.7x of the kernel's time on a 128-token chunk over 512 cached tokens (session 37)."""
CHUNK_VARIANT_ENV = "KVTIER_CHUNK_ATTENTION"
"""`dpbf16`, `fma` or `sdpa`: overrides the measurement of `chunk_variant`."""
_CHUNK_NAMES = {"dpbf16": CHUNK_DPBF16, "fma": CHUNK_FMA, "sdpa": CHUNK_SDPA}


def _time_chunk_kernel(
    lib: Any, q: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, start: int, variant: int
) -> int:
    """One kvt_chunk_attention call of the timing probes: q [n, Hq, D] at `start` over a bfloat16
    pool [2, Hkv, num_blocks, block_size, D] whose blocks `table` lists; its return code."""
    n, num_heads, head_dim = q.shape
    _two, num_kv_heads, num_blocks, block_size, _d = pool.shape
    return lib.kvt_chunk_attention(
        q.data_ptr(),
        out.data_ptr(),
        pool.data_ptr(),
        table.data_ptr(),
        table.numel(),
        start,
        n,
        num_heads,
        num_kv_heads,
        num_blocks,
        block_size,
        head_dim,
        head_dim**-0.5,
        variant,
    )


@functools.cache
def chunk_variant(num_heads: int, num_kv_heads: int, head_dim: int, repeats: int = 3) -> int:
    """The fastest way to attend a chunk over its cached prefix on this CPU for this head shape:
    KVTIER_CHUNK_ATTENTION, else the chunk kernel's two variants and torch's SDPA on the gathered
    blocks (CHUNK_SDPA) timed (interleaved, least of `repeats`) on a 256-token chunk over 768 cached
    tokens, once per process; the bf16 kernel unless another is 10% faster."""
    given = os.environ.get(CHUNK_VARIANT_ENV, "").strip().lower()
    if given:
        if given not in _CHUNK_NAMES:
            raise ValueError(f"{CHUNK_VARIANT_ENV}={given!r}: use {', '.join(_CHUNK_NAMES)}")
        return _CHUNK_NAMES[given]
    lib = native.chunk_attention_lib()
    if lib is None:  # no kernel on this CPU: the variant does not matter
        return CHUNK_DPBF16
    block_size, start, n = 16, 768, 256
    num_blocks = (start + n) // block_size
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.arange(num_blocks, dtype=torch.long)
    torch_path = TorchPagedAttention(num_heads, num_kv_heads, head_dim)  # the chunk kernel off
    torch_path.chunk_variant = CHUNK_SDPA
    seq = torch_path._prefill_seq(0, n, start, start + n, table.tolist(), block_size, q.device)

    def run(variant: int) -> int:
        if variant == CHUNK_SDPA:
            torch_path._prefill(q, q, q, pool, seq)  # k/v of the chunk are read from the pool
            return 0
        return _time_chunk_kernel(lib, q, out, pool, table, start, variant)

    best = {CHUNK_DPBF16: float("inf"), CHUNK_FMA: float("inf"), CHUNK_SDPA: float("inf")}
    for _ in range(repeats + 1):  # the first round pays one-time setup
        for variant in best:  # noqa: PLC0206 - best[variant] is written, not read
            t = time.perf_counter()
            if run(variant) != 0:
                return CHUNK_DPBF16
            best[variant] = min(best[variant], time.perf_counter() - t)
    fastest = min(best, key=best.__getitem__)
    return fastest if best[fastest] * 1.1 <= best[CHUNK_DPBF16] else CHUNK_DPBF16


@functools.cache
def decode_rows_beat_chunk_kernel(
    num_heads: int, num_kv_heads: int, head_dim: int, variant: int, repeats: int = 5
) -> bool:
    """Whether a short chunk over a cached prefix (4 tokens over 1,024) runs faster as rows of the
    decode kernel (each KV head's rows in parallel) than as one chunk-kernel call (one tile per KV
    head: few tasks for few rows), timed here once per process and head shape (least of `repeats`,
    interleaved); short chunks (up to NATIVE_CHUNK_MAX_TOKENS) then take the faster one."""
    lib = native.chunk_attention_lib()
    if lib is None:
        return False
    block_size, start, n = 16, 1024, 4
    num_blocks = (start + n) // block_size + 1
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.arange(num_blocks, dtype=torch.long)
    tables = table.repeat(n, 1)
    lens = torch.arange(start + 1, start + n + 1, dtype=torch.long)
    scale = head_dim**-0.5

    def chunk() -> int:
        return _time_chunk_kernel(lib, q, out, pool, table, start, variant)

    def rows() -> int:
        return lib.kvt_decode_attention(
            q.data_ptr(),
            native.FLOAT_KIND[torch.bfloat16],
            out.data_ptr(),
            pool.data_ptr(),
            native.KV_STORAGE[torch.bfloat16],
            None,
            native.SCALE_BLOCK,
            tables.data_ptr(),
            num_blocks,
            lens.data_ptr(),
            n,
            num_heads,
            num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            scale,
        )

    best = {chunk: float("inf"), rows: float("inf")}
    for _ in range(repeats + 1):
        for fn in best:  # noqa: PLC0206 - best[fn] is written, not read
            t = time.perf_counter()
            if fn() != 0:
                return False
            best[fn] = min(best[fn], time.perf_counter() - t)
    return best[rows] * 1.1 <= best[chunk]


class TorchPagedAttention(AttentionBackend):
    """Plain PyTorch paged attention over `F.scaled_dot_product_attention`; runs on any device.

    GQA without repeating KV where a mask is needed anyway: the G = num_heads / num_kv_heads query
    heads that share a KV head are folded into the query-length axis,
        q [n, Hq, D] -> [Hkv, G * n, D]   (row g * n + i = query token i of head kv * G + g)
    so SDPA sees as many heads as K/V have. Prefills from position 0 repeat KV instead (folding
    would cost them SDPA's is_causal path), as do chunks longer than FOLD_MAX_QUERY_TOKENS (whose
    G-fold mask would grow large).
    """

    native_f32 = False
    """Decode float32 queries on a float32 pool with csrc/decode_attention_f32.c where the AVX-512
    kernel does not apply: set for models with quantized weights (their sums already differ from
    transformers' in order)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.native_chunk_max_tokens = NATIVE_CHUNK_MAX_TOKENS
        self.chunk_variant = CHUNK_DPBF16

    def bind_pool(self, kv_dtype: torch.dtype, dtype: torch.dtype, device: torch.device) -> None:
        # the chunk kernel (bfloat16) serves every chunk, the short ones faster than decode rows do
        chunk_kernel = (
            kv_dtype == dtype == torch.bfloat16
            and self._native_paged(device)
            and (native.chunk_attention_lib() is not None)
        )
        self.native_chunk_max_tokens = 0 if chunk_kernel else NATIVE_CHUNK_MAX_TOKENS
        if chunk_kernel:
            self.chunk_variant = chunk_variant(self.num_heads, self.num_kv_heads, self.head_dim)
            # torch's SDPA beats the kernel on this CPU (then as without the kernel), or decode rows do
            sdpa = self.chunk_variant == CHUNK_SDPA
            if sdpa or decode_rows_beat_chunk_kernel(
                self.num_heads, self.num_kv_heads, self.head_dim, self.chunk_variant
            ):
                self.native_chunk_max_tokens = NATIVE_CHUNK_MAX_TOKENS

    @staticmethod
    def _native_paged(device: torch.device) -> bool:
        return device.type == "cpu" and native.paged_attention_lib() is not None

    # -- metadata ---------------------------------------------------------------------------

    def build_metadata(self, seqs: Sequence[ScheduledSeq], block_size: int, device: torch.device) -> AttentionMetadata:
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        prefill_args: list[tuple[int, int, int, int, list[int]]] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for seq in seqs:
            num_new = len(seq.token_ids)
            start = seq.start_pos
            end = start + num_new
            table = seq.block_ids
            if num_new == 0:
                raise ValueError(f"request {seq.req_id}: scheduled with no tokens")
            if len(table) * block_size < end:
                raise ValueError(
                    f"request {seq.req_id}: block table of {len(table)} blocks cannot hold {end} tokens "
                    f"(block_size {block_size})"
                )
            if num_new == 1:
                slots.append(table[start // block_size] * block_size + start % block_size)
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            elif start > 0 and num_new <= self.native_chunk_max_tokens and self._native_paged(device):
                # a short chunk over a cached prefix: each of its tokens is a decode row of the
                # native paged kernel (keys 0 .. its own position), read straight from the pool
                _extend_slots(slots, table, start, end, block_size)
                decode_rows.extend(range(row, row + num_new))
                decode_tables.extend([table] * num_new)
                decode_lens.extend(range(start + 1, end + 1))
            else:
                _extend_slots(slots, table, start, end, block_size)
                prefill_args.append((row, row + num_new, start, end, table))
            row += num_new
            query_start_loc.append(row)
            seq_lens.append(end)
            block_tables.append(table)

        prefills = [self._prefill_seq(*args, block_size, device) for args in prefill_args]
        decode = self._decode_batch(decode_rows, decode_tables, decode_lens, block_size, device)
        batch = None
        if (
            len(prefill_args) > 1
            and device.type == "cpu"
            and self.chunk_variant != CHUNK_SDPA
            and native.chunk_attention_lib() is not None
        ):
            max_blocks = max(-(-end // block_size) for *_, end, _ in prefill_args)
            padded: list[int] = []
            for *_, end, table in prefill_args:
                used = table[: -(-end // block_size)]
                padded += used
                padded += [0] * (max_blocks - len(used))
            batch = PrefillBatch(
                long_tensor(padded, device).view(len(prefill_args), max_blocks),
                long_tensor([a[2] for a in prefill_args], device),
                long_tensor([a[0] for a in prefill_args], device),
                long_tensor([a[1] - a[0] for a in prefill_args], device),
            )
        return AttentionMetadata(
            num_tokens=row,
            block_size=block_size,
            slot_mapping=long_tensor(slots, device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            prefills=prefills,
            decode=decode,
            prefill_batch=batch,
        )

    def _prefill_seq(
        self,
        token_start: int,
        token_end: int,
        start: int,
        end: int,
        table: list[int],
        block_size: int,
        device: torch.device,
    ) -> PrefillSeq:
        num_blocks = -(-end // block_size)
        block_ids = long_tensor(table[:num_blocks], device)
        folded = start > 0 and end - start <= FOLD_MAX_QUERY_TOKENS
        return PrefillSeq(token_start, token_end, start, end, block_ids, None, folded)

    def _causal_mask(self, p: PrefillSeq, device: torch.device) -> torch.Tensor:
        """The chunk's causal mask (see PrefillSeq.mask), built once per step."""
        if p.mask is None:
            # query i sits at position start + i and sees keys 0 .. start + i
            query_pos = torch.arange(p.start_pos, p.seq_len, device=device)
            mask = torch.arange(p.seq_len, device=device)[None, :] <= query_pos[:, None]  # [n, seq_len]
            if p.folded:
                mask = mask.repeat(self.num_queries_per_kv, 1)  # [G * n, seq_len], row g * n + i
            p.mask = mask
        return p.mask

    def _decode_batch(
        self, rows: list[int], tables: list[list[int]], lens: list[int], block_size: int, device: torch.device
    ) -> DecodeBatch | None:
        if not rows:
            return None
        max_blocks = -(-max(lens) // block_size)
        padded: list[int] = []  # [B * max_blocks], row-major
        for table in tables:
            row = table[:max_blocks]
            padded += row
            padded += [0] * (max_blocks - len(row))  # block 0 stands in; masked out
        seq_lens = long_tensor(lens, device)
        mask = torch.arange(max_blocks * block_size, device=device)[None, :] < seq_lens[:, None]
        return DecodeBatch(
            token_idx=long_tensor(rows, device),
            block_tables=long_tensor(padded, device).view(len(rows), max_blocks),
            mask=mask[:, None, None, :],
            seq_lens=seq_lens,
        )

    # -- per layer --------------------------------------------------------------------------

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.write(k, v, meta.slot_mapping, meta.plan_writes)
            return
        num_slots = kv_cache.shape[2] * kv_cache.shape[3]
        # [2, Hkv, num_blocks, block_size, D] -> [2, Hkv, num_slots, D]
        flat = kv_cache.view(2, self.num_kv_heads, num_slots, self.head_dim)
        flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        hidden = self.num_heads * self.head_dim
        if meta.decode is None and len(meta.prefills) == 1:  # a lone prefill: no scatter
            return self._prefill(q, k, v, kv_cache, meta.prefills[0])
        if not meta.prefills:  # decodes only: rows are already in order
            assert meta.decode is not None
            return self._decode(q, kv_cache, meta.decode, meta.block_size)
        out = self._chunk_native_batch(q, kv_cache, meta.prefill_batch) if meta.prefill_batch is not None else None
        if out is None:
            out = q.new_empty(num_tokens, hidden)  # [T, Hq * D]
            for p in meta.prefills:
                out[p.token_start : p.token_end] = self._prefill(q, k, v, kv_cache, p)
        if meta.decode is not None:
            out.index_copy_(0, meta.decode.token_idx, self._decode(q, kv_cache, meta.decode, meta.block_size))
        return out

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        p: PrefillSeq,
    ) -> torch.Tensor:
        num_new = p.token_end - p.token_start
        q = q[p.token_start : p.token_end]  # [n, Hq, D]
        out = self._chunk_native(q, kv_cache, p)
        if out is not None:
            return out
        if p.start_pos == 0 and isinstance(kv_cache, QuantizedKVCache):
            # attend over what the cache holds (dequantized), as a later prefix hit will
            kv = gather_kv(kv_cache, p.block_ids, q.dtype)
            kv = kv.view(2, self.num_kv_heads, -1, self.head_dim)[:, :, : p.seq_len]
            return self._attend_repeated(q, kv[0], kv[1], mask=None)
        if p.start_pos == 0:
            # the whole context is new: attend over the new k/v, no gather, no mask
            k = k[p.token_start : p.token_end].transpose(0, 1)  # [Hkv, n, D]
            v = v[p.token_start : p.token_end].transpose(0, 1)
            return self._attend_repeated(q, k, v, mask=None)
        # gather the blocks: [2, Hkv, nb, bs, D] -> [2, Hkv, seq_len, D]
        kv = gather_kv(kv_cache, p.block_ids, q.dtype)
        kv = kv.view(2, self.num_kv_heads, -1, self.head_dim)[:, :, : p.seq_len]
        if _FLASH_WITH_LSE is not None and q.device.type == "cpu":
            return self._attend_split(q, kv, p.start_pos)
        mask = self._causal_mask(p, q.device)
        if not p.folded:
            return self._attend_repeated(q, kv[0], kv[1], mask=mask)
        q_folded = self._fold(q)  # [Hkv, G * n, D]
        out = F.scaled_dot_product_attention(q_folded[None], kv[0][None], kv[1][None], attn_mask=mask)
        return self._unfold(out[0], num_new)

    def _chunk_native(self, q: torch.Tensor, kv_cache: KVCache, p: PrefillSeq) -> torch.Tensor | None:
        """The chunk's attention straight from a bfloat16 pool: q holds the chunk's rows only, and
        goes to the batch kernel as a batch of one (causal per query token, no gathered copy, no
        mask); None where the kernel does not apply (as `_chunk_native_batch`)."""
        if p.batch is None:
            device = p.block_ids.device
            p.batch = PrefillBatch(
                p.block_ids.view(1, -1),
                long_tensor([p.start_pos], device),
                long_tensor([0], device),
                long_tensor([p.token_end - p.token_start], device),
            )
        return self._chunk_native_batch(q, kv_cache, p.batch)

    def _chunk_native_batch(self, q: torch.Tensor, kv_cache: KVCache, b: PrefillBatch) -> torch.Tensor | None:
        """Every prefill chunk's attention in one kvt_chunk_attention_batch call: [T, Hq * D] with
        the prefill rows filled (decode rows are left for the caller); None where the kernel does
        not apply (as `_chunk_native`)."""
        lib = _chunk_lib_for(q, kv_cache) if self.chunk_variant != CHUNK_SDPA else None
        if lib is None:
            return None
        assert isinstance(kv_cache, torch.Tensor)  # _chunk_lib_for: not a quantized cache
        q = q.contiguous()
        out = torch.empty_like(q)
        _two, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        num_seqs, max_blocks = b.block_tables.shape
        rc = lib.kvt_chunk_attention_batch(
            q.data_ptr(),
            out.data_ptr(),
            kv_cache.data_ptr(),
            b.block_tables.data_ptr(),
            max_blocks,
            b.starts.data_ptr(),
            b.row_starts.data_ptr(),
            b.num_tokens.data_ptr(),
            num_seqs,
            self.num_heads,
            num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            head_dim**-0.5,
            self.chunk_variant,
        )
        return _chunk_result(rc, out, num_blocks)

    def _attend_split(self, q: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
        """A chunk over its cached prefix without a mask: q [n, Hq, D] attends (a) over the prefix
        kv[:, :, :start] with every key visible, GQA folded into the query axis, and (b) causally
        over its own keys kv[:, :, start:]; the two partial softmaxes merge by their log-sum-exps,
        out = a * w + b * (1 - w) with w = sigmoid(lse_a - lse_b). Both parts run SDPA's flash
        kernel, which a mask over the whole context would slow down (see docs/benchmarks.md)."""
        n = q.shape[0]
        group = self.num_queries_per_kv
        assert _FLASH_WITH_LSE is not None
        out_a, lse_a = _FLASH_WITH_LSE(
            self._fold(q)[None], kv[0, :, :start][None], kv[1, :, :start][None], 0.0, False
        )  # [1, Hkv, G * n, D], [1, Hkv, G * n]
        k_new = kv[0, :, start:].repeat_interleave(group, 0)[None]  # [1, Hq, n, D]
        v_new = kv[1, :, start:].repeat_interleave(group, 0)[None]
        out_b, lse_b = _FLASH_WITH_LSE(q.transpose(0, 1)[None], k_new, v_new, 0.0, True)  # [1, Hq, n, D], [1, Hq, n]
        # folded row g * n + i of KV head h is query head h * G + g: the same [Hq, n] order as part b
        weight = torch.sigmoid(lse_a.reshape(self.num_heads, n, 1) - lse_b.reshape(self.num_heads, n, 1))
        out = torch.lerp(out_b[0].float(), out_a.view(self.num_heads, n, self.head_dim).float(), weight)
        return out.to(q.dtype).transpose(0, 1).reshape(n, -1)  # [Hq, n, D] -> [n, Hq * D]

    def _attend_repeated(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [n, Hq, D], k/v [Hkv, L, D], mask [n, L] or None (causal, L == n) -> [n, Hq * D].
        KV heads are repeated to Hq (HF's repeat_kv order: KV head j serves query heads j*G .. j*G+G-1)."""
        k = k.repeat_interleave(self.num_queries_per_kv, 0)[None]  # [1, Hq, L, D]
        v = v.repeat_interleave(self.num_queries_per_kv, 0)[None]
        q = q.transpose(0, 1)[None]  # [1, Hq, n, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return out[0].transpose(0, 1).reshape(q.shape[2], -1)  # [1, Hq, n, D] -> [n, Hq * D]

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, d: DecodeBatch, block_size: int) -> torch.Tensor:
        batch, max_blocks = d.block_tables.shape
        if q.shape[0] != batch:
            q = q.index_select(0, d.token_idx)  # [B, Hq, D]
        out = self._decode_native(q, kv_cache, d)
        if out is None and self.native_f32:
            out = self._decode_f32(q, kv_cache, d)
        if out is not None:
            return out
        q = q.view(batch, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)  # [B, Hkv, G, D]
        kv = gather_kv(kv_cache, d.block_tables.view(-1), q.dtype)  # [2, Hkv, B * max_blocks, bs, D]
        kv = kv.view(2, self.num_kv_heads, batch, max_blocks * block_size, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=d.mask)  # [B, Hkv, G, D]
        return out.reshape(batch, -1)

    def _decode_native(self, q: torch.Tensor, kv_cache: KVCache, d: DecodeBatch) -> torch.Tensor | None:
        """Decode attention straight from the paged pool (kvtier/model/csrc/paged_attention.c);
        None where the kernel does not apply (no AVX-512 build, another device or dtype)."""
        lib = native.paged_attention_lib() if q.device.type == "cpu" else None
        if lib is None or q.dtype not in native.FLOAT_KIND:
            return None
        pool, scales = (kv_cache.data, kv_cache.scales) if isinstance(kv_cache, QuantizedKVCache) else (kv_cache, None)
        kind = native.KV_STORAGE.get(pool.dtype)
        if kind is None or not pool.is_contiguous() or (scales is not None) != (pool.dtype in native.SCALED_STORAGE):
            return None
        rotation = kv_cache.rotation if isinstance(kv_cache, QuantizedKVCache) else None
        out_dtype = q.dtype
        if rotation is not None:  # attend in the pool's rotated basis (see QuantizedKVCache.rotation)
            q = rotate(q, rotation)
        q = q.contiguous()
        out = torch.empty_like(q)
        batch, max_blocks = d.block_tables.shape
        _two, num_kv_heads, num_blocks, block_size, head_dim = pool.shape
        per_token = isinstance(kv_cache, QuantizedKVCache) and kv_cache.kv_dtype.per_token
        rc = lib.kvt_decode_attention(
            q.data_ptr(),
            native.FLOAT_KIND[q.dtype],
            out.data_ptr(),
            pool.data_ptr(),
            kind,
            scales.data_ptr() if scales is not None else None,
            native.SCALE_TOKEN if per_token else native.SCALE_BLOCK,
            d.block_tables.data_ptr(),
            max_blocks,
            d.seq_lens.data_ptr(),
            batch,
            self.num_heads,
            num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            head_dim**-0.5,
        )
        if rc == native.BAD_INDEX:
            raise IndexError(f"decode attention: a block table or length is outside the pool of {num_blocks} blocks")
        if rc != 0:
            return None
        if rotation is not None:
            out = rotate(out, rotation).to(out_dtype)
        return out.view(batch, -1)

    def _decode_f32(self, q: torch.Tensor, kv_cache: KVCache, d: DecodeBatch) -> torch.Tensor | None:
        """csrc/decode_attention_f32.c on float32 q and an unquantized float32 pool, else None."""
        if (
            not isinstance(kv_cache, torch.Tensor)
            or q.dtype != torch.float32
            or kv_cache.dtype != torch.float32
            or q.device.type != "cpu"
            or not kv_cache.is_contiguous()
        ):
            return None
        lib = native.decode_attention_f32_lib()
        if lib is None:
            return None
        q = q.contiguous()
        out = torch.empty_like(q)
        batch, max_blocks = d.block_tables.shape
        _two, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        rc = lib.kvt_decode_attention_f32(
            q.data_ptr(),
            out.data_ptr(),
            kv_cache.data_ptr(),
            d.block_tables.data_ptr(),
            max_blocks,
            d.seq_lens.data_ptr(),
            batch,
            self.num_heads,
            num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            head_dim**-0.5,
        )
        if rc == native.BAD_INDEX:
            raise IndexError(f"decode attention: a block table or length is outside the pool of {num_blocks} blocks")
        return out.view(batch, -1) if rc == 0 else None

    def _fold(self, q: torch.Tensor) -> torch.Tensor:
        """[n, Hq, D] -> [Hkv, G * n, D], row g * n + i = token i of query head kv * G + g."""
        n = q.shape[0]
        q = q.view(n, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)
        return q.permute(1, 2, 0, 3).reshape(self.num_kv_heads, self.num_queries_per_kv * n, self.head_dim)

    def _unfold(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """[Hkv, G * n, D] -> [n, Hq * D]."""
        out = out.view(self.num_kv_heads, self.num_queries_per_kv, n, self.head_dim)
        return out.permute(2, 0, 1, 3).reshape(n, -1)


def _chunk_lib_for(q: torch.Tensor, kv_cache: KVCache) -> Any:
    """The native chunk kernel's library where it applies to these tensors (bfloat16 q and a
    contiguous, unquantized bfloat16 pool on the CPU), else None."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or not isinstance(kv_cache, torch.Tensor):
        return None
    lib = native.chunk_attention_lib()
    if lib is None or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous():
        return None
    return lib


def _chunk_result(rc: int, out: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """A chunk kernel's output [n, Hq * D]; None where it declined (rc UNSUPPORTED)."""
    if rc == native.BAD_INDEX:
        raise IndexError(f"chunk attention: a block id is outside the pool of {num_blocks} blocks")
    return out.view(out.shape[0], -1) if rc == 0 else None


def gather_kv(kv_cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `block_ids` [n] of one layer's K and V: [2, Hkv, n, block_size, D] in `dtype`."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.gather(block_ids, dtype)
    return kv_cache.index_select(2, block_ids)


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the slots of positions start .. end-1, one `range` per block (no per-token loop)."""
    for block_idx in range(start // block_size, (end - 1) // block_size + 1):
        block_start = block_idx * block_size
        base = table[block_idx] * block_size - block_start
        slots.extend(range(base + max(start, block_start), base + min(end, block_start + block_size)))


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor from a list, faster than torch.tensor(list) (hot path: per step)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    cpu = torch.frombuffer(array.array("q", values), dtype=torch.long)  # keeps the array alive
    return cpu if device.type == "cpu" else cpu.to(device, non_blocking=False)
