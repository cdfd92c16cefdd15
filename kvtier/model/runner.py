"""ModelRunner: owns the weights and the paged KV pool, and executes one `SchedulerOutput` per step.

    runner = ModelRunner("/models/llama", dtype="bfloat16", num_blocks=1024)
    logits = runner.execute(sched_out)   # float32 [num sampled seqs, vocab], in seq order

KV pool: one zero-initialised tensor for all layers (layout: see kvtier.model.attention),
    kv_pool [num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]
in the model dtype; `kv_caches[l]` is layer l's view. Block b of every layer is
`kv_pool[:, :, :, b]`, which is what `block_copies` and `read_blocks`/`write_blocks` move.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvtier.model.attention import AttentionBackend, TorchPagedAttention, long_tensor
from kvtier.model.hf_config import ArchConfig
from kvtier.model.llama import DecoderLM, can_pack_linears
from kvtier.model.loader import checkpoint_dtype, load_model, model_fingerprint
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
        dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16"; also the KV dtype.
        device: defaults to "cuda" when available, else "cpu".
        block_size: tokens per KV block.
        num_blocks / kv_cache_bytes: pool size, at most one of them; default: 25% of the
            memory available after loading the weights, capped at 4 GiB.
        seed: seeds `self.generator`, the generator the sampler should draw from.
        attn_backend: defaults to `TorchPagedAttention`.
        pack_weights: on CPU in bfloat16, pre-pack projection weights for oneDNN
            (same results, faster small batches).
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        attn_backend: AttentionBackend | None = None,
        pack_weights: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("pass num_blocks or kv_cache_bytes, not both")
        self.model_dir = Path(model_dir)
        self.arch = ArchConfig.from_dir(self.model_dir)
        self.device = torch.device(device) if device is not None else _default_device()
        self.dtype = _resolve_dtype(dtype, self.arch, self.model_dir)
        self.kv_dtype = self.dtype
        self.block_size = block_size
        if self.arch.sliding_window is not None and self.arch.sliding_window < self.arch.max_position_embeddings:
            logger.warning(
                "%s: sliding_window=%d is ignored; contexts longer than it will differ from the reference model",
                self.model_dir, self.arch.sliding_window,
            )

        self.attn_backend = attn_backend or TorchPagedAttention(
            self.arch.num_heads, self.arch.num_kv_heads, self.arch.head_dim
        )
        self.model: DecoderLM = load_model(
            self.model_dir, self.arch, self.attn_backend, dtype=self.dtype, device=self.device
        )
        if pack_weights and can_pack_linears(self.dtype, self.device):
            self.model.pack_linears()
        self.fingerprint = model_fingerprint(self.model_dir, self.dtype, self.kv_dtype, block_size)

        # K and V, every layer, every KV head
        elem_bytes = torch.empty((), dtype=self.kv_dtype).element_size()
        arch = self.arch
        self.kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem_bytes
        self.kv_bytes_per_block = self.kv_bytes_per_token * block_size
        self.num_blocks = num_blocks if num_blocks is not None else self._blocks_for(kv_cache_bytes)
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self.kv_pool = torch.zeros(
            (self.arch.num_layers, 2, self.arch.num_kv_heads, self.num_blocks, block_size, self.arch.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.kv_caches: list[torch.Tensor] = list(self.kv_pool.unbind(0))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # -- public ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run `out.block_copies`, then one forward pass over `out.seqs`.

        Returns float32 logits [num seqs with sample=True, vocab], in the order of those seqs.
        """
        self._copy_blocks(out.block_copies)
        if not out.seqs:
            return torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=self.device)
        input_ids, positions, sample_rows = self._prepare_inputs(out.seqs)
        meta = self.attn_backend.build_metadata(out.seqs, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        if sample_rows is None:
            return torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, sample_rows))

    @torch.no_grad()  # not inference_mode: callers keep and reuse the copy outside it
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks' KV: [len(block_ids), num_layers, 2, num_kv_heads, block_size, head_dim]."""
        index = long_tensor(block_ids, self.device)
        return self.kv_pool.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous()

    @torch.no_grad()
    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Inverse of `read_blocks`: kv [len(block_ids), num_layers, 2, num_kv_heads, block_size, head_dim]."""
        index = long_tensor(block_ids, self.device)
        self.kv_pool.index_copy_(3, index, kv.to(self.device, self.kv_dtype).permute(1, 2, 3, 0, 4, 5))

    @torch.no_grad()
    def read_block(self, block_id: int) -> torch.Tensor:
        """A contiguous copy of one block's KV, every layer: [num_layers, 2, num_kv_heads, block_size, head_dim]."""
        return self.kv_pool[:, :, :, block_id].clone()

    @torch.no_grad()
    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Inverse of `read_block` (a restore from a tier below)."""
        self.kv_pool[:, :, :, block_id].copy_(kv)

    # -- internals ---------------------------------------------------------------------------

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        for c in copies:
            if not 0 <= c.num_tokens <= self.block_size:
                raise ValueError(f"block copy of {c.num_tokens} tokens does not fit a block of {self.block_size}")
            if c.num_tokens == 0 or c.src_block == c.dst_block:
                continue
            # [L, 2, Hkv, n, D]: all layers, K and V, in one copy
            self.kv_pool[:, :, :, c.dst_block, : c.num_tokens] = self.kv_pool[:, :, :, c.src_block, : c.num_tokens]

    def _prepare_inputs(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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

    def _blocks_for(self, kv_cache_bytes: int | None) -> int:
        if kv_cache_bytes is None:
            available = _available_memory_bytes(self.device)
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


def _resolve_dtype(dtype: str | torch.dtype, arch: ArchConfig, model_dir: Path) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        return _DTYPES[arch.dtype] if arch.dtype else checkpoint_dtype(model_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


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
