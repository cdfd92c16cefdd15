"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.config import CacheConfig, DriftConfig, EngineConfig, ModelConfig
from kvtier.engine.core import EngineCore
from kvtier.lora import LoRARequest
from kvtier.outputs import RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.sched.scheduler import SchedulerConfig
from kvtier.tiers.hierarchy import TierConfig

PromptType = str | list[int] | dict[str, Any]
_log = logging.getLogger(__name__)


class LLM:
    """An engine over one Hugging Face checkpoint directory.

    Exactly one of `num_device_blocks` / `kv_cache_bytes` sizes the device KV pool (neither:
    a default share of memory). `seed` seeds requests that do not carry their own.
    `kv_drift_sample_rate`: the fraction of requests re-computed with full-precision KV after
    they finish, to measure what the KV dtype costs (`engine.drift.stats`; kvtier.engine.drift).
    `model` (and `tokenizer`) as vLLM takes them: a directory, a .gguf file, or a hub id found
    in the local Hugging Face cache (`revision`, `download_dir`; kvtier never downloads).
    `gpu_memory_utilization` (vLLM's meaning): the share of the machine's memory this instance
    may use, weights included; the KV pool gets what the weights leave of it, checked against
    the memory available at start. `kv_cache_memory_fraction` (kvtier's): without a pool size,
    the share of the memory available after the weights that the KV pool takes (default 0.25,
    at most 4 GiB when neither is given). `kv_cache_memory_bytes` is vLLM's name for
    `kv_cache_bytes`. Other vLLM arguments (`tensor_parallel_size=1`, `trust_remote_code`,
    `enforce_eager`, ...) are accepted where they cannot matter here and refused otherwise
    (kvtier.vllm_flags); `override_generation_config` overrides the sampling defaults.
    `generation_config`: 'auto' (default) takes sampling defaults from the checkpoint's
    generation_config.json, 'vllm' ignores it, or a directory holding one (vLLM's meaning).
    `kv_cache_dtype` stores cached tokens as 'auto' (the model dtype), 'bfloat16', 'float16',
    'float32', 'fp8_e4m3', 'fp8_e5m2' or 'int8' (1 byte per value plus per-block scales: ~2x the
    tokens per byte of bfloat16, on the device and in every tier).
    `kv_master_key_file` (with `remote_cache_url`): fleet keys, as `kvtier serve
    --kv-master-key-file` (kvtier.tiers.keyring); a key other than the one the instances sharing
    the Redis use raises KeyDomainError. `kv_key_check_interval_s`: how long a cached data key
    is used before it is re-read (a purge made elsewhere reaches this engine within it).
    `kv_events_config`: vLLM's KVEventsConfig (a kvtier.kv_events.KVEventsConfig, a dict or a
    JSON object): publish what the caches hold as vLLM-format KV events for KV-aware routers.
    `enable_lora` (vLLM's names): serve PEFT LoRA adapters named per request (`lora_request=`,
    kvtier.lora), at most `max_loras` distinct ones per step, of rank up to `max_lora_rank`, the
    `max_cpu_loras` most recently used kept loaded (default: max_loras).
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        quantization: str | None = None,
        block_size: int = 16,
        num_device_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        seed: int = 0,
        device: str | None = None,
        max_model_len: int | None = None,
        tokenizer: str | None = None,
        scheduling_policy: str = "fcfs",
        eviction_policy: str = "lru",
        enable_chunked_prefill: bool = True,
        skip_tokenizer_init: bool = False,
        host_cache_bytes: int | None = None,
        disk_cache_dir: str | None = None,
        disk_cache_bytes: int | None = None,
        remote_cache_url: str | None = None,
        remote_ttl_s: float | None = None,
        remote_timeout_s: float = 1.0,
        cache_write_policy: str = "write_through",
        cache_compression: str | None = None,
        restore_policy: str = "cost",
        kv_key_dir: str | None = None,
        kv_master_key_file: str | None = None,
        kv_key_check_interval_s: float = 1.0,
        tier_faults: dict[str, str] | None = None,
        kv_cache_dtype: str = "auto",
        kv_drift_sample_rate: float = 0.0,
        cpu_threads_bind: str | None = None,
        num_threads: int | None = None,
        generation_config: str = "auto",
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_fraction: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        override_generation_config: dict[str, Any] | None = None,
        kv_events_config: Any = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        **kwargs: Any,
    ) -> None:
        from kvtier.kv_events import KVEventsConfig
        from kvtier.model.resolve import resolve_model
        from kvtier.vllm_flags import check_llm_kwargs

        for note in check_llm_kwargs(kwargs):  # vLLM's names: no-ops logged, the rest refused
            _log.info("%s", note)
        if kv_cache_memory_bytes is not None:
            if kv_cache_bytes is not None and kv_cache_bytes != kv_cache_memory_bytes:
                raise ValueError("kv_cache_memory_bytes is vLLM's name for kv_cache_bytes: give one")
            kv_cache_bytes = kv_cache_memory_bytes
        if gpu_memory_utilization is not None and kv_cache_memory_fraction is not None:
            raise ValueError(
                "gpu_memory_utilization (vLLM's: the machine's share, weights included) and "
                "kv_cache_memory_fraction (kvtier's: the free memory's share for KV) exclude each other"
            )
        self.model_name = str(model)
        model = resolve_model(str(model), revision, download_dir)
        if tokenizer is not None:
            tokenizer = resolve_model(tokenizer, None, download_dir)

        config = EngineConfig(
            model=ModelConfig(
                model=str(model),
                dtype=dtype,
                quantization=quantization,
                device=device,
                seed=seed,
                max_model_len=max_model_len,
                tokenizer=tokenizer,
                cpu_threads_bind=cpu_threads_bind,
                num_threads=num_threads,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_device_blocks=num_device_blocks,
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=enable_prefix_caching,
                eviction_policy=eviction_policy,
                kv_cache_dtype=kv_cache_dtype,
                memory_fraction=kv_cache_memory_fraction,
                memory_utilization=gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            tiers=TierConfig(
                host_cache_bytes=host_cache_bytes,
                disk_cache_dir=disk_cache_dir,
                disk_cache_bytes=disk_cache_bytes,
                remote_cache_url=remote_cache_url,
                remote_ttl_s=remote_ttl_s,
                remote_timeout_s=remote_timeout_s,
                cache_write_policy=cache_write_policy,
                compression=cache_compression,
                restore_policy=restore_policy,
                key_dir=kv_key_dir,
                master_key_file=kv_master_key_file,
                key_check_interval_s=kv_key_check_interval_s,
                faults=tuple(sorted((tier_faults or {}).items())),
            ),
            drift=DriftConfig(sample_rate=kv_drift_sample_rate, seed=seed),
            kv_events=KVEventsConfig.parse(kv_events_config),
        )
        tok = None
        if not skip_tokenizer_init:
            from kvtier.model.tokenizer import Tokenizer, has_tokenizer

            tok_dir = Path(tokenizer or model)
            if has_tokenizer(tok_dir):
                tok = Tokenizer(tok_dir)
        lora_config = None
        if enable_lora:
            from kvtier.lora import LoRAConfig

            lora_config = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
        self.engine = EngineCore(config, tokenizer=tok, lora_config=lora_config)
        self.tokenizer = tok
        self.config = config
        from kvtier.sampling_params import generation_defaults

        self._sampling_defaults = generation_defaults(str(model), generation_config, override_generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's; what `generate`
        uses when given no SamplingParams. `generation_config='vllm'` turns them off."""
        return SamplingParams(**self._sampling_defaults)

    @property
    def num_device_blocks(self) -> int:
        return self.engine.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.engine.kv.block_size

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block from the device pool (tiers below keep theirs);
        returns how many blocks were dropped."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Finish queued tier writes and release tier connections."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or
        `prompt_token_ids` (and optionally its own `cache_salt`). `lora_request`: the LoRA
        adapter for every prompt, or a list with one (or None) per prompt (needs enable_lora).
        """
        items = _as_list(prompts)
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(items), "sampling_params")
        prios = list(priority) if priority is not None else [0] * len(items)
        if len(prios) != len(items):
            raise ValueError(f"got {len(prios)} priorities for {len(items)} prompts")
        loras = _broadcast(lora_request, len(items), "lora_request")
        prepared = [self._prepare(p, cache_salt) for p in items]  # validate all before adding any
        ids: list[str] = []
        try:
            for (text, token_ids, salt), sp, prio, lora in zip(prepared, params, prios, loras):
                ids.append(
                    self.engine.add_request(
                        token_ids, sp, cache_salt=salt, priority=prio, prompt=text, lora_request=lora
                    )
                )
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them; `lora_request`
        as for `generate` (one per conversation in a list)."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this model directory has no tokenizer.json")
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} (or a list of such conversations)"
            )
        convs = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode_chat(c, add_generation_prompt, **(chat_template_kwargs or {}))}
            for c in convs
        ]
        return self.generate(
            prompts, sampling_params, cache_salt=cache_salt, use_tqdm=use_tqdm, lora_request=lora_request
        )

    def get_tokenizer(self) -> Any:
        """The tokenizer (kvtier.model.tokenizer.Tokenizer: `encode`, `decode`,
        `apply_chat_template`), as vLLM's `LLM.get_tokenizer()`; None without one."""
        return self.tokenizer

    def _prepare(self, p: PromptType, default_salt: str | None) -> tuple[str | None, list[int], str | None]:
        salt = default_salt
        text: str | None = None
        if isinstance(p, dict):
            salt = p.get("cache_salt", default_salt)
            if "prompt_token_ids" in p:
                token_ids = p["prompt_token_ids"]
            elif "prompt" in p:
                text = p["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, str):
            text = p
        else:
            token_ids = p
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            token_ids = self.tokenizer.encode(text)
        if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, list(token_ids), salt

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        want = set(ids)
        done: dict[str, RequestOutput] = {}
        engine = self.engine
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while len(done) < len(want):
                for out in engine.step():
                    if out.finished and out.request_id in want:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not engine.has_unfinished and len(done) < len(want):
                    raise RuntimeError("engine stopped with requests unfinished")
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _progress(total: int) -> Any:
    """A tqdm bar over the prompts (vLLM's `use_tqdm=True`); tqdm is an optional dependency."""
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError("use_tqdm=True needs tqdm (pip install tqdm)") from e
    return tqdm(total=total, desc="Processed prompts", unit="prompt")


def _as_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            return []
        if all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise ValueError("prompts must be a string, a list of token ids, a dict, or a list of those")


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"got {len(value)} {name} for {n} prompts")
        return list(value)
    return [value] * n
