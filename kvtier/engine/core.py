"""EngineCore: the step loop.

out     = scheduler.schedule()              # who computes how many tokens, block copies
logits  = runner.execute(out)               # copies, one forward pass, logits of sampled rows
samples = sample(logits, rows)              # one token per sampled sequence (n per new group)
done    = scheduler.update_from_output(...) # advance, cache full blocks, stop checks, free
return    outputs of the requests that moved
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.config import EngineConfig
from kvtier.engine.admin import EngineAdmin
from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.drift import DriftMonitor
from kvtier.engine.input import check_max_tokens, check_prompt_fits, truncate_prompt
from kvtier.engine.stats import PromptCacheStats
from kvtier.engine.tenants import EngineTenants
from kvtier.identity import ANONYMOUS, Tenancy
from kvtier.kv_events import KVEventRecorder, ZmqEventPublisher
from kvtier.kvcache.keys import chain_keys, root_key
from kvtier.kvcache.manager import KVCacheManager
from kvtier.lora import LoRAConfig, LoRARegistry, LoRARequest, lora_fingerprint
from kvtier.model.sampler import Sample, SampleRow, sample, top_logprobs
from kvtier.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.sched.output import SchedulerOutput
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from kvtier.model.lora import LoRAWeights
    from kvtier.structured import GrammarCompiler

logger = logging.getLogger("kvtier.engine")


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepStats:
    """Where step time goes (seconds, summed over steps)."""

    num_steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of requests that got their first token (cached ones included, as vLLM's
    prompt_tokens_total)."""
    num_generation_tokens: int = 0
    iteration_token_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    """Steps by tokens computed (prompt chunks and decodes): counts per ITERATION_TOKEN_BUCKETS
    bucket (not cumulative), the last for larger steps."""
    prompt_cache: PromptCacheStats = field(default_factory=PromptCacheStats)
    """Where the prompt tokens of num_prompt_tokens came from (kvtier.engine.stats)."""

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.sample_s + self.update_s

    @property
    def bookkeeping_fraction(self) -> float:
        """Scheduler + cache bookkeeping as a fraction of step time."""
        return (self.schedule_s + self.update_s) / self.total_s if self.total_s else 0.0


@dataclass
class _Group:
    """One user request: n samples sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Request] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """Each sequence's text so far, kept only with stop strings (where it is cut at one) or when
    the text is streamed (`stream_text`); final once the sequence ended."""
    stream_text: bool = False
    """Detokenize as the text grows, for a streaming reader (AddRequest.stream): running
    outputs carry the text that is final so far (held back near a possible stop string)."""
    detoks: list[IncrementalDetokenizer | None] = field(default_factory=list)
    decoded: list[bool] = field(default_factory=list)
    """Whether texts[i] is final (the sequence ended and its text was decoded)."""
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    cum_logprobs: list[float] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)
    num_preemptions: int = 0
    tenancy: Tenancy = ANONYMOUS
    """Who the request belongs to (kvtier.identity): every sequence's, its blocks' owner."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Filled position by position as the prompt is computed (SamplingParams.prompt_logprobs)."""
    matchers: list[Any] = field(default_factory=list)
    """Structured outputs: each sequence's grammar state (kvtier.structured.Matcher) or None."""
    lora_request: LoRARequest | None = None
    lora: LoRAWeights | None = None
    """The adapter `lora_request` names, loaded (every sequence runs it); None: the base model."""

    @property
    def finished(self) -> bool:
        return len(self.finish) == self.params.n and all(f is not None for f in self.finish)


