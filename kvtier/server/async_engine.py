"""The engine thread: one background thread owns the EngineCore and steps it while requests
exist; asyncio handlers talk to it only through a queue.

    handler (event loop)                      engine thread
    --------------------                      -------------
    await add([spec, ...])  --- _Add --->     engine.add_request(...) for each (all or none)
                            <-- ack ------    loop.call_soon_threadsafe(...)
    await stream.next()     <-- outputs --    engine.step() -> outputs of requests that moved,
                                              one call_soon_threadsafe per step
    abort(request_id)       --- _Abort -->    engine.abort_request(...): its blocks are freed
    await run_when_idle(fn) --- _Idle --->    fn(engine) once no request is unfinished
    await purge(tenant)     --- _Now --->     abort the tenant's requests, evict its device
                            <-- future ---    blocks, fence its tier I/O; the tier part runs
                                              on the tiers' admin worker, not this thread

Nothing else touches the EngineCore while the thread runs (the metrics scrape reads its stats
counters, which are plain ints and copied dicts).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.outputs import RequestOutput
from kvtier.sampling_params import SamplingParams

logger = logging.getLogger("kvtier.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; the server cannot serve requests."""


class EngineStepError(RuntimeError):
    """A step failed; the requests in flight were aborted."""


@dataclass(slots=True)
class RequestSpec:
    """One engine request (one prompt; `params.n` samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    prompt: str | None = None
    tenant: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    """When the server took the request (time.monotonic, one clock for every process on the
    machine): TTFT and queue time count from here, including a wait for the engine's current
    step, as vLLM counts from its API server's arrival."""


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
class _Live:
    """Engine-thread bookkeeping of one request in flight."""

    stream: RequestStream
    num_tokens: int = 0
    last_token_time: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    """Seconds between consecutive steps that gave this request tokens."""


@dataclass(slots=True)
class _Add:
    specs: list[RequestSpec]
    streams: list[RequestStream]
    ack: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Idle:
    fn: Callable[[Any], Any]
    done: asyncio.Future


@dataclass(slots=True)
class _Now:
    fn: Callable[[Any], Any]
    done: asyncio.Future


class _Stop:
    pass


FinishedHook = Callable[[RequestOutput, list[float]], None]


