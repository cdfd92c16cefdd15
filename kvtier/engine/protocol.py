"""The engine boundary's messages: what a front-end (kvtier.engine.client) sends the engine
loop (kvtier.engine.loop) and what comes back, as msgspec Structs with named fields.

    front-end -> engine     AddBatch (AddRequest, ...), Abort, AdminCall (an AdminOp)
    engine -> front-end     Outputs (OutputDelta, ...), Reply, Fail; Ready or Fatal at start

The in-process transport hands these objects over as they are (no encoding); the process
transport encodes them with msgspec msgpack (`encode`, `decode_to_engine`,
`decode_from_engine`). Every message is array-like and tagged, so a union decodes in one pass.
SamplingParams (a dataclass) travels as its fields and is rebuilt, and so validated again,
by its own constructor when decoded.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from kvtier.engine.admin import EngineStats
from kvtier.identity import ANONYMOUS, Tenancy
from kvtier.lora import LoRARequest
from kvtier.sampling_params import SamplingParams

LogprobEntry = dict[int, tuple[float, int | None]]
"""One position's log-probabilities: token id -> (logprob, rank)."""


class AddRequest(msgspec.Struct, array_like=True, tag="add_request"):
    """One engine request (one prompt; `params.n` samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenancy: Tenancy = ANONYMOUS
    """Who the request belongs to: tenant, effective cache salt, owner id (kvtier.identity),
    built once by the server; one field, so the two never travel apart."""
    priority: int = 0
    prompt: str | None = None
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    """When the server took the request (time.monotonic, one clock for every process on the
    machine): TTFT and queue time count from here, including a wait for the engine's current
    step, as vLLM counts from its API server's arrival."""
    stream: bool = False
    """The server streams the text: the engine detokenizes it as it grows and ships the new text
    in each delta (SeqDelta.text_delta), so it is decoded once, in the engine."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter to run the request with (kvtier.lora); None: the base model."""


class AddBatch(msgspec.Struct, array_like=True, tag="add"):
    """Requests to add, all or none; answered by a Reply (error: none was added)."""

    call_id: int
    requests: list[AddRequest]


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    """Abort a request (an unknown id is ignored); no reply."""

    request_id: str


class AdminOp(enum.Enum):
    PURGE = "purge"
    """Abort the tenant's (every tenant's) requests, purge its KV; reply: the counts."""
    USAGE = "usage"
    """The tenant's cached KV per tier; reply: {tier: ...}."""
    SWEEP = "sweep"
    """TTL sweep and a retry of pending purges; reply: None."""
    CHECK_KEYS = "check_keys"
    """The periodic fleet key check, revocations applied; reply: None."""
    CHECK_INTEGRITY = "check_integrity"
    """The engine's invariant checks once idle; reply: a report (AssertionError if one fails)."""
    STATS = "stats"
    """The engine's counters for the metrics scrape; reply: an EngineStats."""
    STOP = "stop"
    """Fail what is in flight and end the loop; reply: None."""
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    """Empty the prefix cache in the tiers named by `tiers` (blocks running requests hold stay);
    reply: what each tier cleared (kvtier.engine.reset)."""


class AdminCall(msgspec.Struct, array_like=True, tag="call"):
    call_id: int
    op: AdminOp
    tenant: str | None = None
    every_tenant: bool = False
    tiers: list[str] | None = None
    """RESET_PREFIX_CACHE: the tiers to clear ("device", "host", "disk", "remote")."""


class SeqDelta(msgspec.Struct, array_like=True):
    """What is new in one sequence of a request since the last delta."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry | None] | None
    finish_reason: str | None
    stop_reason: int | str | None
    text: str | None
    """The final text, once the sequence finished (None before)."""
    cumulative_logprob: float | None
    text_delta: str = ""
    """Text new since the last delta, while the sequence runs: only for a request added with
    `stream` (or with stop strings); final with the last token's step (kvtier.engine.detokenizer:
    held back while a stop string or a multi-byte character may still be completing)."""


class OutputDelta(msgspec.Struct, array_like=True):
    """One request's progress in one step: new tokens per sequence and its current counters."""

    request_id: str
    finished: bool
    seqs: list[SeqDelta]
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_recomputed_tokens: int
    num_preemptions: int
    restore_decision: str | None
    restore_s: float
    prompt_logprobs: list[LogprobEntry | None] | None
    """Sent with the first delta that has tokens and with the finished one (else None)."""


class Outputs(msgspec.Struct, array_like=True, tag="out"):
    """One step's deltas (one message per step)."""

    deltas: list[OutputDelta]


class ErrorInfo(msgspec.Struct, array_like=True):
    """An error handed back: its type's name and its text. `dead`: the engine is gone."""

    kind: str
    message: str
    dead: bool = False


class Reply(msgspec.Struct, array_like=True, tag="reply"):
    """The answer to an AddBatch or an AdminCall: `value`, or `error`."""

    call_id: int
    value: Any = None
    error: ErrorInfo | None = None


class Fail(msgspec.Struct, array_like=True, tag="fail"):
    """These requests were aborted by the engine: a failed step, the engine stopping (`dead`)."""

    request_ids: list[str]
    message: str
    dead: bool = False


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    """The engine process loaded its model."""

    max_model_len: int
    has_tiers: bool
    key_check_interval_s: float | None
    threads: str | None
    pid: int


class Fatal(msgspec.Struct, array_like=True, tag="fatal"):
    """The engine process could not start. `bad_config`: a setting's fault (one line for the CLI)."""

    message: str
    bad_config: bool = False


class Undecodable(msgspec.Struct):
    """A message to the engine that did not decode or validate (a bug or two versions of kvtier
    side by side: the server validated the request before it sent it). Never on the wire: the
    engine loop answers its call, when one can be read from it, with the error and goes on."""

    call_id: int | None
    message: str


ToEngine = AddBatch | Abort | AdminCall
FromEngine = Outputs | Reply | Fail | Ready | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(raw: bytes) -> ToEngine:
    return _to_engine.decode(raw)


def decode_to_engine_or_error(raw: bytes) -> ToEngine | Undecodable:
    """`decode_to_engine`, with a message that fails to decode as an Undecodable that keeps its
    call id (AddBatch and AdminCall carry one second, after their tag) when that much reads."""
    try:
        return _to_engine.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError) as e:  # ValidationError is a DecodeError
        call_id = None
        try:
            head = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            head = None
        if isinstance(head, list) and len(head) > 1 and head[0] in ("add", "call") and type(head[1]) is int:
            call_id = head[1]
        return Undecodable(call_id, f"a message to the engine did not decode: {e}")


def decode_from_engine(raw: bytes) -> FromEngine:
    return _from_engine.decode(raw)


def stats_value(value: Any) -> EngineStats:
    """A STATS reply's value as an EngineStats (a dict once it crossed the process boundary)."""
    return value if isinstance(value, EngineStats) else msgspec.convert(value, EngineStats)


def plain_logprobs(entries: list[Any]) -> list[LogprobEntry | None]:
    """Logprob entries (token id -> Logprob) as the protocol carries them: id -> (logprob, rank)."""
    return [None if d is None else {k: (float(v), getattr(v, "rank", None)) for k, v in d.items()} for d in entries]


def error_info(e: BaseException, dead: bool = False) -> ErrorInfo:
    return ErrorInfo(type(e).__name__, str(e), dead)
