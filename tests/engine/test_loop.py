"""EngineLoop (kvtier.engine.loop) over both transports, with the real engine over the byte
model: the in-process one (Structs handed over as they are) and the ZMQ one (msgpack over
inproc sockets). The same behaviour is asserted over each: all-or-none adds, deltas that add
up to the offline engine's output, aborts, admin calls and the stop."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from engineutil import clean

from kvtier.engine.loop import EngineLoop, InProcessTransport
from kvtier.engine.protocol import (
    Abort,
    AddBatch,
    AddRequest,
    AdminCall,
    AdminOp,
    Fail,
    Outputs,
    Reply,
    decode_from_engine,
    encode,
    stats_value,
)
from kvtier.identity import Tenancy
from kvtier.sampling_params import SamplingParams

TIMEOUT_S = 60.0
"""Upper bound on one wait for a message: reached only when the loop is broken."""

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class InProcess:
    """The front-end's end of an InProcessTransport."""

    def __init__(self, core: Any) -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.transport = InProcessTransport(self.inbox.put)
        self.loop = EngineLoop(core, self.transport)

    def send(self, cmd: Any) -> None:
        self.transport.put(cmd)

    def recv(self) -> Any:
        return self.inbox.get(timeout=TIMEOUT_S)

    def close(self) -> None:
        pass


class Zmq:
    """The front-end's end of a ZmqTransport over inproc sockets (every message encoded)."""

    def __init__(self, core: Any) -> None:
        import zmq

        from kvtier.engine.process import ZmqTransport

        self.ctx = zmq.Context()
        name = f"inproc://loop-{id(self)}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(name + "-in")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(name + "-out")
        engine_pull = self.ctx.socket(zmq.PULL)
        engine_pull.connect(name + "-in")
        engine_push = self.ctx.socket(zmq.PUSH)
        engine_push.connect(name + "-out")
        self.engine_sockets = (engine_pull, engine_push)
        self.loop = EngineLoop(core, ZmqTransport(engine_pull, engine_push))

    def send(self, cmd: Any) -> None:
        self.push.send(encode(cmd))

    def recv(self) -> Any:
        assert self.pull.poll(int(TIMEOUT_S * 1000)), "no message from the engine loop"
        return decode_from_engine(self.pull.recv())

    def close(self) -> None:
        for s in (self.push, self.pull, *self.engine_sockets):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture(params=["in_process", "zmq"])
def end(request: pytest.FixtureRequest, llm: Any) -> Iterator[Any]:
    """A running EngineLoop over the shared engine, seen from its front-end's end; stopped after."""
    e = InProcess(llm.engine) if request.param == "in_process" else Zmq(llm.engine)
    thread = threading.Thread(target=e.loop.run, daemon=True)
    thread.start()
    try:
        yield e
    finally:
        if thread.is_alive():
            e.send(AdminCall(-1, AdminOp.STOP))
            thread.join(TIMEOUT_S)
        e.close()
    assert not thread.is_alive()
    clean(llm)


def reply(end: Any, call_id: int) -> Reply:
    """The Reply to `call_id` (outputs that come first are skipped)."""
    while True:
        msg = end.recv()
        if isinstance(msg, Reply) and msg.call_id == call_id:
            return msg


def tokens_until_finished(end: Any, rids: set[str]) -> dict[str, tuple[list[int], str | None]]:
    """Each request's token ids, from its deltas, and its finish reason."""
    got: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in rids}
    left = set(rids)
    while left:
        msg = end.recv()
        assert isinstance(msg, Outputs), msg
        for d in msg.deltas:
            (seq,) = d.seqs
            got[d.request_id][0].extend(seq.new_token_ids)
            got[d.request_id] = (got[d.request_id][0], seq.finish_reason)
            if d.finished:
                left.discard(d.request_id)
    return got


def test_requests_stream_as_deltas_that_add_up_to_the_offline_output(end: Any, llm: Any) -> None:
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}
    want = {rid: llm.generate([p], GREEDY)[0].outputs[0].token_ids for rid, p in prompts.items()}
    end.send(AddBatch(1, [AddRequest(rid, p, GREEDY) for rid, p in prompts.items()]))
    assert reply(end, 1).error is None
    got = tokens_until_finished(end, set(prompts))
    assert got == {rid: (want[rid], "length") for rid in prompts}


