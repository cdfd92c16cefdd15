"""`kvtier serve`'s engine core in its own process.

    API server process (asyncio)                    engine process (its main thread steps)
    ----------------------------                    ---------------------------------------
    HTTP, tenancy, tokenization, validation
    EngineClient.add(specs)    --- add -------->    EngineCore.add_request for each (all or none)
                               <-- reply -------
    RequestStream.next()       <-- out ---------    one message per step: each moved request's
                                                    new token ids and logprobs (deltas), finish
                                                    reasons, cache counters; the final text once
    StreamText: incremental detokenization, SSE
    abort(request_id)          --- abort ------>    its blocks are freed
    purge, usage, sweep, check_integrity, metrics
                               --- call ------->    run between steps; tier parts on the tiers'
                               <-- reply -------    admin worker, so the steps go on meanwhile

The HTTP event loop, JSON, tokenization and detokenization no longer share an interpreter (and
its lock) with the model's steps, as in vLLM's EngineCore process. Transport: two ZMQ PUSH/PULL
sockets over ipc:// in a private (0700) folder, messages in msgpack (msgspec); the metrics
snapshot travels pickled (both ends are this program, the folder is private).

The engine process is started with the server's settings as JSON on its stdin and keeps stdin
open: EOF means the server died, and the engine exits. When the engine process dies (a crash,
the OOM killer), every open stream and pending call gets `EngineDeadError` (a 500 to the
client, not a hang), /health answers 503, and `on_dead` runs: `kvtier serve` then shuts the
server down with exit status 1, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvtier.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.server.async_engine import (
    EngineDeadError,
    EngineStepError,
    RequestSpec,
    RequestStream,
)

logger = logging.getLogger("kvtier.server")

READY_TIMEOUT_S = 600.0
"""Longest wait for the engine process to load the model."""


# ---------------------------------------------------------------------------------- wire format
def _encode_output(out: RequestOutput, sent: list[int]) -> list[Any]:
    """A RequestOutput as a delta: per sequence only the token ids (and logprobs) not sent yet;
    `sent[i]` counts what was sent of sequence i (updated)."""
    seqs = []
    for c in out.outputs:
        while len(sent) <= c.index:
            sent.append(0)
        k = sent[c.index]
        new_ids = c.token_ids[k:]
        new_lp = _plain(c.logprobs[k:]) if c.logprobs is not None else None
        sent[c.index] = len(c.token_ids)
        seqs.append(
            [
                c.index,
                new_ids,
                new_lp,
                c.finish_reason,
                c.stop_reason,
                c.text if c.finish_reason is not None else None,
                c.cumulative_logprob,
            ]
        )
    m = out.metrics
    return [
        out.request_id,
        out.finished,
        seqs,
        out.num_cached_tokens,
        out.cached_tokens_by_tier,
        [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time],
        out.num_recomputed_tokens,
        out.num_preemptions,
        out.restore_decision,
        out.restore_s,
        _plain(out.prompt_logprobs) if out.finished and out.prompt_logprobs is not None else None,
    ]


def _plain(entries: Sequence[Mapping[int, float] | None]) -> list[dict[int, tuple[float, int | None]] | None]:
    """Logprob entries for the wire (which has no Logprob type): token id -> (logprob, rank)."""
    return [None if d is None else {k: (float(v), getattr(v, "rank", None)) for k, v in d.items()} for d in entries]


def _logprobs(entry: Mapping[Any, Any]) -> dict[int, Logprob]:
    """One wire entry of `_plain` back as Logprobs (the rank kept, as the in-process engine gives it)."""
    return {int(k): Logprob(lp, rank) for k, (lp, rank) in entry.items()}


@dataclasses.dataclass(slots=True)
class _Seq:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    cumulative_logprob: float | None = None


@dataclasses.dataclass(slots=True)
class _ClientLive:
    """Server-side state of one request in flight."""

    stream: RequestStream
    spec: RequestSpec
    seqs: dict[int, _Seq] = dataclasses.field(default_factory=dict)
    num_tokens: int = 0
    last_token_time: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)

    def apply(self, msg: list[Any]) -> RequestOutput:
        rid, finished, seqs, cached, by_tier, times, recomputed, preempt, decision, restore_s, prompt_lp = msg
        for index, new_ids, new_lp, finish, stop_reason, text, cum in seqs:
            s = self.seqs.get(index)
            if s is None:
                s = self.seqs[index] = _Seq()
            s.token_ids.extend(new_ids)
            if new_lp is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.extend(_logprobs(d) for d in new_lp)
            s.finish_reason, s.stop_reason, s.cumulative_logprob = finish, stop_reason, cum
            if text is not None:
                s.text = text
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
            request_id=rid,
            prompt=self.spec.prompt,
            prompt_token_ids=self.spec.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=RequestMetrics(*times),
            num_cached_tokens=cached,
            cached_tokens_by_tier=dict(by_tier),
            num_recomputed_tokens=recomputed,
            num_preemptions=preempt,
            restore_decision=decision,
            restore_s=restore_s,
            prompt_logprobs=None if prompt_lp is None else [None if d is None else _logprobs(d) for d in prompt_lp],
        )


# ---------------------------------------------------------------------------------- engine side
class _EngineLoop:
    """The engine process: steps the EngineCore and answers the server's messages."""

    def __init__(self, core: Any, pull: Any, push: Any) -> None:
        import msgspec

        self.core = core
        self.admin = core.admin
        """The core's EngineAdmin (kvtier.engine.admin), as AsyncEngine uses it."""
        self.pull = pull
        self.push = push
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._send_lock = threading.Lock()  # replies also go out from the tiers' admin worker
        self._sent: dict[str, list[int]] = {}
        self._idle: list[tuple[int, str]] = []
        self._soon: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting = 0
        """Admin futures not yet answered (the loop polls more often while there are some)."""

    def send(self, msg: list[Any]) -> None:
        with self._send_lock:
            self.push.send(self._enc.encode(msg))

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished or (self._idle and not core.has_unfinished)
            timeout = 0 if busy else (20 if self._waiting or not self._soon.empty() else 1000)
            if self.pull.poll(timeout):
                while True:
                    try:
                        raw = self.pull.recv(flags=1)  # zmq.NOBLOCK
                    except Exception:  # noqa: BLE001 - zmq.Again: drained
                        break
                    if self._handle(self._dec.decode(raw)) is False:
                        return
            while not self._soon.empty():
                self._soon.get()()
            self._apply_revocations()
            if core.has_unfinished:
                try:
                    outputs = core.step()
                except Exception as e:
                    logger.exception("engine step failed; aborting the requests in flight")
                    rids = list(self._sent)
                    for rid in rids:
                        core.abort_request(rid)
                    self._sent.clear()
                    self.send(["fail", rids, f"the engine failed: {e!r}"])
                    continue
                self._dispatch(outputs)
            if self._idle and not core.has_unfinished:
                calls, self._idle = self._idle, []
                for call_id, op in calls:
                    self._call(call_id, op, None)

    def _dispatch(self, outputs: Sequence[RequestOutput | None]) -> None:
        batch = []
        for out in outputs:
            if out is None or out.request_id not in self._sent:
                continue
            batch.append(_encode_output(out, self._sent[out.request_id]))
            if out.finished:
                del self._sent[out.request_id]
        if batch:
            self.send(["out", batch])

    def _apply_revocations(self) -> None:
        self._dispatch(self.admin.drop_revoked())

    def _handle(self, msg: list[Any]) -> bool | None:
        kind = msg[0]
        if kind == "add":
            _, call_id, specs = msg
            self._add(call_id, specs)
        elif kind == "abort":
            out = self.core.abort_request(msg[1])
            if out is not None:
                self._dispatch([out])
        elif kind == "call":
            _, call_id, op, arg = msg
            if op == "stop":
                self._dispatch(self.core.abort_all())
                self.send(["reply", call_id, True, None])
                return False
            if op == "check_integrity":
                self._idle.append((call_id, op))
            else:
                self._call(call_id, op, arg)
        return None

    def _add(self, call_id: int, specs: list[list[Any]]) -> None:
        core = self.core
        added: list[str] = []
        try:
            if self.admin.checks_keys:  # fleet keys: see a purge made elsewhere first
                self.admin.refresh_keys({s[6] for s in specs})
                self._apply_revocations()
            for rid, ids, params, salt, priority, prompt, tenant, arrival in specs:
                added.append(
                    core.add_request(
                        ids,
                        SamplingParams(**params),
                        request_id=rid,
                        cache_salt=salt,
                        priority=priority,
                        prompt=prompt,
                        tenant=tenant,
                        arrival_time=min(arrival, time.monotonic()),
                    )
                )
        except Exception as e:  # noqa: BLE001 - ValueError: bad input; handed back either way
            for rid in added:
                core.abort_request(rid)
            self.send(["reply", call_id, False, [type(e).__name__, str(e)]])
            return
        for rid in added:
            self._sent[rid] = []
        self.send(["reply", call_id, True, None])

    def _reply_when(self, call_id: int, now: Any, future: Future | None = None) -> None:
        """Reply `now`, or `future.result()` once it is done (EngineAdmin's begin_* convention)."""
        if future is None:
            self.send(["reply", call_id, True, now])
            return
        self._waiting += 1

        def done(f: Future) -> None:
            self._waiting -= 1
            try:
                self.send(["reply", call_id, True, f.result()])
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self.send(["reply", call_id, False, [type(e).__name__, str(e)]])

        future.add_done_callback(done)

    def _call(self, call_id: int, op: str, arg: Any) -> None:
        admin = self.admin
        try:
            if op == "purge":
                tenant, every = arg
                admin.retry_pending_purges()  # runs first on the admin worker
                outs, counts, future = admin.begin_purge(tenant, every)
                self._dispatch(outs)
                self._reply_when(call_id, counts, future)
            elif op == "usage":
                self._reply_when(call_id, *admin.begin_usage(arg))
            elif op == "sweep":
                self._reply_when(call_id, None, admin.begin_sweep())
            elif op == "check_keys":  # the periodic fleet key check (AsyncEngine.check_keys)
                future = admin.begin_check_keys()
                if future is None:
                    self._reply_when(call_id, None)
                else:
                    self._waiting += 1

                    def applied(f: Future) -> None:  # revocations go through the engine thread
                        def apply() -> None:
                            self._waiting -= 1
                            self._apply_revocations()
                            self.send(["reply", call_id, True, None])

                        self._soon.put(apply)

                    future.add_done_callback(applied)
            elif op == "check_integrity":
                self._reply_when(call_id, admin.integrity_report())
            elif op == "metrics":
                from kvtier.server.metrics import EngineCollector

                self._reply_when(call_id, pickle.dumps(list(EngineCollector(self.core).collect())))
            else:
                raise ValueError(f"unknown engine call {op!r}")
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self.send(["reply", call_id, False, [type(e).__name__, str(e)]])


