"""ModelRunner: owns the weights and the paged KV pool, and executes one `SchedulerOutput` per step.

    runner = ModelRunner("/models/llama", dtype="bfloat16", num_blocks=1024)
    logits = runner.execute(sched_out)   # float32 [num sampled seqs, vocab], in seq order

KV pool: one zero-initialised tensor for all layers (layout: see kvtier.model.attention),
    kv_pool   [num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]
    kv_scales [num_layers, 2 (K, V), num_kv_heads, num_blocks] float32   (quantized KV only)
              [num_layers, 2, num_kv_heads, num_blocks, block_size] float16 (per-token scales: int8_tok)
in the storage dtype of `kv_cache_dtype` (default: the model dtype; see kvtier.model.kv_quant).
`kv_caches[l]` is layer l's view: a plain tensor, or a `QuantizedKVCache` (pool view + scales view)
when the KV dtype is not the model dtype. Block b of every layer is `kv_pool[:, :, :, b]` (plus
`kv_scales[..., b]`), which is what `block_copies` and `read_block(s)`/`write_block(s)` move.

What `read_block` returns, and so what tiers store: unquantized, the block's KV
[num_layers, 2, num_kv_heads, block_size, head_dim] in the KV dtype; quantized, one packed uint8
tensor [data bytes | scale bytes] (the data in the storage dtype, then the float32 scales
[num_layers, 2, num_kv_heads]): the quantized form, so tiers hold and move half the bytes, and a
restore is bit-exact. `kv_bytes_per_block` is that tensor's size.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.model import native
from kvtier.model.attention import AttentionBackend, KVCache, TorchPagedAttention, long_tensor
from kvtier.model.gguf import is_gguf
from kvtier.model.hf_config import ArchConfig
from kvtier.model.kv_quant import KVDtype, QuantizedKVCache, resolve_kv_dtype
from kvtier.model.linear import can_pack_linears
from kvtier.model.llama import DecoderLM
from kvtier.model.loader import arch_config, checkpoint_dtype, load_model, model_fingerprint, read_kv_scales
from kvtier.model.lora import LoRABatch, LoRAWeights
from kvtier.sched.output import BlockCopy, ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_KV_MEMORY_FRACTION = 0.25
"""Without num_blocks / kv_cache_bytes the pool takes this share of the memory available ..."""
DEFAULT_KV_CACHE_MAX_BYTES = 4 << 30
"""... capped at 4 GiB."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Weights + KV pool + one forward pass per step.

    Args:
        model_dir: a local Hugging Face checkpoint (config.json + *.safetensors).
        dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".
        device: defaults to "cuda" when available, else "cpu".
        block_size: tokens per KV block.
        num_blocks / kv_cache_bytes: pool size, at most one of them; default: 25% of the
            memory available after loading the weights, capped at 4 GiB.
        seed: seeds `self.generator`, the generator the sampler should draw from.
        attn_backend: defaults to `TorchPagedAttention`.
        pack_weights: on CPU in bfloat16, pre-pack projection weights for oneDNN
            (same results, faster small batches), where the GEMM plan measured at load uses
            oneDNN at all (`gemm_plan`: which method serves each batch size of a bfloat16 model
            on CPU; see kvtier.model.linear).
        kv_cache_dtype: how the KV cache stores tokens: "auto" (the model dtype), "bfloat16",
            "float16", "float32", "fp8_e4m3", "fp8_e5m2" or "int8" (see kvtier.model.kv_quant).
            Quantized dtypes keep a float32 scale per (layer, K/V, KV head, block), dynamic, or
            the checkpoint's static per-layer k_scale / v_scale when it has them.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        quantization: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        attn_backend: AttentionBackend | None = None,
        pack_weights: bool = True,
        kv_cache_dtype: str | torch.dtype = "auto",
        memory_fraction: float | None = None,
        memory_utilization: float | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("pass num_blocks or kv_cache_bytes, not both")
        self.model_dir = Path(model_dir)
        self.arch = arch_config(self.model_dir)
        self.device = torch.device(device) if device is not None else _default_device()
        self.dtype = _resolve_dtype(dtype, self.arch, self.model_dir)
        self.kv_spec: KVDtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.kv_cache_dtype: str = self.kv_spec.name  # resolved: "auto" becomes the model dtype's name
        self.kv_dtype = self.kv_spec.storage  # the pool's dtype
        self.block_size = block_size
        if self.arch.sliding_window is not None and self.arch.sliding_window < self.arch.max_position_embeddings:
            logger.warning(
                "%s: sliding_window=%d is ignored; contexts longer than it will differ from the reference model",
                self.model_dir,
                self.arch.sliding_window,
            )

        self.attn_backend = attn_backend or TorchPagedAttention(
            self.arch.num_heads, self.arch.num_kv_heads, self.arch.head_dim
        )
        self.model: DecoderLM = load_model(
            self.model_dir,
            self.arch,
            self.attn_backend,
            dtype=self.dtype,
            device=self.device,
            weights=_resolve_weights(quantization, self.model_dir, self.device),
        )
        self.weights = self.model.weight_format
        """How the projections hold their weights (kvtier.model.loader.WEIGHT_FORMATS): `dense`
        where the checkpoint has no quantized projection (a float GGUF file)."""
        self.gemm_plan = self.model.plan_linears(pack=pack_weights and can_pack_linears(self.dtype, self.device))
        # the KV dtype's name: quantized and full-precision entries never share a key
        self.fingerprint = model_fingerprint(
            self.model_dir, self.dtype, self.kv_spec.name, block_size, weights=self.weights
        )

        # K and V, every layer, every KV head; quantized: + one float32 scale per block of each
        arch = self.arch
        num_kv_rows = 2 * arch.num_layers * arch.num_kv_heads
        self.kv_data_bytes_per_block = num_kv_rows * block_size * arch.head_dim * self.kv_spec.elem_bytes
        self.kv_scale_bytes_per_row = (
            0 if not self.kv_spec.quantized else block_size * 2 if self.kv_spec.per_token else 4
        )
        """Scale bytes per (layer, K/V, KV head) of a block."""
        self.kv_scale_bytes_per_block = num_kv_rows * self.kv_scale_bytes_per_row
        self.kv_bytes_per_block = self.kv_data_bytes_per_block + self.kv_scale_bytes_per_block
        self.kv_bytes_per_token: int | float = (
            self.kv_bytes_per_block // block_size
            if self.kv_bytes_per_block % block_size == 0
            else self.kv_bytes_per_block / block_size
        )
        if num_blocks is None and kv_cache_bytes is None and memory_utilization is not None:
            kv_cache_bytes = self._kv_bytes_for_utilization(memory_utilization)
        self.num_blocks = num_blocks if num_blocks is not None else self._blocks_for(kv_cache_bytes, memory_fraction)
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self.kv_pool = torch.zeros(
            (self.arch.num_layers, 2, self.arch.num_kv_heads, self.num_blocks, block_size, self.arch.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.attn_backend.bind_pool(self.kv_dtype, self.dtype, self.device)
        self.kv_scales: torch.Tensor | None = None
        self.static_kv_scales = (
            read_kv_scales(self.model_dir, arch.num_layers)
            if self.kv_spec.quantized and not self.kv_spec.per_token
            else None
        )
        if self.kv_spec.quantized:
            per_token = (self.block_size,) if self.kv_spec.per_token else ()
            self.kv_scales = torch.zeros(
                (arch.num_layers, 2, arch.num_kv_heads, self.num_blocks, *per_token),
                dtype=self.kv_spec.scale_dtype,
                device=self.device,
            )
            if self.static_kv_scales is not None:
                self._fill_static_scales(self.static_kv_scales)
        self.kv_caches: list[KVCache] = self._layer_caches()
        self._warm_up_kv_kernels()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_loras = 0
        """Device slots for LoRA adapters (`enable_lora`); 0: LoRA off, the forward pass never looks."""
        self._lora_slots: OrderedDict[bytes, LoRAWeights] = OrderedDict()
        """Adapter key -> its weights on this device, least recently used first."""

    # -- public ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, all_rows: bool = False) -> torch.Tensor:
        """Run `out.block_copies`, then one forward pass over `out.seqs`.

        Returns float32 logits [num seqs with sample=True, vocab], in the order of those seqs; with
        `all_rows`, the logits of every scheduled token [num tokens, vocab] (row i predicts the
        token after the i-th one: scoring a text's log-likelihood).
        """
        logits, _ = self.execute_rows(out, None, all_rows)
        return logits

    def execute_rows(
        self, out: SchedulerOutput, rows: list[int] | None, all_rows: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute`, plus the logits of the scheduled tokens at `rows` (indices into the
        step's tokens, seqs in order) computed apart: prompt logprobs, without changing how
        the sampled rows are computed."""
        self._copy_blocks(out.block_copies)
        empty = torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=self.device)
        if not out.seqs:
            return empty, None
        input_ids, positions, sample_rows = self._prepare_inputs(out.seqs)
        meta = self.attn_backend.build_metadata(out.seqs, self.block_size, self.device)
        lora = self._lora_batch(out.seqs) if self.max_loras else None
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora)  # [T, hidden]
        extra = None
        if rows:
            extra = self.model.compute_logits(hidden.index_select(0, long_tensor(rows, self.device)))
        if all_rows:
            return self.model.compute_logits(hidden), extra
        if sample_rows is None:
            return empty, extra
        return self.model.compute_logits(hidden.index_select(0, sample_rows)), extra

    def enable_lora(self, max_loras: int) -> None:
        """Serve LoRA adapters: a step's sequences may name one (ScheduledSeq.lora), of at most
        `max_loras` distinct adapters per step (the scheduler keeps to it), each kept on the
        device in one of `max_loras` slots until a step needs the slot for another."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras

    def _lora_batch(self, seqs: list[ScheduledSeq]) -> LoRABatch | None:
        """The step's adapters on the device and their rows; None when no sequence has one."""
        if all(s.lora is None for s in seqs):
            return None
        wanted = {s.lora.key: s.lora for s in seqs if s.lora is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters; max_loras is {self.max_loras}")
        slots = self._lora_slots
        for key, adapter in wanted.items():
            if key in slots:
                slots.move_to_end(key)
                continue
            if len(slots) >= self.max_loras:  # the least recently used adapter this step does not need
                del slots[next(k for k in slots if k not in wanted)]
            slots[key] = adapter.to(self.device)
        adapters = [slots[s.lora.key] if s.lora is not None else None for s in seqs]
        return LoRABatch.build(adapters, [len(s.token_ids) for s in seqs], self.device)

    @property
    def tokens_per_gib(self) -> float:
        """KV tokens one GiB of pool holds (every layer, K and V, scales included)."""
        return (1 << 30) / self.kv_bytes_per_block * self.block_size

    @torch.no_grad()  # not inference_mode: callers keep and reuse the copy outside it
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks' KV: [len(block_ids), num_layers, 2, num_kv_heads, block_size, head_dim];
        quantized: [len(block_ids), kv_bytes_per_block] uint8, each row as `read_block` packs it."""
        index = long_tensor(block_ids, self.device)
        data = self.kv_pool.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous()
        if self.kv_scales is None:
            return data
        scales = self.kv_scales.index_select(3, index).movedim(3, 0).contiguous()
        return torch.cat(
            (data.view(torch.uint8).view(len(block_ids), -1), scales.view(torch.uint8).view(len(block_ids), -1)), dim=1
        )

    @torch.no_grad()
    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Inverse of `read_blocks`."""
        index = long_tensor(block_ids, self.device)
        if self.kv_scales is None:
            self.kv_pool.index_copy_(3, index, kv.to(self.device, self.kv_dtype).permute(1, 2, 3, 0, 4, 5))
            return
        data, scales = self._unpack(kv, len(block_ids))
        # byte views: CPU index_copy_ has no float8 kernel
        pool = self.kv_pool.view(torch.int8) if self.kv_dtype.itemsize == 1 else self.kv_pool
        pool.index_copy_(3, index, data.view(pool.dtype).permute(1, 2, 3, 0, 4, 5))
        self.kv_scales.index_copy_(3, index, scales.movedim(0, 3))

    @torch.no_grad()
    def read_block_list(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """`read_block` of each block (separate tensors, as tiers keep them), in one native call
        where available (a store of many blocks: one call instead of one copy per block)."""
        if not block_ids:
            return []
        packed = [self._empty_block() for _ in block_ids]
        if self._move_blocks_native(block_ids, packed, into_pool=False):
            return packed
        return [self.read_block(b) for b in block_ids]

    @torch.no_grad()
    def write_block_list(self, block_ids: Sequence[int], kvs: Sequence[torch.Tensor]) -> None:
        """`write_block` of each (block, kv) pair, as `read_block_list` made them: a restore of
        many blocks in one native call where available."""
        if len(block_ids) != len(kvs):
            raise ValueError(f"{len(block_ids)} block ids for {len(kvs)} blocks of KV")
        if not block_ids:
            return
        if all(self._is_packed_block(kv) for kv in kvs) and self._move_blocks_native(block_ids, kvs, into_pool=True):
            return
        for block_id, kv in zip(block_ids, kvs):
            self.write_block(block_id, kv)

    @torch.no_grad()
    def read_block(self, block_id: int) -> torch.Tensor:
        """A contiguous copy of one block's KV, every layer: [num_layers, 2, num_kv_heads, block_size, head_dim]
        in the KV dtype; quantized: [kv_bytes_per_block] uint8 (data, then scales; see the module doc)."""
        if self.kv_scales is None:
            return self.kv_pool[:, :, :, block_id].clone()
        packed = torch.empty(self.kv_bytes_per_block, dtype=torch.uint8, device=self.device)
        data, scales = self._unpack(packed, None)  # views into `packed`
        data.view(torch.int8).copy_(self.kv_pool[:, :, :, block_id].view(torch.int8))
        scales.copy_(self.kv_scales[:, :, :, block_id])
        return packed

    @torch.no_grad()
    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Inverse of `read_block` (a restore from a tier below)."""
        if self.kv_scales is None:
            self.kv_pool[:, :, :, block_id].copy_(kv)
            return
        data, scales = self._unpack(kv, None)
        self.kv_pool[:, :, :, block_id].view(torch.int8).copy_(data.view(torch.int8))  # a byte copy
        self.kv_scales[:, :, :, block_id].copy_(scales)

    # -- internals ---------------------------------------------------------------------------

    def _layer_caches(self) -> list[KVCache]:
        layers = self.kv_pool.unbind(0)
        if self.kv_dtype == self.dtype:
            return list(layers)  # native: attention reads and writes plain tensors
        static = self.static_kv_scales
        scales = self.kv_scales.unbind(0) if self.kv_scales is not None else [None] * len(layers)
        return [
            QuantizedKVCache(data, scale, self.kv_spec, static[layer] if static is not None else None)
            for layer, (data, scale) in enumerate(zip(layers, scales))
        ]

    def _warm_up_kv_kernels(self) -> None:
        """Build (or load) the native kernels now, not inside the first requests' steps."""
        if self.device.type == "cpu":
            native.paged_attention_lib()
            native.kv_quant_lib()

    def _fill_static_scales(self, static: list[tuple[float, float]]) -> None:
        """Checkpoint scales follow the fp8_e4m3 convention (x ~= fp8 * scale, i.e. calibrated
        amax / 448); other quantized dtypes keep that amax: scale * 448 / qmax."""
        assert self.kv_spec.qmax is not None and self.kv_scales is not None, "static scales need a quantized KV dtype"
        factor = 448.0 / self.kv_spec.qmax
        converted = [(k * factor, v * factor) for k, v in static]
        self.static_kv_scales = converted
        for layer, (k_scale, v_scale) in enumerate(converted):
            self.kv_scales[layer, 0].fill_(k_scale)
            self.kv_scales[layer, 1].fill_(v_scale)

    def _empty_block(self) -> torch.Tensor:
        """Room for one block as `read_block` returns it."""
        if self.kv_scales is None:
            arch = self.arch
            return torch.empty(
                (arch.num_layers, 2, arch.num_kv_heads, self.block_size, arch.head_dim),
                dtype=self.kv_dtype,
                device=self.device,
            )
        return torch.empty(self.kv_bytes_per_block, dtype=torch.uint8, device=self.device)

    def _is_packed_block(self, kv: torch.Tensor) -> bool:
        """kv is exactly what `read_block` returns here (dtype, size, contiguous, device)."""
        want = torch.uint8 if self.kv_scales is not None else self.kv_dtype
        return (
            kv.dtype == want
            and kv.device == self.device
            and kv.is_contiguous()
            and kv.numel() * kv.element_size() == self.kv_bytes_per_block
        )

    def _move_blocks_native(self, block_ids: Sequence[int], packed: Sequence[torch.Tensor], into_pool: bool) -> bool:
        """Whole blocks between the pool and `packed` (one kvt_move_blocks call); False when the
        native kernels cannot do it here."""
        lib = native.kv_quant_lib() if self.device.type == "cpu" else None
        if lib is None:
            return False
        arch = self.arch
        ids = long_tensor(list(block_ids), self.device)
        pointers = (ctypes.c_void_p * len(packed))(*[t.data_ptr() for t in packed])
        rc = lib.kvt_move_blocks(
            self.kv_pool.data_ptr(),
            self.kv_scales.data_ptr() if self.kv_scales is not None else None,
            self.kv_scale_bytes_per_row,
            arch.num_layers * 2 * arch.num_kv_heads,
            self.num_blocks,
            self.block_size * arch.head_dim * self.kv_spec.elem_bytes,
            ids.data_ptr(),
            pointers,
            len(packed),
            int(into_pool),
        )
        if rc != 0:
            raise IndexError(f"a block id of {list(block_ids)} is outside 0 .. {self.num_blocks - 1}")
        return True

    def _unpack(self, packed: torch.Tensor, num_blocks: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed uint8 block(s) -> data [(n,) L, 2, Hkv, bs, D] (storage dtype), scales [(n,) L, 2, Hkv]
        (per-token: [(n,) L, 2, Hkv, bs] float16)."""
        rows = 1 if num_blocks is None else num_blocks
        if packed.dtype != torch.uint8 or packed.numel() != rows * self.kv_bytes_per_block:
            raise ValueError(
                f"a KV block of this runner (kv_cache_dtype={self.kv_spec.name}) is {self.kv_bytes_per_block} "
                f"uint8 bytes; got {tuple(packed.shape)} {packed.dtype}: it was written with another kv_cache_dtype"
            )
        arch = self.arch
        packed = packed.to(self.device)
        if num_blocks is None:  # one block (a tier restore): views of the flat bytes, no copies
            packed = packed.reshape(-1)
            data = packed[: self.kv_data_bytes_per_block].view(self.kv_dtype)
            scales = packed[self.kv_data_bytes_per_block :].view(self.kv_spec.scale_dtype)
            return (
                data.view(arch.num_layers, 2, arch.num_kv_heads, self.block_size, arch.head_dim),
                scales.view(arch.num_layers, 2, arch.num_kv_heads, *self._per_token_dims),
            )
        packed = packed.view(rows, self.kv_bytes_per_block)
        data = packed[:, : self.kv_data_bytes_per_block].contiguous().view(self.kv_dtype)
        scales = packed[:, self.kv_data_bytes_per_block :].contiguous().view(self.kv_spec.scale_dtype)
        return (
            data.view(rows, arch.num_layers, 2, arch.num_kv_heads, self.block_size, arch.head_dim),
            scales.view(rows, arch.num_layers, 2, arch.num_kv_heads, *self._per_token_dims),
        )

    @property
    def _per_token_dims(self) -> tuple[int, ...]:
        """The trailing scale dimension of a block: (block_size,) for per-token scales, else ()."""
        return (self.block_size,) if self.kv_spec.per_token else ()

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        for c in copies:
            if not 0 <= c.num_tokens <= self.block_size:
                raise ValueError(f"block copy of {c.num_tokens} tokens does not fit a block of {self.block_size}")
            if c.num_tokens == 0 or c.src_block == c.dst_block:
                continue
            # [L, 2, Hkv, n, D]: all layers, K and V, in one copy
            self.kv_pool[:, :, :, c.dst_block, : c.num_tokens] = self.kv_pool[:, :, :, c.src_block, : c.num_tokens]
            if self.kv_scales is not None:  # the copied tokens keep their scale; new ones grow it
                self.kv_scales[:, :, :, c.dst_block] = self.kv_scales[:, :, :, c.src_block]

    def _prepare_inputs(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """input_ids [T], positions [T], rows of the sampled tokens [S] (None if none)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for seq in seqs:
            input_ids += seq.token_ids
            if len(seq.token_ids) == 1:
                positions.append(seq.start_pos)
            else:
                positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
            if seq.sample:
                sample_rows.append(len(input_ids) - 1)
        device = self.device
        return (
            long_tensor(input_ids, device),
            long_tensor(positions, device),
            long_tensor(sample_rows, device) if sample_rows else None,
        )

    def _kv_bytes_for_utilization(self, utilization: float) -> int:
        """vLLM's gpu_memory_utilization: this instance may use `utilization` of the device's
        total memory, what it already holds (weights, runtime) included; the KV pool gets the rest
        less a working reserve for activations. Checked: a share too small for the weights is a
        ValueError; a pool larger than the memory available now is capped to it (logged)."""
        gib = 1 << 30
        total = _total_memory_bytes(self.device)
        budget = int(total * utilization)
        used = _instance_memory_bytes(self.device)
        reserve = max(256 << 20, budget // 20)
        kv_bytes = budget - used - reserve
        if kv_bytes < self.kv_bytes_per_block:
            raise ValueError(
                f"gpu_memory_utilization={utilization} allows {budget / gib:.2f} GiB of this machine's "
                f"{total / gib:.2f} GiB, and this instance already uses {used / gib:.2f} GiB (weights and "
                f"runtime) plus a {reserve / gib:.2f} GiB working reserve: no room for the KV cache; "
                "raise it, or size the pool with --kv-cache-bytes"
            )
        available = _available_memory_bytes(self.device)
        headroom = max(512 << 20, total // 20)  # left to the OS and the other processes
        if kv_bytes > available - headroom:
            capped = max(available - headroom, self.kv_bytes_per_block)
            logger.warning(
                "gpu_memory_utilization=%s asks for a %.2f GiB KV cache, but %.2f GiB is available now: "
                "the pool takes %.2f GiB (vLLM's meaning is the share of the whole machine; on a shared "
                "host size the pool with --kv-cache-bytes)",
                utilization,
                kv_bytes / gib,
                available / gib,
                capped / gib,
            )
            kv_bytes = capped
        return kv_bytes

    def _blocks_for(self, kv_cache_bytes: int | None, memory_fraction: float | None = None) -> int:
        if kv_cache_bytes is None:
            available = _available_memory_bytes(self.device)
            if memory_fraction is not None:  # asked for: no cap
                kv_cache_bytes = int(available * memory_fraction)
            else:
                kv_cache_bytes = min(int(available * DEFAULT_KV_MEMORY_FRACTION), DEFAULT_KV_CACHE_MAX_BYTES)
        num_blocks = kv_cache_bytes // self.kv_bytes_per_block
        if num_blocks <= 0:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is less than one block ({self.kv_bytes_per_block} bytes); "
                f"give more memory or a smaller block_size"
            )
        return num_blocks


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


QUANTIZATIONS = {None: None, "none": "dense", "gguf": "gguf", "int8": "int8"}


def _resolve_weights(quantization: str | None, model_dir: Path, device: torch.device) -> str:
    """The loader's weight format for `quantization` (None: a GGUF file's own quantized blocks on
    CPU, else dense)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization={quantization!r} is not supported; use gguf, int8 or none "
            f"(kvtier quantizes weights on CPU only)"
        )
    weights = QUANTIZATIONS[quantization]
    if weights is None:
        return "gguf" if is_gguf(model_dir) and device.type == "cpu" else "dense"
    return weights


def _resolve_dtype(dtype: str | torch.dtype, arch: ArchConfig, model_dir: Path) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        resolved = _DTYPES[arch.dtype] if arch.dtype else checkpoint_dtype(model_dir)
        if resolved == torch.float32 and not is_gguf(model_dir):
            logger.info(
                "dtype auto: float32, the checkpoint's (vLLM's auto serves a float32 checkpoint in 16 "
                "bits; --dtype bfloat16 does that here, at half the weights' memory)"
            )
        return resolved
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _total_memory_bytes(device: torch.device) -> int:
    """The device's memory: a CUDA device's, else the host's MemTotal (or this cgroup's limit
    where lower)."""
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return total
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _instance_memory_bytes(device: torch.device) -> int:
    """What this instance holds on `device` now: torch's reserved memory on CUDA, else this
    process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device` (host MemAvailable for non-CUDA devices)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
