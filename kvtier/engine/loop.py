"""The engine loop, written once for both ways of serving: a thread of the server process
(InProcessTransport) and the engine's own process (kvtier.engine.process.ZmqTransport).

    loop: take the commands that arrived (block while there is nothing to do)
          AddBatch  -> EngineCore.add_request for each, all or none; Reply
          Abort     -> EngineCore.abort_request; its final delta
          AdminCall -> EngineAdmin (core.admin), or kvtier.engine.reset for a prefix cache
                       reset; Reply now, or once the tiers' part is done
          apply fleet key revocations; step; each moved request's OutputDelta, one Outputs
          message per step; a failed step: every request in flight aborted, one Fail
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.engine import reset
from kvtier.engine.protocol import (
    Abort,
    AddBatch,
    AdminCall,
    AdminOp,
    ErrorInfo,
    Fail,
    FromEngine,
    OutputDelta,
    Outputs,
    Reply,
    SeqDelta,
    Undecodable,
    error_info,
    plain_logprobs,
)
from kvtier.outputs import RequestOutput

logger = logging.getLogger("kvtier.engine")

WAIT_POLL_S = 0.02
"""How often an idle loop looks at the admin work it waits for (tier parts of admin calls)."""

ADMISSION_WAIT_ENV = "KVTIER_ADMISSION_WAIT_MS"
"""Milliseconds an idle engine may wait for a burst to arrive before its first step (default
ADMISSION_WAIT_S; 0 turns the wait off)."""
ADMISSION_WAIT_S = 0.02
"""An idle engine that receives requests keeps taking the ones that follow, each within
ADMISSION_GAP_S of the last, for up to this long before it steps. Clients send bursts (a wave of
agents, a batch job, a benchmark at fixed concurrency), and the front-end hands them over one by
one as it tokenizes them: stepping on the first alone made the rest wait for that whole step
before their own (8 requests over a shared 512-token prefix on the 2-vCPU machine: the first's
first token at ~60 ms, the other seven's at ~300 ms; all eight in one step: ~250 ms; session 37).
A lone request pays one gap (4 ms) at most; a busy engine never waits."""
ADMISSION_GAP_S = 0.004


def admission_wait_s() -> float:
    """ADMISSION_WAIT_S, or KVTIER_ADMISSION_WAIT_MS in seconds (a clear error if it is not a
    number >= 0)."""
    raw = os.environ.get(ADMISSION_WAIT_ENV, "").strip()
    if not raw:
        return ADMISSION_WAIT_S
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0 or ms == float("inf"):
        raise ValueError(f"{ADMISSION_WAIT_ENV}={raw!r}: milliseconds >= 0 (0: no wait)")
    return ms / 1000


@dataclass(slots=True)
class LocalCall:
    """In-process only (never on the wire): `fn(core)` on the engine thread between steps, or
    once no request is in flight (`when_idle`); its result as the Reply's value."""

    call_id: int
    fn: Callable[[Any], Any]
    when_idle: bool = False


class Transport(Protocol):
    """How the loop's messages come and go. `receive` runs on the engine thread only; `send`
    on the engine thread and on the tiers' admin worker (it must be thread-safe)."""

    def receive(self, timeout_s: float | None) -> list[Any]:
        """The commands that arrived, waiting up to `timeout_s` (None: until one does) for one."""
        ...

    def send(self, msg: FromEngine) -> None: ...


class InProcessTransport:
    """Commands in through a thread-safe queue, messages out through `deliver` (called on the
    engine thread or the tiers' admin worker; it must be thread-safe). The Structs are handed
    over as they are: nothing is encoded."""

    def __init__(self, deliver: Callable[[FromEngine], None]) -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.deliver = deliver

    def put(self, cmd: Any) -> None:
        self.inbox.put(cmd)

    def receive(self, timeout_s: float | None) -> list[Any]:
        cmds = []
        try:
            cmds.append(self.inbox.get(timeout=timeout_s) if timeout_s != 0 else self.inbox.get_nowait())
        except queue.Empty:
            return cmds
        while True:
            try:
                cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def send(self, msg: FromEngine) -> None:
        self.deliver(msg)


class EngineLoop:
    """Steps one EngineCore and answers its front-end's commands.

    Threads: `run` runs on one thread (the engine thread, or the engine process's main
    thread), which alone touches the core; the tiers' admin worker only completes futures
    whose callbacks send replies through the transport or queue work for the engine thread.
    Owns the per-request delta state (what was sent of each request in flight)."""

    def __init__(self, core: Any, transport: Transport) -> None:
        self.core = core
        self.admin = core.admin
        """The core's EngineAdmin: the only way the loop reaches the tiers."""
        self.transport = transport
        self._sent: dict[str, list[tuple[int, int]]] = {}
        """Request in flight -> (token ids, characters of text) sent so far per sequence."""
        self._idle: list[AdminCall | LocalCall] = []
        self._soon: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting = 0
        self._lock = threading.Lock()
        self.admission_wait_s = admission_wait_s()
        """How long an idle loop gathers a burst of requests before stepping (ADMISSION_WAIT_S)."""
        self.clock: Callable[[], float] = time.monotonic
        """The admission wait's clock (tests inject one)."""

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Serve until a STOP call. An error escaping the loop fails everything in flight
        (EngineDeadError on the front-end) and is raised again."""
        try:
            self._serve()
        except BaseException as e:
            logger.exception("the engine loop died")
            self._end(f"the engine loop died: {e!r}", "the engine loop died")
            for cmd in self.transport.receive(0):  # answer whatever arrived meanwhile
                if isinstance(cmd, (AddBatch, AdminCall, LocalCall)):
                    self._reply_error(cmd.call_id, ErrorInfo("EngineDeadError", "the engine loop died", True))
            raise

    def _serve(self) -> None:
        core = self.core
        while True:
            stepping = core.has_unfinished
            busy = stepping or (self._idle and not core.has_unfinished)
            timeout = 0 if busy else (WAIT_POLL_S if self._waiting or not self._soon.empty() else None)
            cmds = self.transport.receive(timeout)
            for cmd in cmds:
                if self._handle(cmd) is False:
                    return
            burst = not stepping and self.admission_wait_s > 0 and any(isinstance(c, AddBatch) for c in cmds)
            if burst and self._gather_burst() is False:
                return
            while not self._soon.empty():
                self._soon.get()()
            self._apply_revocations()
            if core.has_unfinished:
                try:
                    outputs = core.step()
                except Exception as e:
                    logger.exception("engine step failed; aborting the requests in flight")
                    self.transport.send(Fail(self._abort_live(), f"the engine failed: {e!r}"))
                    continue
                self._dispatch(outputs)
            if self._idle and not core.has_unfinished:
                calls, self._idle = self._idle, []
                for call in calls:
                    self._run_call(call)

    def _gather_burst(self) -> bool:
        """Requests reached an idle engine: take the commands that follow, each within
        ADMISSION_GAP_S of the last, for up to `admission_wait_s`, so that a burst's first step
        holds all of it (see ADMISSION_WAIT_S). False: a STOP came meanwhile."""
        deadline = self.clock() + self.admission_wait_s
        while (left := deadline - self.clock()) > 0:
            cmds = self.transport.receive(min(ADMISSION_GAP_S, left))
            if not cmds:
                return True
            for cmd in cmds:
                if self._handle(cmd) is False:
                    return False
        return True

    def _handle(self, cmd: Any) -> bool:
        if isinstance(cmd, AddBatch):
            self._add(cmd)
        elif isinstance(cmd, Abort):
            out = self.core.abort_request(cmd.request_id)
            if out is not None:
                self._dispatch([out])
        elif isinstance(cmd, AdminCall) and cmd.op is AdminOp.STOP:
            self._end("the server is shutting down", "shutting down")
            self.transport.send(Reply(cmd.call_id))
            return False
        elif isinstance(cmd, Undecodable):
            logger.error("%s", cmd.message)
            if cmd.call_id is not None:
                self._reply_error(cmd.call_id, ErrorInfo("ValueError", cmd.message, False))
        elif isinstance(cmd, (AdminCall, LocalCall)):
            idle = cmd.when_idle if isinstance(cmd, LocalCall) else cmd.op is AdminOp.CHECK_INTEGRITY
            if idle:
                self._idle.append(cmd)
            else:
                self._run_call(cmd)
        return True

    def _end(self, streams_error: str, calls_error: str) -> None:
        """Fail every request in flight and every call waiting for idle (the loop ends)."""
        self.transport.send(Fail(self._abort_live(), streams_error, dead=True))
        calls, self._idle = self._idle, []
        for call in calls:
            self._reply_error(call.call_id, ErrorInfo("EngineDeadError", calls_error, True))

    def _abort_live(self) -> list[str]:
        rids = list(self._sent)
        for rid in rids:
            try:
                self.core.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        self._sent.clear()
        return rids

    def _add(self, batch: AddBatch) -> None:
        core, admin = self.core, self.admin
        added: list[str] = []
        try:
            if admin.checks_keys:  # fleet keys: see a purge made elsewhere first
                admin.refresh_keys({r.tenancy.tenant for r in batch.requests})
                self._apply_revocations()
            for r in batch.requests:
                added.append(
                    core.add_request(
                        r.prompt_token_ids,
                        r.params,
                        request_id=r.request_id,
                        priority=r.priority,
                        prompt=r.prompt,
                        tenancy=r.tenancy,
                        arrival_time=min(r.arrival_time, time.monotonic()),
                        stream_text=r.stream,
                        lora_request=r.lora_request,
                    )
                )
        except Exception as e:  # noqa: BLE001 - ValueError: bad input; handed back either way
            for rid in added:
                core.abort_request(rid)
            self._reply_error(batch.call_id, error_info(e))
            return
        for rid in added:
            self._sent[rid] = []
        self.transport.send(Reply(batch.call_id))

    # ------------------------------------------------------------------ outputs
    def _dispatch(self, outputs: Sequence[RequestOutput | None]) -> None:
        """A step's outputs as deltas, in one message."""
        deltas = []
        for out in outputs:
            if out is None or out.request_id not in self._sent:
                continue
            deltas.append(to_delta(out, self._sent[out.request_id]))
            if out.finished:
                del self._sent[out.request_id]
        if deltas:
            self.transport.send(Outputs(deltas))

    def _apply_revocations(self) -> None:
        self._dispatch(self.admin.drop_revoked())

    # ------------------------------------------------------------------ admin calls
    def _run_call(self, call: AdminCall | LocalCall) -> None:
        try:
            if isinstance(call, LocalCall):
                self.transport.send(Reply(call.call_id, call.fn(self.core)))
            else:
                self._admin(call)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self._reply_error(call.call_id, error_info(e))

    def _admin(self, call: AdminCall) -> None:
        admin, op = self.admin, call.op
        if op is AdminOp.PURGE:
            admin.retry_pending_purges()  # runs first on the admin worker
            outs, counts, future = admin.begin_purge(call.tenant, call.every_tenant)
            self._dispatch(outs)
            self._reply_when(call.call_id, counts, future)
        elif op is AdminOp.USAGE:
            self._reply_when(call.call_id, *admin.begin_usage(call.tenant))
        elif op is AdminOp.SWEEP:
            self._reply_when(call.call_id, None, admin.begin_sweep())
        elif op is AdminOp.CHECK_KEYS:  # revocations are applied on the engine thread
            self._reply_when(call.call_id, None, admin.begin_check_keys(), then=self._apply_revocations)
        elif op is AdminOp.CHECK_INTEGRITY:
            self._reply_when(call.call_id, admin.integrity_report())
        elif op is AdminOp.STATS:
            self._reply_when(call.call_id, admin.stats())
        elif op is AdminOp.RESET_PREFIX_CACHE:  # KV events sent on the engine thread
            now, future = reset.begin_reset(self.core, call.tiers)
            self._reply_when(call.call_id, now, future, then=lambda: reset.publish_events(self.core))
        else:
            raise ValueError(f"unknown engine call {op!r}")

    def _reply_when(
        self, call_id: int, now: Any, future: Future | None = None, then: Callable[[], None] | None = None
    ) -> None:
        """Reply `now`, or `future.result()` once it is done (EngineAdmin's begin_* convention);
        `then` runs on the engine thread before that reply."""
        if future is None:
            if then is not None:
                then()
            self.transport.send(Reply(call_id, now))
            return
        with self._lock:
            self._waiting += 1

        def reply(f: Future) -> None:
            with self._lock:
                self._waiting -= 1
            if then is not None:
                then()
            try:
                self.transport.send(Reply(call_id, f.result()))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._reply_error(call_id, error_info(e))

        if then is None:
            future.add_done_callback(reply)  # on the admin worker
        else:  # on the engine thread, which polls while `_waiting`
            future.add_done_callback(lambda f: self._soon.put(lambda: reply(f)))

    def _reply_error(self, call_id: int, error: ErrorInfo) -> None:
        self.transport.send(Reply(call_id, error=error))


def to_delta(out: RequestOutput, sent: list[tuple[int, int]]) -> OutputDelta:
    """A RequestOutput as a delta: per sequence only the token ids (and logprobs) and the text
    not sent yet (the whole final text once it ends); `sent[i]` counts the token ids and
    characters sent of sequence i (updated). The prompt's logprobs go with the first delta that
    has tokens (the prompt is computed then: an echoing stream sends them first) and again with
    the finished one (the final output carries them)."""
    first_tokens = not any(k for k, _ in sent) and any(c.token_ids for c in out.outputs)
    seqs = []
    for c in out.outputs:
        while len(sent) <= c.index:
            sent.append((0, 0))
        k, chars = sent[c.index]
        done = c.finish_reason is not None
        sent[c.index] = (len(c.token_ids), chars if done else len(c.text))
        seqs.append(
            SeqDelta(
                c.index,
                c.token_ids[k:],
                plain_logprobs(c.logprobs[k:]) if c.logprobs is not None else None,
                c.finish_reason,
                c.stop_reason,
                c.text if done else None,
                c.cumulative_logprob,
                "" if done else c.text[chars:],
            )
        )
    m = out.metrics
    return OutputDelta(
        out.request_id,
        out.finished,
        seqs,
        out.num_cached_tokens,
        out.cached_tokens_by_tier,
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        m.finished_time,
        out.num_recomputed_tokens,
        out.num_preemptions,
        out.restore_decision,
        out.restore_s,
        plain_logprobs(out.prompt_logprobs)
        if (out.finished or first_tokens) and out.prompt_logprobs is not None
        else None,
    )