def test_a_bad_request_adds_none_of_its_batch(end: Any, llm: Any) -> None:
    end.send(AddBatch(1, [AddRequest("ok", [5, 6], GREEDY), AddRequest("bad", [], GREEDY)]))
    r = reply(end, 1)
    assert r.error is not None and r.error.kind == "ValueError" and "empty" in r.error.message
    end.send(AdminCall(2, AdminOp.CHECK_INTEGRITY))
    report = reply(end, 2).value
    assert report["ok"] and report["num_unfinished"] == 0


def test_a_message_that_does_not_decode_is_answered_and_the_loop_goes_on(llm: Any) -> None:
    """Over ZMQ: a batch whose sampling parameters fail the engine's validation (n = 0: the
    server would have refused it) gets an error reply; the loop keeps serving."""
    e = Zmq(llm.engine)
    thread = threading.Thread(target=e.loop.run, daemon=True)
    thread.start()
    try:
        raw = encode(AddBatch(7, [AddRequest("r", [5, 6], GREEDY)]))
        e.push.send(raw.replace(b"\xa1n\x01", b"\xa1n\x00"))
        e.push.send(b"\xc1 not msgpack")  # no call id to answer: logged
        r = reply(e, 7)
        assert r.error is not None and r.error.kind == "ValueError" and "did not decode" in r.error.message
        e.send(AddBatch(8, [AddRequest("ok", [5, 6], GREEDY)]))
        assert reply(e, 8).error is None
        assert tokens_until_finished(e, {"ok"})["ok"][1] == "length"
    finally:
        e.send(AdminCall(-1, AdminOp.STOP))
        thread.join(TIMEOUT_S)
        e.close()
    assert not thread.is_alive()
    clean(llm)


def test_an_abort_ends_the_request_with_its_final_delta(end: Any) -> None:
    """(The reply to the add comes first, then the final delta.)"""
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    end.send(AddBatch(1, [AddRequest("a", [5, 6, 7], long)]))
    end.send(Abort("a"))  # long before its 200 tokens
    end.send(Abort("nobody"))  # ignored
    assert reply(end, 1).error is None
    while True:
        msg = end.recv()
        assert isinstance(msg, Outputs)
        done = [d for d in msg.deltas if d.finished]
        if done:
            assert done[0].seqs[0].finish_reason == "abort"
            break


def test_admin_calls_answer_through_the_loop(end: Any) -> None:
    end.send(AdminCall(1, AdminOp.USAGE, tenant="t"))
    assert set(reply(end, 1).value) == {"device"}  # no tiers: the device part only
    end.send(AdminCall(2, AdminOp.SWEEP))
    assert reply(end, 2).error is None
    end.send(AdminCall(3, AdminOp.PURGE, tenant="t"))
    assert reply(end, 3).value["aborted_requests"] == 0
    end.send(AdminCall(4, AdminOp.STATS))
    stats = stats_value(reply(end, 4).value)
    assert stats.num_blocks == 96 and stats.num_running == 0
    end.send(AdminCall(5, AdminOp.CHECK_KEYS))  # no fleet keys: answered at once
    assert reply(end, 5).error is None


def test_a_purge_aborts_the_tenants_requests(end: Any) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    end.send(
        AddBatch(1, [AddRequest("a", [5, 6, 7], long, Tenancy.of("t")), AddRequest("b", [5, 6], long, Tenancy.of("u"))])
    )
    assert reply(end, 1).error is None
    end.send(AdminCall(2, AdminOp.PURGE, tenant="t"))
    finished: list[str] = []
    while True:
        msg = end.recv()
        if isinstance(msg, Outputs):
            finished += [d.request_id for d in msg.deltas if d.finished]
        elif isinstance(msg, Reply) and msg.call_id == 2:
            assert msg.value["aborted_requests"] == 1
            break
    assert finished == ["a"]
    end.send(Abort("b"))


def test_stop_fails_what_is_in_flight_and_ends_the_loop(end: Any) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    end.send(AddBatch(1, [AddRequest("a", [5, 6, 7], long)]))
    assert reply(end, 1).error is None
    end.send(AdminCall(2, AdminOp.CHECK_INTEGRITY))  # waits for idle: never, then the stop
    end.send(AdminCall(3, AdminOp.STOP))
    fail = None
    replies = {}
    while len(replies) < 2:
        msg = end.recv()
        if isinstance(msg, Fail):
            fail = msg
        elif isinstance(msg, Reply):
            replies[msg.call_id] = msg
    assert fail is not None and fail.dead and fail.request_ids == ["a"]
    assert replies[2].error is not None and replies[2].error.dead
    assert replies[3].error is None