class EngineCore:
    """The engine: turns requests into outputs one `step()` at a time (the module docstring's
    loop), over a model runner, a Scheduler and its KVCacheManager, and the tiers below the
    device when configured.

    Owns the runner, the cache manager, the scheduler, the tier hierarchy, the tenant
    administration (`tenants`: purges, TTLs, quotas, usage) and the user-level request groups
    (n samples of one prompt, their texts, logprobs and grammar state); a serving front-end
    administers it through `admin` (kvtier.engine.admin). Not thread-safe: one thread calls
    everything (LLM's caller, or kvtier.engine.loop.EngineLoop on the server's engine thread or
    in the engine process). A grammar-mask helper thread and the tiers' workers run
    beside it, reached only through futures.

    Invariants (`check_integrity`, whenever no step is running): the unfinished sequences of
    its groups are exactly the scheduler's live requests; plus the Scheduler's invariants."""

    ITERATION_TOKEN_BUCKETS = ITERATION_TOKEN_BUCKETS
    """The bounds of the tokens-per-step histogram (StepStats.iteration_token_counts)."""

    def __init__(
        self, config: EngineConfig, runner=None, tokenizer=None, lora_config: LoRAConfig | None = None
    ) -> None:
        """`lora_config`: serve LoRA adapters (kvtier.lora) within its limits; None: requests
        naming an adapter are refused."""
        from kvtier.model.runner import ModelRunner

        self.config = config
        mc, cc = config.model, config.cache
        self.thread_plan = None
        """The CPU compute-thread plan in force (kvtier.threads), None on an accelerator."""
        if runner is None and (mc.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
            from kvtier import heap, threads

            self.thread_plan = threads.configure(mc.cpu_threads_bind, mc.num_threads)
            heap.retain_freed_memory()
        self.team = None
        """Shrinks the compute team off CPUs other processes use (kvtier.threads.AdaptiveTeam)."""
        if self.thread_plan is not None and len(self.thread_plan.compute_cpus) >= 2:
            from kvtier import threads

            self.team = threads.AdaptiveTeam(self.thread_plan)
            self.team.start_sampler()
        self.runner = runner or ModelRunner(
            mc.model,
            dtype=mc.dtype,
            quantization=mc.quantization,
            device=mc.device,
            block_size=cc.block_size,
            num_blocks=cc.num_device_blocks,
            kv_cache_bytes=cc.kv_cache_bytes,
            seed=mc.seed,
            kv_cache_dtype=cc.kv_cache_dtype,
            memory_fraction=cc.memory_fraction,
            memory_utilization=cc.memory_utilization,
        )
        self.kv = KVCacheManager(self.runner.num_blocks, cc.block_size, cc.enable_prefix_caching, cc.eviction_policy)
        self.tiers = None
        if config.tiers.enabled:
            if not cc.enable_prefix_caching:
                raise ValueError("tiers below the device need enable_prefix_caching=True")
            from kvtier.tiers.hierarchy import TierHierarchy

            self.tiers = TierHierarchy(
                config.tiers,
                fingerprint=self.runner.fingerprint,
                block_bytes=self.runner.kv_bytes_per_block,
                block_size=cc.block_size,
            )
            self.kv.set_store_policy(config.tiers.cache_write_policy, config.tiers.selective_min_hits)
        self.lora_config = lora_config
        self.loras: LoRARegistry | None = None
        """The loaded LoRA adapters (kvtier.lora), None without enable_lora."""
        if lora_config is not None:
            self.loras = LoRARegistry(lora_config, self.runner.arch, self.runner.dtype)
            self.runner.enable_lora(lora_config.max_loras)
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.tiers, max_loras=lora_config.max_loras if lora_config is not None else 0
        )
        self.tokenizer = tokenizer
        arch = self.runner.arch
        self.max_model_len = min(mc.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        eos = set(arch.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self.vocab_size = arch.vocab_size
        self._groups: dict[str, _Group] = {}
        self._seq_group: dict[str, _Group] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_gen = torch.Generator(device="cpu").manual_seed(mc.seed)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (Logprob.decoded_token)
        self._mask_pool: ThreadPoolExecutor | None = None
        self._fork_matchers: dict[str, list[Any]] = {}
        self._ids = itertools.count()
        self.step_stats = StepStats()
        self.drift = DriftMonitor(config.drift, self.runner) if config.drift.enabled else None
        """The online KV drift monitor (kvtier.engine.drift); None at sample rate 0."""
        self.tenants = EngineTenants(self.kv, self.tiers, self.runner.kv_bytes_per_block, self._store_blocks)
        """Purges, per-tenant TTLs, quotas and usage (kvtier.engine.tenants)."""
        self.kv_events = self._start_kv_events(config)
        """The KV event recorder and publisher (kvtier.kv_events); None when events are off."""
        self.admin = EngineAdmin(self)
        """What a serving front-end calls for purges, sweeps, usage, integrity checks and fleet
        keys (kvtier.engine.admin): its only way to the tiers and the tenant administration."""
        if self.tiers is not None:
            from kvtier.engine.calibrate import calibrate

            calibrate(self.runner, self.tiers)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        prompt: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
        tenancy: Tenancy | None = None,
        stream_text: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Add a request; its id. `tenancy`: who it belongs to, as the engine loop receives it
        from the server (kvtier.identity); or, offline and in tests, `tenant` and `cache_salt`,
        made into one here (not both ways at once). `stream_text`: running outputs carry the
        text decoded so far (a streaming reader's deltas; see _Group.stream_text).
        `lora_request`: the LoRA adapter to run it with, loaded here on its first use (a
        ValueError when LoRA is off or the adapter does not fit the model)."""
        if tenancy is None:
            tenancy = Tenancy.of(tenant, cache_salt)
        elif tenant is not None or cache_salt is not None:
            raise ValueError("give either tenancy or tenant/cache_salt, not both")
        params = params or SamplingParams()
        params.validate()
        ids = self._check_prompt(truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len))
        self._check_logits_params(params)
        check_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        if priority and self.scheduler.config.policy == "fcfs":
            raise ValueError(
                f"priority {priority} is only honoured under the 'priority' scheduling "
                "policy; this engine runs 'fcfs' (--scheduling-policy priority)"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self._adapter(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        matcher = (
            self._grammar_compiler().matcher(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        group = _Group(request_id, prompt, ids, params, arrival)
        group.tenancy = tenancy
        group.stream_text = stream_text
        group.lora_request, group.lora = lora_request, adapter
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
        req = self._new_seq(group, 0, ids, priority, arrival)
        group.matchers[0] = matcher
        if self.tiers is not None and self.tiers.has_remote:
            bs = self.kv.block_size
            req.tier_keys = chain_keys(req.root_key, ids, bs, num_blocks=(len(ids) - 1) // bs)
            req.remote_lookup = self.tiers.submit_remote_lookup(req.tier_keys)
        self.scheduler.add_request(req)
        self._groups[request_id] = group
        if self.drift is not None and adapter is None:  # the shadow recompute runs the base model
            self.drift.sample(request_id, ids)
        return request_id

    def _key_fingerprint(self, adapter: LoRAWeights | None) -> bytes:
        """What a request's block keys are rooted in: the model's fingerprint, with its adapter's
        content digest folded in (two adapters, or one and the base model, never share a block)."""
        fp = self.runner.fingerprint
        return fp if adapter is None else lora_fingerprint(fp, adapter.key)

    def _adapter(self, lora_request: LoRARequest | None) -> LoRAWeights | None:
        """The loaded adapter `lora_request` names (None for none)."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError(
                "this request names a LoRA adapter but LoRA is not enabled; "
                "start the engine with enable_lora=True (--enable-lora)"
            )
        return self.loras.get(lora_request)

    def _check_logits_params(self, params: SamplingParams) -> None:
        """Token ids in the vocabulary (logit_bias, allowed_token_ids, stop_token_ids, tokenized
        bad words); bad_words tokenized unless the caller (the API server) already did (vLLM's
        way: with and without a leading space; `tokenize_bad_words`, one linear pass)."""
        from kvtier.model.sampler import tokenize_bad_words

        vocab = self.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = next((t for t in getattr(params, name) or () if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None and len(params.allowed_token_ids) > vocab:
            params.allowed_token_ids = list(dict.fromkeys(params.allowed_token_ids))
        if params.bad_words and params.bad_words_token_ids is None:
            tokenizer = self.tokenizer
            if tokenizer is None:
                raise ValueError("bad_words needs a tokenizer; this model has none (use logit_bias)")
            params.bad_words_token_ids = tokenize_bad_words(
                params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False)
            )
        bad = next((t for w in params.bad_words_token_ids or () for t in w if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab})")

    def _check_prompt(self, prompt_token_ids: Iterable[int]) -> list[int]:
        try:
            ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise ValueError("prompt_token_ids must be a list of integers") from None
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        check_prompt_fits(len(ids), self.max_model_len)
        return ids

    def _new_seq(
        self,
        group: _Group,
        index: int,
        tokens: list[int],
        priority: int,
        arrival: float,
        parent_id: str | None = None,
    ) -> Request:
        sp = group.params.child(index) if group.params.n > 1 else group.params
        req_id = group.request_id if index == 0 else f"{group.request_id}#{index}"
        req = Request(
            req_id=req_id,
            prompt_token_ids=group.prompt_token_ids,
            sampling=sp,
            root_key=root_key(self._key_fingerprint(group.lora), group.tenancy.cache_salt),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=priority,
            arrival_time=arrival,
            parent_id=parent_id,
            sample_index=index,
            all_token_ids=list(tokens),
            tenancy=group.tenancy,
            lora=group.lora,
            lora_request=group.lora_request,
        )
        if sp.seed is not None:
            self._generators[req_id] = torch.Generator(device="cpu").manual_seed(sp.seed)
        group.seqs.append(req)
        group.texts.append("")
        group.decoded.append(False)
        group.detoks.append(
            IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
            if (sp.stop or group.stream_text) and self.tokenizer is not None
            else None
        )
        group.logprobs.append([])
        group.matchers.append(None)
        group.cum_logprobs.append(0.0)
        group.finish.append(None)
        group.stop_reasons.append(None)
        self._seq_group[req_id] = group
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self._groups.get(request_id)
        if group is None:
            return None
        for i, req in enumerate(group.seqs):
            if self.scheduler.abort_request(req.req_id) is not None or group.finish[i] is None:
                group.finish[i] = group.finish[i] or "abort"
        return self._finish_group(group)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        if self.drift is not None and self.drift.num_pending:
            self.drift.run_pending(max_items=1)  # a request finished earlier: its outputs are out
        st = self.step_stats
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            self.kv.end_step()
            st.schedule_s += t1 - t0
            self._idle_wait()
            return []
        if self.tiers is not None:
            self._store_blocks()  # evicted (write-back) blocks, before anything overwrites them
            self._write_loads(out)
        if self.team is not None:
            self.team.before_step(out.num_batched_tokens)
        t1 = time.perf_counter()
        masks = self._grammar_masks(out)  # on a helper thread while the forward pass runs
        prompt_rows, targets = self._prompt_rows(out)
        if prompt_rows:
            logits, row_logits = self.runner.execute_rows(out, prompt_rows)
            assert row_logits is not None, "the runner returned no logits for the prompt rows"
            self._record_prompt_logprobs(row_logits, targets)
        else:
            logits = self.runner.execute(out)
        t2 = time.perf_counter()
        if self.tiers is not None:
            self._observe_prefill(out, t2 - t1)
        rows, row_keys, forks = self._sample_rows(out, masks.result() if masks is not None else {})
        samples = sample(logits, rows) if rows else []
        t3 = time.perf_counter()
        by_key = dict(zip(row_keys, samples))
        if self.drift is not None:
            self._record_drift(out, logits)
        finished = self.scheduler.update_from_output(out, {key: s.token_id for key, s in by_key.items()})
        moved = self._process(out, samples, by_key, forks, finished)
        if self.tiers is not None:
            self._store_blocks()  # blocks just computed (write-through), before they can go
        t4 = time.perf_counter()
        st.num_steps += 1
        st.schedule_s += t1 - t0
        st.execute_s += t2 - t1
        st.sample_s += t3 - t2
        st.update_s += t4 - t3
        st.num_batched_tokens += out.num_batched_tokens
        st.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, out.num_batched_tokens)] += 1
        if self.drift is not None and not self._groups:
            self.drift.run_pending()  # going idle: no later step would pick these up
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step; the publisher thread encodes and sends it
        return moved

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            from kvtier.structured import GrammarCompiler

            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this engine has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _grammar_masks(self, out: SchedulerOutput) -> Future | None:
        """The allowed-token masks of the step's sampled sequences under a grammar, computed on
        a helper thread (llguidance lets go of the GIL) while the forward pass runs. A grammar
        in error (its mask all False) leaves its row unmasked: its token is refused in _record."""
        jobs = []
        for seq in out.seqs:
            if not seq.sample:
                continue
            group = self._seq_group.get(seq.req_id)
            if group is None or not any(m is not None for m in group.matchers):
                continue
            req = self.scheduler.requests[seq.req_id]
            matcher = group.matchers[req.sample_index]
            if matcher is not None:
                jobs.append((seq.req_id, matcher))
        if not jobs:
            return None
        if self._mask_pool is None:
            from kvtier import threads

            # off the compute CPUs (it would inherit the engine thread's pin and take its core)
            self._mask_pool = ThreadPoolExecutor(
                1, thread_name_prefix="kvtier-grammar", initializer=threads.on_helper_thread
            )
        from kvtier.model.sampler import mask_bias
        from kvtier.structured import allowed_masks

        def masks() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            rows = allowed_masks([m for _, m in jobs])
            # a grammar in error allows nothing: sample that row unmasked rather than from an
            # all-masked row (NaN under -inf); _record then ends it with finish_reason "error"
            rows[~rows.any(dim=1)] = True
            bias = mask_bias(rows)  # the sampler adds it: cheaper than masked_fill on the CPU
            return {rid: (rows[i], bias[i]) for i, (rid, _) in enumerate(jobs)}

        return self._mask_pool.submit(masks)

    def _prompt_rows(self, out: SchedulerOutput) -> tuple[list[int], list[tuple[_Group, int]]]:
        """The step's token rows whose logits score a prompt token of a request that asked for
        prompt logprobs: (rows, (group, the prompt position each row predicts))."""
        rows: list[int] = []
        targets: list[tuple[_Group, int]] = []
        offset = 0
        for seq in out.seqs:
            group = self._seq_group.get(seq.req_id)
            if group is not None and group.prompt_logprobs is not None and seq.req_id == group.request_id:
                end = min(seq.start_pos + seq.num_tokens, len(group.prompt_token_ids) - 1)
                for p in range(seq.start_pos, end):
                    rows.append(offset + p - seq.start_pos)
                    targets.append((group, p + 1))
            offset += seq.num_tokens
        return rows, targets

    def _record_prompt_logprobs(self, logits: torch.Tensor, targets: list[tuple[_Group, int]]) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1)
        for i, (group, pos) in enumerate(targets):
            entry = top_logprobs(lp[i], group.prompt_token_ids[pos], group.params.prompt_logprobs)
            assert group.prompt_logprobs is not None  # _prompt_rows picks only such groups
            group.prompt_logprobs[pos] = self._decoded(entry)

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fills each Logprob's decoded_token (one token's text, cached per id)."""
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                text = self._token_texts.get(tid)
                if text is None:
                    text = self._token_texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
                lp.decoded_token = text
        return entry

    def _record_drift(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        """Served logits of tracked requests; row r of `logits` is the r-th sampled seq."""
        drift = self.drift
        assert drift is not None
        r = 0
        for seq in out.seqs:
            if not seq.sample:
                continue
            if drift.is_tracked(seq.req_id):
                req = self.scheduler.requests[seq.req_id]
                drift.record(seq.req_id, len(req.output_token_ids), logits[r])
            r += 1

    # ------------------------------------------------------------------ tiers
    def _store_blocks(self) -> None:
        """Read the blocks the cache manager queued for the tiers and hand them down (before
        anything overwrites them)."""
        todo = self.kv.take_blocks_to_store()
        if todo:
            assert self.tiers is not None, "blocks to store without tiers"
            self.tiers.store(
                [t.key for t in todo],
                self.runner.read_block_list([t.block_id for t in todo]),
                [t.owner for t in todo],
            )

    def _write_loads(self, out: SchedulerOutput) -> None:
        """Copy restored KV into its device blocks; the copy time counts as restore time."""
        if not out.block_loads:
            return
        assert self.tiers is not None, "block loads without tiers"
        t0 = time.perf_counter()
        self.runner.write_block_list([load.block_id for load in out.block_loads], [load.kv for load in out.block_loads])
        per_req: dict[str, int] = {}
        for load in out.block_loads:
            per_req[load.req_id] = per_req.get(load.req_id, 0) + 1
        dt = time.perf_counter() - t0
        total = len(out.block_loads)
        if dt > 0:
            self.tiers.cost.h2d.update(total * self.runner.kv_bytes_per_block / dt)
        for req_id, n in per_req.items():
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                req.restore_s += dt * n / total

    def _observe_prefill(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the step's forward time to the cost model's prefill estimate."""
        assert self.tiers is not None
        prefill = self.tiers.cost.prefill
        x0 = x1 = 0.0
        for seq in out.seqs:
            a, b = prefill.features(len(seq.token_ids), seq.start_pos)
            x0 += a
            x1 += b
        if x0:
            prefill.observe((x0, x1), seconds)

    def _idle_wait(self) -> None:
        """Nothing to compute: wait briefly for background I/O instead of spinning."""
        pending = self.scheduler.pending_futures()
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(pending, timeout=0.01, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ tenants (EngineTenants)
    def abort_tenant(self, tenant: str | None) -> list[RequestOutput]:
        """Abort every unfinished request of `tenant` (waiting, loading or running); their
        final outputs (finish_reason "abort"). The first step of a purge."""
        return self._abort_groups([rid for rid, g in self._groups.items() if g.tenancy.tenant == tenant])

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request; their final outputs."""
        return self._abort_groups(list(self._groups))

    def _abort_groups(self, request_ids: list[str]) -> list[RequestOutput]:
        outs = [self.abort_request(rid) for rid in request_ids]
        return [o for o in outs if o is not None]

    def reset_prefix_cache(self, store_evicted: bool = True) -> int:
        """Evict every cached device block no request holds; how many. `store_evicted` False:
        write-back blocks are dropped, not sent down (the tiers are being reset too:
        kvtier.engine.reset)."""
        n = self.kv.pool.evict_all()
        if self.tiers is not None and store_evicted:
            self._store_blocks()  # write-back: what the device drops goes down first
        elif self.tiers is not None:
            self.kv.take_blocks_to_store()
        if self.kv_events is not None:
            self.kv_events.cleared_if_empty()
            self.kv_events.flush()
        return n

    def _start_kv_events(self, config: EngineConfig) -> KVEventRecorder | None:
        """The recorder listening to the device pool's prefix index and every tier, with its
        ZMQ publisher (KVEventsConfig: vLLM's fields and meaning)."""
        ev = config.kv_events
        if ev is None or not ev.enable_kv_cache_events:
            return None
        recorder = KVEventRecorder(self.kv.block_size, None)
        if ev.enabled:  # publisher "null": recorded and dropped, as vLLM's NullEventPublisher
            recorder.publisher = ZmqEventPublisher(ev, flush=recorder.flush)
        self.kv.index.listener = recorder
        if self.tiers is not None:
            for name, tier in self.tiers.tiers.items():
                tier.watch = recorder.tier_watch(name)
        self.tenants.events = recorder
        return recorder

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.team is not None:
            self.team.stop_sampler()
        if self.tiers is not None:
            self.tiers.close()
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)

    def _sample_rows(
        self, out: SchedulerOutput, masks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[list[SampleRow], list[str], dict[str, list[int]]]:
        """One row per sampled sequence; a new n > 1 group gets n rows from its one logits row
        (and, under a grammar, copies of the parent's grammar state before its first token).
        Returns (rows, the key of each row: the req_id or, for a fork's extra rows,
        "<req_id>#fork<i>", and per forking req_id the indices of its extra rows)."""
        masks = masks or {}
        rows: list[SampleRow] = []
        row_keys: list[str] = []
        forks: dict[str, list[int]] = {}
        r = 0
        for seq in out.seqs:
            if not seq.sample:
                continue
            req = self.scheduler.requests[seq.req_id]
            allowed, bias = masks.get(req.req_id, (None, None))
            rows.append(
                SampleRow(
                    r,
                    req.sampling,
                    self._generators.get(req.req_id, self._default_gen),
                    req.prompt_token_ids,
                    req.output_token_ids,
                    req.eos_token_ids,
                    allowed,
                    bias,
                )
            )
            row_keys.append(req.req_id)
            group = self._seq_group[req.req_id]
            if group.params.n > 1 and req.sample_index == 0 and not req.output_token_ids and len(group.seqs) == 1:
                forks[req.req_id] = []
                parent_matcher = group.matchers[0]
                if parent_matcher is not None:
                    self._fork_matchers[req.req_id] = [parent_matcher.copy() for _ in range(1, group.params.n)]
                for i in range(1, group.params.n):
                    sp = group.params.child(i)
                    gen = (
                        torch.Generator(device="cpu").manual_seed(sp.seed) if sp.seed is not None else self._default_gen
                    )
                    forks[req.req_id].append(len(rows))
                    rows.append(SampleRow(r, sp, gen, req.prompt_token_ids, [], req.eos_token_ids, allowed, bias))
                    row_keys.append(f"{req.req_id}#fork{i}")
            r += 1
        return rows, row_keys, forks

    def _process(
        self,
        out: SchedulerOutput,
        samples: list[Sample],
        by_key: dict[str, Sample],
        forks: dict[str, list[int]],
        finished: list[Request],
    ) -> list[RequestOutput]:
        """Record the step's samples (`by_key`: row key -> sample, see `_sample_rows`), start
        fork children, note finished requests; the outputs of the groups that moved."""
        moved: dict[str, _Group] = {}
        for req_id in out.preempted_req_ids:
            group = self._seq_group.get(req_id)
            if group is not None:
                group.num_preemptions += 1
        for seq in out.seqs:
            if not seq.sample or seq.req_id not in by_key:
                continue
            group = self._seq_group[seq.req_id]
            req = next(r for r in group.seqs if r.req_id == seq.req_id)
            self._record(group, req, by_key[seq.req_id])
            moved[group.request_id] = group
            if seq.req_id in forks:
                self._fork_children(group, req, [samples[i] for i in forks[seq.req_id]])
        for req in finished:
            group = self._seq_group[req.req_id]
            i = req.sample_index
            if group.finish[i] is None:
                group.finish[i] = req.status.value
                group.stop_reasons[i] = req.stop_reason
            moved[group.request_id] = group
        outputs = []
        for group in moved.values():
            outputs.append(self._finish_group(group) if group.finished else self._output(group))
        return outputs

    def _fork_children(self, group: _Group, parent: Request, first: list[Sample]) -> None:
        for i, s in enumerate(first, start=1):
            child = self._new_seq(
                group,
                i,
                list(parent.prompt_token_ids),
                parent.priority,
                group.arrival_time,
                parent_id=parent.req_id,
            )
            copies = self._fork_matchers.get(parent.req_id)
            if copies:
                group.matchers[i] = copies.pop(0)
                if not copies:
                    del self._fork_matchers[parent.req_id]
            child.first_token_time = parent.first_token_time
            child.append_output(s.token_id)
            self.scheduler.add_forked(child, parent)
            self._record(group, child, s)
            status = child.check_stop()
            if status is not None:
                self.scheduler.finish_request(child.req_id, status)
                group.finish[i] = status.value
                group.stop_reasons[i] = child.stop_reason

    def _record(self, group: _Group, req: Request, s: Sample) -> None:
        i = req.sample_index
        matcher = group.matchers[i]
        if matcher is not None and group.finish[i] is None and (not matcher.consume(s.token_id) or matcher.done):
            # complete (nothing may follow but EOS): "stop". Or the grammar failed: llguidance
            # gave up on it (too complex to follow) or, with its mask all False once in error,
            # the sampled token was refused: "error", the reason in stop_reason, never "stop"
            error = matcher.error
            if error is None and not matcher.done:
                error = f"token {s.token_id} was refused"
            if error is not None:
                logger.warning("request %s: structured output failed: %s", req.req_id, error)
                group.finish[i] = RequestStatus.FINISHED_ERROR.value
                group.stop_reasons[i] = f"structured_outputs: the grammar failed while decoding: {error}"
                self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_ERROR)
            else:
                group.finish[i] = "stop"
                self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_STOPPED)
        st = self.step_stats
        st.num_generation_tokens += 1
        if i == 0 and len(req.output_token_ids) == 1:
            st.num_prompt_tokens += len(group.prompt_token_ids)
            reads = req.sampling.prompt_logprobs is None  # prompt_logprobs: nothing is reused
            st.prompt_cache.count(
                len(group.prompt_token_ids),
                req.cached_by_tier or {"device": req.num_cached_tokens or 0},
                looked_up=reads and self.config.cache.enable_prefix_caching,
                tiers_asked=reads and self.tiers is not None,
            )
        if s.logprob is not None:
            group.logprobs[i].append(self._decoded(s.top_logprobs or {}))
            group.cum_logprobs[i] += s.logprob
        sp = req.sampling
        detok = group.detoks[i]
        if detok is not None and group.finish[i] is None:
            # one token's worth of decoding per step (kvtier.engine.detokenizer), not the whole output
            detok.push(req.output_token_ids[len(detok.token_ids) :])
            text = detok.text
            stops = sp.stop
            assert isinstance(stops, list)  # SamplingParams.__post_init__ makes it a list
            cut = (
                _find_stop(text, stops, tail=len(text) - len(group.texts[i]) + max(map(len, stops))) if stops else None
            )
            group.texts[i] = text
            if cut is not None:
                pos, stop = cut
                group.texts[i] = text[: pos + len(stop)] if sp.include_stop_str_in_output else text[:pos]
                group.finish[i] = "stop"
                group.stop_reasons[i] = stop
                self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_STOPPED)

    # ------------------------------------------------------------------ outputs
    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, req in enumerate(group.seqs):
            if group.finish[i] is not None and not group.decoded[i]:
                # the final text, decoded whole once when the sequence ends (the authority: a
                # streamed text is checked against it, StreamText.finish); a stop string already
                # cut texts[i]
                group.decoded[i] = True
                if self.tokenizer is not None and not isinstance(group.stop_reasons[i], str):
                    ids = req.output_token_ids
                    if (
                        group.finish[i] == "stop"
                        and not req.sampling.include_stop_str_in_output
                        and ids
                        and (ids[-1] in req.eos_token_ids or ids[-1] in (req.sampling.stop_token_ids or ()))
                    ):
                        ids = ids[:-1]  # an EOS or stop token ended it: its text is not output
                    group.texts[i] = self.tokenizer.decode(ids, req.sampling.skip_special_tokens)
            text = group.texts[i]
            if group.finish[i] is None and group.detoks[i] is not None:
                # running: only the text no stop string can still take back (the stop string
                # may span tokens still to come)
                stops = req.sampling.stop
                hold = max(map(len, stops)) - 1 if stops else 0
                if hold:
                    text = text[: max(len(text) - hold, 0)]
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(req.output_token_ids),
                    finish_reason=group.finish[i],
                    stop_reason=group.stop_reasons[i],
                    logprobs=group.logprobs[i] if group.params.logprobs is not None else None,
                    cumulative_logprob=group.cum_logprobs[i] if group.params.logprobs is not None else None,
                )
            )
        head = group.seqs[0]
        cached = head.num_cached_tokens or 0
        by_tier = {"device": 0, **head.cached_by_tier} if head.cached_by_tier else {"device": cached}
        metrics = RequestMetrics(
            group.arrival_time,
            head.first_scheduled_time,
            head.first_token_time,
            max((r.finished_time or 0.0) for r in group.seqs) if group.finished else None,
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=metrics,
            num_cached_tokens=cached,
            cached_tokens_by_tier=by_tier,
            num_recomputed_tokens=len(group.prompt_token_ids) - cached,
            num_preemptions=group.num_preemptions,
            restore_decision=head.restore_decision,
            restore_s=head.restore_s,
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            lora_request=group.lora_request,
        )

    def _finish_group(self, group: _Group) -> RequestOutput:
        out = self._output(group)
        if self.drift is not None:
            self.drift.finish(group.request_id, group.seqs[0].output_token_ids)
        self._groups.pop(group.request_id, None)
        for req in group.seqs:
            self._seq_group.pop(req.req_id, None)
            self._generators.pop(req.req_id, None)
        return out

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = {r.req_id for g in self._groups.values() for r in g.seqs if not r.status.finished}
        assert live == set(self.scheduler.requests), "engine and scheduler disagree on live requests"


def _find_stop(text: str, stops: list[str], tail: int) -> tuple[int, str] | None:
    """Earliest stop string in the last `tail` characters of text."""
    start = max(0, len(text) - tail)
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
