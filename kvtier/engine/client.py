"""EngineClient: the one interface the server talks to the engine through, whether the engine
runs on a thread of the server process (InProcessEngineClient, here) or in its own process
(kvtier.engine.process.ProcessEngineClient). Both send kvtier.engine.protocol commands to one
kvtier.engine.loop.EngineLoop and receive its messages on the event loop (`_receive`), where
everything below is written once: request streams, deltas applied into RequestOutputs,
admin calls as awaitables, failures, the on_finished hook.

    await client.add([spec, ...])   --- AddBatch ----->   all or none
                                    <-- Reply ---------
    await stream.next()             <-- Outputs -------   one message per step (deltas)
    client.abort(request_id)        --- Abort -------->
    await client.load_lora(lora)    --- AddBatch ----->   a one-token probe naming the adapter,
                                    --- Abort -------->   aborted at once: the engine loads it
                                    <-- Reply ---------   (or says why it cannot)
    await client.purge(tenant)      --- AdminCall ---->   EngineAdmin between steps; the
                                    <-- Reply ---------   tiers' part on their admin worker
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.admin import EngineStats
from kvtier.engine.loop import EngineLoop, InProcessTransport, LocalCall
from kvtier.engine.protocol import (
    Abort,
    AddBatch,
    AddRequest,
    AdminCall,
    AdminOp,
    ErrorInfo,
    Fail,
    FromEngine,
    LogprobEntry,
    OutputDelta,
    Outputs,
    Reply,
    stats_value,
)
from kvtier.lora import LoRARequest
from kvtier.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams

logger = logging.getLogger("kvtier.server")

RequestSpec = AddRequest
"""One engine request, as the server builds it (kvtier.engine.protocol.AddRequest)."""

FinishedHook = Callable[[RequestOutput, list[float]], None]


class EngineDeadError(RuntimeError):
    """The engine stopped; the server cannot serve requests."""


class EngineStepError(RuntimeError):
    """A step failed; the requests in flight were aborted."""


class RequestStream:
    """The outputs of one engine request, on the event loop. Outputs are cumulative, so a
    reader that falls behind skips to the newest one; the last one has `finished` set.
    Undelivered outputs are bounded: a new output replaces the one its reader has not taken
    yet (a client that does not read holds one output per request, not one per step; the
    stream's stall timeout then aborts it)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(item, BaseException):
            while not self._queue.empty():  # superseded: `next` would skip it anyway
                older = self._queue.get_nowait()
                if isinstance(older, BaseException):  # an error is never dropped (nor passed)
                    self._queue.put_nowait(older)
                    return
        self._queue.put_nowait(item)

    async def next(self) -> RequestOutput:
        """The newest output (waits for one). Raises the engine's error, if any."""
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass(slots=True)
class _Seq:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class _Live:
    """Client-side state of one request in flight (event loop only)."""

    stream: RequestStream
    spec: AddRequest
    seqs: dict[int, _Seq] = field(default_factory=dict)
    num_tokens: int = 0
    last_token_time: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    """Seconds between consecutive deliveries that gave this request tokens."""

    def apply(self, d: OutputDelta) -> RequestOutput:
        """The request's output once `d` is applied."""
        for sd in d.seqs:
            s = self.seqs.get(sd.index)
            if s is None:
                s = self.seqs[sd.index] = _Seq()
            s.token_ids.extend(sd.new_token_ids)
            if sd.new_logprobs is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.extend(_logprobs(e or {}) for e in sd.new_logprobs)
            s.finish_reason, s.stop_reason, s.cumulative_logprob = (
                sd.finish_reason,
                sd.stop_reason,
                sd.cumulative_logprob,
            )
            if sd.text is not None:
                s.text = sd.text
            elif sd.text_delta:
                s.text += sd.text_delta
        outs = [
            CompletionOutput(
                index=i,
                text=s.text,
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
            )
            for i, s in sorted(self.seqs.items())
        ]
        return RequestOutput(
            request_id=d.request_id,
            prompt=self.spec.prompt,
            prompt_token_ids=self.spec.prompt_token_ids,
            outputs=outs,
            finished=d.finished,
            metrics=RequestMetrics(d.arrival_time, d.first_scheduled_time, d.first_token_time, d.finished_time),
            num_cached_tokens=d.num_cached_tokens,
            cached_tokens_by_tier=dict(d.cached_tokens_by_tier),
            num_recomputed_tokens=d.num_recomputed_tokens,
            num_preemptions=d.num_preemptions,
            restore_decision=d.restore_decision,
            restore_s=d.restore_s,
            prompt_logprobs=None
            if d.prompt_logprobs is None
            else [None if e is None else _logprobs(e) for e in d.prompt_logprobs],
            lora_request=self.spec.lora_request,
        )


def _logprobs(entry: LogprobEntry) -> dict[int, Logprob]:
    """One protocol entry back as Logprobs (the rank kept)."""
    return {int(k): Logprob(lp, rank) for k, (lp, rank) in entry.items()}


def _error(e: ErrorInfo) -> BaseException:
    """A Reply's error as the exception the caller sees."""
    if e.dead:
        return EngineDeadError(e.message)
    if e.kind == "ValueError":
        return ValueError(e.message)
    if e.kind == "AssertionError":
        return AssertionError(e.message)
    return RuntimeError(f"{e.kind}: {e.message}")


class EngineClient(ABC):
    """The server's handle on an engine (the only one server code uses).

    Threads: every method runs on the event loop `start` was given, except `abort` and
    `shutdown` (any thread) and `_receive`'s callers, which hand messages to the loop
    thread-safely. Owns the requests' streams and the calls waiting for replies; the engine
    itself belongs to the EngineLoop that the implementation runs (thread or process).
    `on_finished(output, itl_s)` runs on the event loop for every request that ends."""

    def __init__(self, on_finished: FinishedHook | None = None, on_dead: Callable[[], None] | None = None) -> None:
        self.on_finished = on_finished
        self.on_dead = on_dead
        """Called (on the event loop) when the engine dies on its own."""
        self.error: BaseException | None = None
        """Why the engine stopped (None while it runs)."""
        self._live: dict[str, _Live] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ implementations
    @abstractmethod
    def _send(self, msg: Any) -> None:
        """Hand a command to the engine loop (any thread)."""

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def has_tiers(self) -> bool: ...

    @property
    @abstractmethod
    def key_check_interval_s(self) -> float | None:
        """With fleet keys: how often the periodic key check (`check_keys`) is due; else None."""

    @abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start delivering messages on `loop` (the running one by default)."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (what is in flight fails with EngineDeadError) and wait for it."""

    @abstractmethod
    def stats_now(self) -> EngineStats | None:
        """The engine's counters for a metrics render: read now, or as last fetched."""

    async def fetch_stats(self) -> EngineStats | None:
        """Bring `stats_now` up to date (before a scrape renders)."""
        return self.stats_now()

    # ------------------------------------------------------------------ requests
    async def add(self, specs: list[AddRequest]) -> list[RequestStream]:
        """Add requests, all or none; raises the engine's ValueError for bad input. The caller
        must `abort` every request whose stream did not finish."""
        self._check_alive()
        streams = [RequestStream(s.request_id) for s in specs]
        now = time.monotonic()
        for s, stream in zip(specs, streams):
            self._live[s.request_id] = _Live(stream, s, last_token_time=now)
        try:
            await self._call(lambda call_id: AddBatch(call_id, specs))
        except BaseException:
            for s in specs:
                self._live.pop(s.request_id, None)
                self.abort(s.request_id)  # added or not: an abort of an unknown id is a no-op
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks (unknown ids are ignored)."""
        if self.alive:
            self._send(Abort(request_id))

    async def load_lora(self, lora_request: LoRARequest) -> None:
        """Have the engine load `lora_request`'s adapter now and keep it for the requests that
        name it (vLLM's add_lora); the engine's ValueError, with the reason, when it cannot be
        read or does not fit the model. The engine loads an adapter when a request first names
        it: this adds a one-token request naming it with its abort sent right behind, so that,
        as a rule, it is gone before the engine's next step (its outputs reach no stream)."""
        probe = AddRequest(
            f"kvtier-lora-load-{uuid.uuid4().hex}",
            [0],
            SamplingParams(max_tokens=1, temperature=0.0),
            lora_request=lora_request,
        )
        await self._call(lambda call_id: AddBatch(call_id, [probe]), then=Abort(probe.request_id))

    # ------------------------------------------------------------------ admin calls
    async def purge(self, tenant: str | None, every_tenant: bool = False) -> dict[str, Any]:
        """Purge `tenant` (every tenant: `every_tenant`). Its unfinished requests are aborted
        (their streams end with finish_reason "abort"), then nothing of it that existed before
        is readable or hittable in any tier once this returns, except what `pending` names
        (the remote tier was unreachable; the purge is recorded and completed later)."""
        return await self._admin(AdminOp.PURGE, tenant, every_tenant)

    async def usage(self, tenant: str | None) -> dict[str, Any]:
        """The tenant's cached KV per tier."""
        return await self._admin(AdminOp.USAGE, tenant)

    async def sweep(self) -> None:
        """TTL sweep and a retry of pending purges."""
        await self._admin(AdminOp.SWEEP)

    async def check_keys(self) -> None:
        """The periodic fleet key check: re-read every cached data key (off the engine thread)
        and drop the local copies of tenants whose key another instance destroyed."""
        await self._admin(AdminOp.CHECK_KEYS)

    async def check_integrity(self) -> dict[str, Any]:
        """The engine's invariant checks once it is idle (AssertionError when one fails)."""
        return await self._admin(AdminOp.CHECK_INTEGRITY)

    async def _admin(self, op: AdminOp, tenant: str | None = None, every_tenant: bool = False) -> Any:
        return await self._call(lambda call_id: AdminCall(call_id, op, tenant, every_tenant))

    async def _call(self, command: Callable[[int], Any], then: Any = None) -> Any:
        """Send `command(call_id)` (and `then`, a message, right behind it); the value of its Reply."""
        self._check_alive()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(command(call_id))
            if then is not None:
                self._send(then)
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(
                f"the engine is not running ({self.error!r})" if self.error else "the engine is not running"
            )

    # ------------------------------------------------------------------ messages (event loop)
    def _receive(self, msg: FromEngine) -> None:
        if isinstance(msg, Outputs):
            self._deliver(msg.deltas)
        elif isinstance(msg, Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(_error(msg.error))
        elif isinstance(msg, Fail):
            cls = EngineDeadError if msg.dead else EngineStepError
            for rid in msg.request_ids:
                live = self._live.pop(rid, None)
                if live is not None:
                    live.stream._put(cls(msg.message))

    def _deliver(self, deltas: list[OutputDelta]) -> None:
        now = time.monotonic()
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is None:
                continue
            out = live.apply(d)
            n = sum(len(c.token_ids) for c in out.outputs)
            if n > live.num_tokens:
                if live.num_tokens:
                    live.itl_s.append(now - live.last_token_time)
                live.num_tokens, live.last_token_time = n, now
            live.stream._put(out)
            if out.finished:
                del self._live[d.request_id]
                if self.on_finished is not None:
                    try:
                        self.on_finished(out, live.itl_s)
                    except Exception:
                        logger.exception("on_finished hook failed")

    def _fail_all(self, error: BaseException) -> None:
        """Every open stream and pending call gets `error` (the engine is gone)."""
        for live in self._live.values():
            live.stream._put(error)
        self._live.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()


class InProcessEngineClient(EngineClient):
    """The engine on a thread of this process ("kvtier-engine"), owning `core` (an EngineCore)
    from `start()` until `shutdown()`: an EngineLoop over an InProcessTransport, whose messages
    reach the event loop through call_soon_threadsafe, unencoded. The metrics scrape reads the
    core's counters through `core.admin.stats()` from the event loop (plain reads)."""

    def __init__(self, core: Any, on_finished: FinishedHook | None = None) -> None:
        super().__init__(on_finished)
        self.engine = core
        self.admin = core.admin
        self._transport = InProcessTransport(self._from_engine)
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        from kvtier import threads

        self._loop = loop or asyncio.get_running_loop()
        threads.release_current_thread()  # the engine thread computes; the event loop is a helper
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvtier import threads

        try:
            threads.bind_compute_threads()  # this thread's OpenMP team on the compute CPUs
            EngineLoop(self.engine, self._transport).run()
        except BaseException as e:  # noqa: BLE001 - logged by the loop; kept for `error`
            self.error = e

    def _from_engine(self, msg: FromEngine) -> None:
        assert self._loop is not None, "start() sets the loop before the engine thread runs"
        try:
            self._loop.call_soon_threadsafe(self._receive, msg)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _send(self, msg: Any) -> None:
        self._transport.put(msg)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def has_tiers(self) -> bool:
        return self.admin.has_tiers

    @property
    def key_check_interval_s(self) -> float | None:
        return self.admin.key_check_interval_s

    def stats_now(self) -> EngineStats | None:
        return self.admin.stats()

    async def run_when_idle(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(core)` on the engine thread once no request is in flight; its result."""
        return await self._call(lambda call_id: LocalCall(call_id, fn, when_idle=True))

    async def run_soon(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(core)` on the engine thread between two steps (requests keep running)."""
        return await self._call(lambda call_id: LocalCall(call_id, fn))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._send(AdminCall(-1, AdminOp.STOP))
            self._thread.join(timeout_s)


__all__ = [
    "EngineClient",
    "EngineDeadError",
    "EngineStepError",
    "InProcessEngineClient",
    "RequestSpec",
    "RequestStream",
    "stats_value",
]