class Scripted:
    """A transport whose arrivals are scripted on the loop's clock: command list i arrives at
    (i + 1) * tick_s, a STOP a second after the last; receive(timeout) returns what has arrived by now + timeout
    (moving the clock to the arrival, or by the timeout when nothing comes). The timeouts asked
    for are kept."""

    def __init__(self, script: list[list[Any]], tick_s: float) -> None:
        self.arrivals = [((i + 1) * tick_s, cmds) for i, cmds in enumerate(script)]
        self.arrivals.append((len(script) * tick_s + 1.0, [AdminCall(-1, AdminOp.STOP)]))  # once all is done
        self.now = 0.0
        self.timeouts: list[float | None] = []
        self.sent: list[Any] = []

    def clock(self) -> float:
        return self.now

    def receive(self, timeout_s: float | None) -> list[Any]:
        self.timeouts.append(timeout_s)
        at, cmds = self.arrivals[0]
        if timeout_s is not None and at > self.now + timeout_s:
            self.now += timeout_s
            return []
        self.now = max(self.now, at)
        self.arrivals.pop(0)
        return list(cmds)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def first_step_requests(transport: Scripted) -> set[str]:
    """The requests of the first Outputs message (the first step's)."""
    first = next(m for m in transport.sent if isinstance(m, Outputs))
    return {d.request_id for d in first.deltas}


def run_scripted(llm: Any, script: list[list[Any]], tick_s: float, wait_s: float) -> Scripted:
    transport = Scripted(script, tick_s)
    loop = EngineLoop(llm.engine, transport)
    loop.clock = transport.clock
    loop.admission_wait_s = wait_s
    loop.run()
    clean(llm)
    return transport


def add(call_id: int, rid: str) -> AddBatch:
    return AddBatch(call_id, [AddRequest(rid, [5, 6, 7, call_id], GREEDY)])


def test_an_idle_engine_gathers_a_burst_into_its_first_step(llm: Any) -> None:
    """Requests that reach an idle engine one after another (the front-end hands over a burst one
    by one) start in the same step: the loop keeps taking arrivals, each within the gap, before it
    steps; the wait ends at the first gap with nothing."""
    t = run_scripted(llm, [[add(1, "a")], [add(2, "b")], [add(3, "c")]], tick_s=0.001, wait_s=0.02)
    assert first_step_requests(t) == {"a", "b", "c"}
    assert t.timeouts[1:3] == [pytest.approx(0.004)] * 2  # ADMISSION_GAP_S each


def test_a_gap_ends_the_wait(llm: Any) -> None:
    """An arrival later than the gap after the last one is left to the next step."""
    t = run_scripted(llm, [[add(1, "a")], [add(2, "b")]], tick_s=0.006, wait_s=0.02)
    assert first_step_requests(t) == {"a"}


def test_the_admission_wait_is_bounded(llm: Any) -> None:
    """A stream of arrivals that never pauses does not hold the first step past the wait: with
    an arrival every 3 ms (inside the 4 ms gap) and a 10 ms wait, the first step takes the
    arrivals at 3, 6, 9 and 12 ms (the wait runs from the first, 3 to 13 ms) and not the fifth."""
    script = [[add(i, f"r{i}")] for i in range(1, 7)]
    t = run_scripted(llm, script, tick_s=0.003, wait_s=0.01)
    assert first_step_requests(t) == {"r1", "r2", "r3", "r4"}


def test_without_the_wait_the_first_arrival_steps_alone(llm: Any) -> None:
    t = run_scripted(llm, [[add(1, "a")], [add(2, "b")]], tick_s=0.001, wait_s=0.0)
    assert first_step_requests(t) == {"a"}


def test_admission_wait_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.engine import loop

    monkeypatch.setenv(loop.ADMISSION_WAIT_ENV, "7.5")
    assert loop.admission_wait_s() == pytest.approx(0.0075)
    monkeypatch.setenv(loop.ADMISSION_WAIT_ENV, "0")
    assert loop.admission_wait_s() == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv(loop.ADMISSION_WAIT_ENV, bad)
        with pytest.raises(ValueError, match=loop.ADMISSION_WAIT_ENV):
            loop.admission_wait_s()
    monkeypatch.delenv(loop.ADMISSION_WAIT_ENV)
    assert loop.admission_wait_s() == loop.ADMISSION_WAIT_S
