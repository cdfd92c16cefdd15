"""A request's lifecycle state, as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.identity import ANONYMOUS, Tenancy
from kvtier.kvcache.keys import BlockKey
from kvtier.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvtier.lora import LoRARequest
    from kvtier.model.lora import LoRAWeights


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    LOADING = "loading"
    """Holding blocks while a tier below restores part of its prefix."""
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """Ended by a failure of its own (a structured-outputs grammar that failed while decoding)."""

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(slots=True, eq=False)
class Request:
    """Token ranges::

    all_token_ids:  [ prompt ............ ][ output ...... ]
                    |<-- num_computed_tokens -->|            KV in the pool
                                                |<- todo ->| computed by coming steps
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    root_key: BlockKey
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0
    tenancy: Tenancy = ANONYMOUS
    """Who the request belongs to (kvtier.identity): its KV's owner (tiers fence and record
    it under the precomputed owner id, and encrypt it with the tenant's key); its root key was
    made from the tenancy's cache salt."""
    parent_id: str | None = None
    """Set on the n-1 extra samples of an n > 1 request; they start by forking the parent."""
    sample_index: int = 0
    lora: LoRAWeights | None = None
    """The LoRA adapter it runs (kvtier.model.lora; None: the base model); its root key was made
    with the adapter's key folded in (kvtier.lora.lora_fingerprint)."""
    lora_request: LoRARequest | None = None
    """The request that named `lora`: its id and name are what the KV events of the blocks this
    request computes carry (as vLLM's do)."""

    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int | None = None
    """Prompt tokens not recomputed at first admission."""
    num_preemptions: int = 0
    waited_steps: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    """Prompt tokens not recomputed, by where their KV came from (first admission)."""
    restore_decision: str | None = None
    tier_queried: bool = False
    """The tiers below were looked up for this admission (a retry does not count again)."""
    restore_s: float = 0.0
    """Seconds its tier loads took (queue wait included)."""
    tier_keys: list[bytes] | None = None
    """Chained keys of the full blocks of all_token_ids[:-1] (tier lookups, in-flight prefix sharing)."""
    remote_lookup: Any = None
    """Future: how many leading tier_keys the remote tier holds."""
    load_future: Any = None
    restore_keys: list[bytes] | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Stop conditions that need no text (stop strings are checked by the detokenizer)."""
        sp = self.sampling
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