def engine_main() -> int:
    """The engine process (`python -m kvtier.server.engine_proc`): settings as one JSON line on
    stdin, which stays open until the server goes."""
    settings = json.loads(sys.stdin.readline())
    logging.basicConfig(
        level=settings.get("log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s",
    )
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(settings["to_engine"])
    push = ctx.socket(zmq.PUSH)
    push.connect(settings["from_engine"])
    import msgspec

    enc = msgspec.msgpack.Encoder()

    def watch_parent() -> None:  # stdin's EOF: the server is gone, so is this process's reason to run
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_parent, name="kvtier-parent-watch", daemon=True).start()
    try:
        from kvtier import LLM

        llm = LLM(settings["model"], **settings["engine_kwargs"])
        core = llm.engine
        fleet = settings.get("fleet_keys")
        if fleet:
            core.admin.use_fleet_keys(fleet[0], fleet[1])
        for tenant, ttl in settings.get("tenant_ttls", []):
            core.set_tenant_ttl(tenant, ttl)
        for tenant, host_bytes, disk_bytes in settings.get("tenant_quotas", []):
            core.set_tenant_quota(tenant, host_bytes, disk_bytes)
    except BaseException as e:
        bad_config = isinstance(e, ValueError)  # e.g. a master key the fleet does not use: one line
        if bad_config:
            logger.error("the engine could not start: %s", e)
        else:
            logger.exception("the engine could not start")
        push.send(enc.encode(["fatal", f"{type(e).__name__}: {e}", bad_config]))
        push.close(linger=2000)
        return 1
    plan = core.thread_plan
    push.send(
        enc.encode(
            [
                "ready",
                {
                    "max_model_len": core.max_model_len,
                    "has_tiers": core.admin.has_tiers,
                    "threads": plan.describe() if plan is not None else None,
                    "pid": os.getpid(),
                },
            ]
        )
    )
    loop = _EngineLoop(core, pull, push)
    try:
        loop.run()
    finally:
        core.close()
        push.close(linger=2000)
        pull.close(linger=0)
    return 0