class AsyncEngine:
    """Owns `engine` (an EngineCore) on a background thread once `start()` is called.

    `on_finished(output, itl_s)` is called on the engine thread for every request that ends
    (finished or aborted) with its final output and its inter-token intervals."""

    def __init__(self, engine: Any, on_finished: FinishedHook | None = None) -> None:
        self.engine = engine
        self.admin = engine.admin
        """The engine's kvtier.engine.admin.EngineAdmin: purges, sweeps, usage, integrity and
        fleet keys (the only way this front-end reaches the tiers)."""
        self.on_finished = on_finished
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._idle: list[_Idle] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        """Why the thread died (None while it runs)."""

    # ------------------------------------------------------------------ event-loop side
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        from kvtier import threads

        self._loop = loop or asyncio.get_running_loop()
        threads.release_current_thread()  # the engine thread computes; the event loop is a helper
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(self, specs: list[RequestSpec]) -> list[RequestStream]:
        """Add requests, all or none; raises the engine's ValueError for bad input. The caller
        must `abort` every request whose stream did not finish."""
        self._check_alive()
        if self.admin.checks_keys:  # fleet keys: notice a purge made by another instance before this one can hit
            await asyncio.to_thread(self.admin.refresh_keys, {s.tenant for s in specs})
        streams = [RequestStream(s.request_id) for s in specs]
        ack = asyncio.get_running_loop().create_future()
        self._inbox.put(_Add(specs, streams, ack))
        try:
            await ack
        except asyncio.CancelledError:
            for s in specs:  # added or not: an abort of an unknown id is a no-op
                self.abort(s.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks (thread-safe; unknown ids are ignored)."""
        self._inbox.put(_Abort(request_id))

    async def run_when_idle(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread once no request is in flight; its result."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(_Idle(fn, done))
        return await done

    async def run_soon(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread between two steps (requests keep running)."""
        self._check_alive()
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(_Now(fn, done))
        return await done

    async def purge(self, tenant: str | None, every_tenant: bool = False) -> dict[str, Any]:
        """Purge `tenant` (every tenant: `every_tenant`). Its unfinished requests are aborted
        (their streams end with finish_reason "abort"), then nothing of it that existed before
        is readable or hittable in any tier once this returns, except what `pending` names
        (the remote tier was unreachable; the purge is recorded and completed later)."""

        def begin(core: Any) -> tuple[dict[str, Any], Any]:
            outs, counts, future = self.admin.begin_purge(tenant, every_tenant)
            self._dispatch(outs)
            return counts, future

        retry = self.admin.retry_pending_purges()  # a retry also finishes earlier ones
        if retry is not None:
            await asyncio.wrap_future(retry)
        counts, future = await self.run_soon(begin)
        return counts if future is None else await asyncio.wrap_future(future)

    async def sweep(self) -> None:
        """TTL sweep (device part on the engine thread, tiers on the admin worker) and a retry
        of pending purges."""
        future = await self.run_soon(lambda core: self.admin.begin_sweep())
        if future is not None:
            await asyncio.wrap_future(future)

    async def usage(self, tenant: str | None) -> dict[str, Any]:
        """The tenant's cached KV per tier: device on the engine thread, tiers off it."""
        out, future = await self.run_soon(lambda core: self.admin.begin_usage(tenant))
        return out if future is None else await asyncio.wrap_future(future)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def has_tiers(self) -> bool:
        return self.admin.has_tiers

    async def check_integrity(self) -> dict[str, Any]:
        """The engine's invariant checks once it is idle (AssertionError when one fails)."""
        return await self.run_when_idle(lambda core: self.admin.integrity_report())

    async def metric_families(self) -> None:
        """None: the metrics collector reads this process's engine at scrape time."""
        return None

    def _apply_revocations(self) -> None:
        """Fleet keys another instance destroyed: EngineAdmin.drop_revoked, outputs to their
        streams."""
        self._dispatch(self.admin.drop_revoked())

    @property
    def key_check_interval_s(self) -> float | None:
        """With fleet keys: how often the periodic key check (`check_keys`) is due; else None."""
        return self.admin.key_check_interval_s

    async def check_keys(self) -> None:
        """The periodic fleet key check, with or without requests: re-read every cached data key
        (on the tiers' admin worker, off the engine thread) and drop the local copies of
        tenants whose key another instance destroyed (device, host, disk), as a request of that
        tenant would."""
        future = self.admin.begin_check_keys()
        if future is not None:
            await asyncio.wrap_future(future)
        await self.run_soon(lambda core: self._apply_revocations())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is in flight and stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout_s)

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(
                f"the engine is not running ({self.error!r})" if self.error else "the engine is not running"
            )

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        from kvtier import threads

        try:
            threads.bind_compute_threads()  # this thread's OpenMP team on the compute CPUs
            self._serve()
        except BaseException as e:
            logger.exception("the engine thread died")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine thread died: {e!r}"))
            calls, self._idle = self._idle, []  # run_when_idle calls that were waiting for idle
            for call in calls:
                self._call(_set_exception, call.done, EngineDeadError("the engine thread died"))
            while True:  # answer whatever arrived meanwhile
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, (_Add, _Idle, _Now)):
                    fut = cmd.ack if isinstance(cmd, _Add) else cmd.done
                    self._call(_set_exception, fut, EngineDeadError("the engine thread died"))

    def _serve(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished
            for cmd in self._drain(block):
                if isinstance(cmd, _Stop):
                    self._fail_all(EngineDeadError("the server is shutting down"))
                    for call in self._idle:
                        self._call(_set_exception, call.done, EngineDeadError("shutting down"))
                    return
                self._handle(cmd)
            self._apply_revocations()
            if engine.has_unfinished:
                try:
                    outputs = engine.step()
                except Exception as e:
                    logger.exception("engine step failed; aborting the requests in flight")
                    self._fail_all(EngineStepError(f"the engine failed: {e!r}"))
                    continue
                self._dispatch(outputs)
            if self._idle and not engine.has_unfinished:
                calls, self._idle = self._idle, []
                for call in calls:
                    try:
                        self._call(_set_result, call.done, call.fn(engine))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        self._call(_set_exception, call.done, e)

    def _drain(self, block: bool) -> list[Any]:
        cmds = []
        if block:
            cmds.append(self._inbox.get())
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            self._apply_revocations()
            added: list[str] = []
            try:
                for spec in cmd.specs:
                    added.append(
                        engine.add_request(
                            spec.prompt_token_ids,
                            spec.params,
                            request_id=spec.request_id,
                            cache_salt=spec.cache_salt,
                            priority=spec.priority,
                            prompt=spec.prompt,
                            tenant=spec.tenant,
                            arrival_time=spec.arrival_time,
                        )
                    )
            except Exception as e:  # noqa: BLE001 - ValueError: bad input; handed back either way
                for rid in added:
                    engine.abort_request(rid)
                self._call(_set_exception, cmd.ack, e)
                return
            now = time.monotonic()
            for rid, stream in zip(added, cmd.streams):
                self._live[rid] = _Live(stream, last_token_time=now)
            self._call(_set_result, cmd.ack, None)
        elif isinstance(cmd, _Abort):
            out = engine.abort_request(cmd.request_id)
            if out is not None:
                self._dispatch([out])
        elif isinstance(cmd, _Idle):
            self._idle.append(cmd)
        elif isinstance(cmd, _Now):
            try:
                self._call(_set_result, cmd.done, cmd.fn(engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._call(_set_exception, cmd.done, e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of the event loop per step."""
        if not outputs:
            return
        now = time.monotonic()
        batch = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > live.num_tokens:
                if live.num_tokens:
                    live.itl_s.append(now - live.last_token_time)
                live.num_tokens, live.last_token_time = num_tokens, now
            batch.append((live.stream, out))
            if out.finished:
                del self._live[out.request_id]
                if self.on_finished is not None:
                    try:
                        self.on_finished(out, live.itl_s)
                    except Exception:
                        logger.exception("on_finished hook failed")
        self._call(_deliver, batch)

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and hand `error` to its stream."""
        batch = []
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            batch.append((live.stream, error))
        self._live.clear()
        if batch:
            self._call(_deliver, batch)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None, "start() sets the loop before the engine thread runs"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _deliver(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._put(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
