"""The engine boundary's messages (kvtier.engine.protocol): every Struct survives the process
transport's msgpack encoding unchanged, SamplingParams exactly (and is validated again when
decoded), and the delta of a real output rebuilds that output on the client side."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvtier.engine.admin import DriftCounters, EngineStats, TierCounters
from kvtier.engine.client import RequestStream as Stream
from kvtier.engine.client import _Live
from kvtier.engine.loop import to_delta
from kvtier.engine.protocol import (
    Abort,
    AddBatch,
    AddRequest,
    AdminCall,
    AdminOp,
    ErrorInfo,
    Fail,
    Fatal,
    OutputDelta,
    Outputs,
    Ready,
    Reply,
    SeqDelta,
    decode_from_engine,
    decode_to_engine,
    encode,
    stats_value,
)
from kvtier.identity import ANONYMOUS, Tenancy
from kvtier.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.tiers.owners import DEFAULT_OWNER, owner_id

FULL_PARAMS = SamplingParams(
    n=3,
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=5,
    min_p=0.01,
    seed=-(1 << 40),
    stop=["\n\n", "END"],
    stop_token_ids=[2, 3],
    ignore_eos=True,
    logprobs=4,
    include_stop_str_in_output=True,
    min_tokens=1,
    skip_special_tokens=False,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    logit_bias={7: -3.5, 9: 2.0},
    allowed_token_ids=[4, 7, 9],
    bad_words=["bad"],
    truncate_prompt_tokens=-1,
    prompt_logprobs=2,
    structured_outputs={"choice": ["yes", "no"]},
    bad_words_token_ids=[[1, 2], [3]],
)


def test_sampling_params_round_trip_exactly() -> None:
    for params in (SamplingParams(), FULL_PARAMS, SamplingParams(stop="x", structured_outputs={"json": {"a": [1]}})):
        msg = AddBatch(1, [AddRequest("r", [1, 2], params, Tenancy.of("tenant", "salt"), 2, "text", 12.5)])
        back = decode_to_engine(encode(msg))
        assert back == msg
        assert back.requests[0].params == params and type(back.requests[0].params) is SamplingParams


def test_the_tenancy_crosses_as_one_field() -> None:
    """A request's tenancy (tenant, effective salt, owner id) survives the encoding whole; its
    owner id is the one the tiers store under (owner_id of the name, so stored data stays
    readable); a request without one is anonymous."""
    for tenancy in (Tenancy.of("acme", "acme-salt\x00project-x"), Tenancy.of("default"), ANONYMOUS):
        back = decode_to_engine(encode(AddBatch(1, [AddRequest("r", [1], SamplingParams(), tenancy)])))
        assert isinstance(back, AddBatch)
        got = back.requests[0].tenancy
        assert got == tenancy and isinstance(got, Tenancy)
        assert got.owner_id == owner_id(tenancy.tenant)
    assert Tenancy.of("acme").owner_id == hashlib.sha256(b"acme").hexdigest()[:32]
    assert Tenancy(None, None, owner_id(DEFAULT_OWNER)) == ANONYMOUS
    assert AddRequest("r", [1], SamplingParams()).tenancy == ANONYMOUS
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        Tenancy.of("acme", 3)  # type: ignore[arg-type]
    raw = encode(AddBatch(1, [AddRequest("r", [1], SamplingParams(), Tenancy("a", None, 7))]))  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(raw)


def test_a_request_decoded_is_validated_again() -> None:
    raw = encode(AddBatch(1, [AddRequest("r", [1], SamplingParams())])).replace(b"\xa1n\x01", b"\xa1n\x00")
    with pytest.raises(msgspec.ValidationError, match="n must be an integer"):
        decode_to_engine(raw)


def test_every_message_round_trips() -> None:
    to_engine = [
        AddBatch(0, [AddRequest("a", [1], SamplingParams(max_tokens=2))]),
        Abort("a"),
        *(AdminCall(i, op, "t", i % 2 == 0) for i, op in enumerate(AdminOp)),
    ]
    for msg in to_engine:
        assert decode_to_engine(encode(msg)) == msg
    delta = OutputDelta(
        "a",
        True,
        [
            SeqDelta(0, [5, 6], [{5: (-0.5, 1)}, None], "stop", "END", "hi", -1.25),
            SeqDelta(1, [], None, None, 7, None, None, "new text"),
        ],
        4,
        {"device": 2, "host": 2},
        1.0,
        1.5,
        2.0,
        3.0,
        1,
        2,
        "restore",
        0.25,
        [None, {3: (-1.0, 2), 4: (-0.1, None)}],
    )
    from_engine = [
        Outputs([delta]),
        Reply(3, {"device": {"blocks": 1}}),
        Reply(4, None, ErrorInfo("ValueError", "bad", False)),
        Reply(5, error=ErrorInfo("EngineDeadError", "gone", True)),
        Fail(["a", "b"], "the engine failed", False),
        Fail([], "shutting down", True),
        Ready(64, True, 1.0, "threads", 123),
        Fatal("ValueError: no", True),
    ]
    for msg in from_engine:
        assert decode_from_engine(encode(msg)) == msg


def test_engine_stats_cross_as_a_reply() -> None:
    stats = EngineStats(
        block_size=4,
        num_blocks=32,
        kv_usage=0.25,
        prefix_queries_tokens=40,
        prefix_hits_tokens=8,
        num_prompt_tokens=40,
        num_generation_tokens=9,
        iteration_token_buckets=[1, 8],
        iteration_token_counts=[1, 2, 3],
        num_batched_tokens=49,
        cache_info={"block_size": "4"},
        tier_usage={"host": (100, 1000), "disk": (5, None)},
        tiers={"host": TierCounters(3, 1, 64, 128, 0, {"io": 1})},
        num_preemptions=1,
        restore_decisions={"restore": 2},
        restore_failures=0,
        num_running=1,
        num_waiting=2,
        num_loading=0,
        drift=DriftCounters(0.1, 0.5, 0.9, 2, 10, 0.3, [1e-3, 1.0], [1, 1, 0], 0.2),
    )
    reply = decode_from_engine(encode(Reply(9, stats)))
    assert isinstance(reply, Reply) and stats_value(reply.value) == stats
    assert stats_value(stats) is stats  # in process: no copy


def test_deltas_rebuild_the_output() -> None:
    """A request's outputs over three steps, sent as deltas, rebuilt on the client side."""
    spec = AddRequest("r", [1, 2], SamplingParams(n=2, logprobs=1), prompt="p")
    live = _Live(Stream("r"), spec)
    sent: list[tuple[int, int]] = []

    def output(k: int, finished: bool) -> RequestOutput:
        seqs = [
            CompletionOutput(
                i,
                "the text" if finished else "te"[:k] + "x" * (k - 2) * i,
                [10 * i + j for j in range(k)],
                logprobs=[{10 * i + j: Logprob(-0.5 * j, 1)} for j in range(k)],
                finish_reason="length" if finished else None,
                cumulative_logprob=-float(k),
            )
            for i in range(2)
        ]
        return RequestOutput(
            "r",
            "p",
            [1, 2],
            seqs,
            finished,
            RequestMetrics(1.0, 2.0, 3.0, 4.0 if finished else None),
            num_cached_tokens=1,
            cached_tokens_by_tier={"device": 1},
            prompt_logprobs=[None, {2: Logprob(-0.25, 1)}],
        )

    for k, finished in ((1, False), (3, False), (4, True)):
        want = output(k, finished)
        got = live.apply(decode_from_engine(encode(Outputs([to_delta(want, sent)]))).deltas[0])  # type: ignore[union-attr]
        if not finished and k > 1:
            want.prompt_logprobs = None  # sent with the first tokens and with the last delta
        assert got == want
        assert [lp.rank for c in got.outputs for d in c.logprobs or [] for lp in d.values()] == [1] * 2 * k
    assert sent == [(4, 2), (4, 3)]  # characters: what streamed (the final text replaces it)