# ---------------------------------------------------------------------------------- server side
class EngineClient:
    """The server's handle on the engine process: AsyncEngine's interface (add, abort, purge,
    usage, sweep, check_integrity, alive) over ZMQ. `start_process()` before the event loop
    (blocks until the model is loaded), `start()` on it."""

    is_engine_process = True

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        *,
        tenant_ttls: list | None = None,
        tenant_quotas: list | None = None,
        fleet_keys: tuple[str, float] | None = None,
        log_level: str = "info",
        on_finished: Callable[[RequestOutput, list[float]], None] | None = None,
        on_dead: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.settings = {
            "tenant_ttls": tenant_ttls or [],
            "tenant_quotas": tenant_quotas or [],
            "fleet_keys": list(fleet_keys) if fleet_keys else None,
            "log_level": log_level,
        }
        self.on_finished = on_finished
        self.on_dead = on_dead
        self.info: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._live: dict[str, _ClientLive] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start_process(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        import msgspec
        import zmq

        self._dir = tempfile.mkdtemp(prefix="kvtier-engine-")  # 0700
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._push = ctx.socket(zmq.PUSH)
        self._push.bind(f"ipc://{self._dir}/to-engine")
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/from-engine")
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        settings = {
            **self.settings,
            "model": self.model,
            "engine_kwargs": self.engine_kwargs,
            "to_engine": f"ipc://{self._dir}/to-engine",
            "from_engine": f"ipc://{self._dir}/from-engine",
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.server.engine_proc"], stdin=subprocess.PIPE, close_fds=True
        )
        stdin = self._proc.stdin
        assert stdin is not None  # stdin=PIPE
        stdin.write((json.dumps(settings) + "\n").encode())
        stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._pull.poll(200):
                msg = self._dec.decode(self._pull.recv())
                if msg[0] == "fatal":
                    self._cleanup()
                    error = ValueError if len(msg) > 2 and msg[2] else RuntimeError  # ValueError: the CLI's one line
                    raise error(f"the engine process could not start: {msg[1]}")
                if msg[0] == "ready":
                    self.info = msg[1]
                    logger.info("engine process %s ready (%s)", self._proc.pid, self.info.get("threads"))
                    return self.info
            if self._proc.poll() is not None:
                self._cleanup()
                raise RuntimeError(f"the engine process exited with status {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                self._cleanup()
                raise RuntimeError(f"the engine process was not ready within {timeout_s:.0f} s")

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def has_tiers(self) -> bool:
        return bool(self.info.get("has_tiers"))

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.error is None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        import zmq.asyncio

        self._loop = loop or asyncio.get_running_loop()
        self._apull = zmq.asyncio.Socket.from_socket(self._pull)
        self._tasks.append(self._loop.create_task(self._reader()))
        threading.Thread(target=self._watch, name="kvtier-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        proc = self._proc
        assert proc is not None  # start() follows start_process()
        status = proc.wait()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._died, status)
            except RuntimeError:
                pass

    def _died(self, status: int) -> None:
        if self._stopping:
            return
        self.error = EngineDeadError(f"the engine process exited with status {status}")
        logger.error("the engine process died (status %s); failing %d requests in flight", status, len(self._live))
        self._fail_all(self.error)
        if self.on_dead is not None:
            self.on_dead()

    def _fail_all(self, error: BaseException) -> None:
        for live in self._live.values():
            live.stream._put(error)
        self._live.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (it aborts what is in flight) and wait for it."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._push.send(self._enc.encode(["call", -1, "stop", None]))
                self._proc.wait(timeout_s)
            except Exception:  # noqa: BLE001 - it did not stop: make it
                self._proc.kill()
                self._proc.wait(5)
        self._cleanup()

    def _cleanup(self) -> None:
        for sock in ("_push", "_pull"):
            s = getattr(self, sock, None)
            if s is not None:
                s.close(linger=0)
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ messages
    async def _reader(self) -> None:
        while True:
            try:
                raw = await self._apull.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the socket closed
                return
            msg = self._dec.decode(raw)
            kind = msg[0]
            if kind == "out":
                self._deliver(msg[1])
            elif kind == "reply":
                _, call_id, ok, payload = msg
                fut = self._calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(payload)
                    else:
                        name, text = payload
                        fut.set_exception(ValueError(text) if name == "ValueError" else RuntimeError(f"{name}: {text}"))
            elif kind == "fail":
                _, rids, text = msg
                for rid in rids:
                    live = self._live.pop(rid, None)
                    if live is not None:
                        live.stream._put(EngineStepError(text))

    def _deliver(self, batch: list[list[Any]]) -> None:
        now = time.monotonic()
        for item in batch:
            live = self._live.get(item[0])
            if live is None:
                continue
            out = live.apply(item)
            n = sum(len(c.token_ids) for c in out.outputs)
            if n > live.num_tokens:
                if live.num_tokens:
                    live.itl_s.append(now - live.last_token_time)
                live.num_tokens, live.last_token_time = n, now
            live.stream._put(out)
            if out.finished:
                del self._live[out.request_id]
                if self.on_finished is not None:
                    try:
                        self.on_finished(out, live.itl_s)
                    except Exception:
                        logger.exception("on_finished hook failed")

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(
                f"the engine is not running ({self.error})" if self.error else "the engine is not running"
            )

    async def _call(self, kind: str, *payload: Any) -> Any:
        self._check_alive()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._push.send(self._enc.encode([kind, call_id, *payload]))
        return await fut

    # ------------------------------------------------------------------ AsyncEngine's interface
    async def add(self, specs: list[RequestSpec]) -> list[RequestStream]:
        streams = [RequestStream(s.request_id) for s in specs]
        for s, stream in zip(specs, streams):
            self._live[s.request_id] = _ClientLive(stream, s, last_token_time=time.monotonic())
        wire = [
            [
                s.request_id,
                s.prompt_token_ids,
                dataclasses.asdict(s.params),
                s.cache_salt,
                s.priority,
                s.prompt,
                s.tenant,
                s.arrival_time,
            ]
            for s in specs
        ]
        try:
            await self._call("add", wire)
        except BaseException:
            for s in specs:
                self._live.pop(s.request_id, None)
                self.abort(s.request_id)  # added or not: an abort of an unknown id is a no-op
            raise
        return streams

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._push.send(self._enc.encode(["abort", request_id]))

    async def purge(self, tenant: str | None, every_tenant: bool = False) -> dict[str, Any]:
        return await self._call("call", "purge", [tenant, every_tenant])

    async def usage(self, tenant: str | None) -> dict[str, Any]:
        return await self._call("call", "usage", tenant)

    async def sweep(self) -> None:
        await self._call("call", "sweep", None)

    @property
    def key_check_interval_s(self) -> float | None:
        """AsyncEngine.key_check_interval_s (from the fleet_keys setting)."""
        fleet: Any = self.settings["fleet_keys"]
        return None if not fleet else float(fleet[1])

    async def check_keys(self) -> None:
        """AsyncEngine.check_keys, in the engine process."""
        await self._call("call", "check_keys", None)

    async def check_integrity(self) -> dict[str, Any]:
        try:
            return await self._call("call", "check_integrity", None)
        except RuntimeError as e:
            if str(e).startswith("AssertionError"):
                raise AssertionError(str(e).split(": ", 1)[-1]) from None
            raise

    async def metric_families(self) -> list[Any]:
        """The engine's Prometheus families (kvtier.server.metrics.EngineCollector), now."""
        return pickle.loads(await self._call("call", "metrics", None))


if __name__ == "__main__":
    sys.exit(engine_main())
