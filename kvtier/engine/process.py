"""The engine core in its own process: the ZMQ transport of kvtier.engine.loop.EngineLoop, the
process's entry point (`engine_main`, run as `python -m kvtier.server.engine_proc`) and the
server's side of it (ProcessEngineClient).

    API server process (asyncio)                    engine process (its main thread steps)
    ----------------------------                    ---------------------------------------
    HTTP, tenancy, tokenization, validation
    ProcessEngineClient  --- ToEngine (msgpack) --> EngineLoop over a ZmqTransport
                         <-- FromEngine ----------  one Outputs message per step (deltas)

The HTTP event loop, JSON, tokenization and detokenization no longer share an interpreter (and
its lock) with the model's steps, as in vLLM's EngineCore process. Transport: two ZMQ PUSH/PULL
sockets over ipc:// in a private (0700) folder, kvtier.engine.protocol messages in msgpack.

The engine process is started with the server's settings as JSON on its stdin and keeps stdin
open: EOF means the server died, and the engine exits. When the engine process dies (a crash,
the OOM killer), every open stream and pending call gets `EngineDeadError` (a 500 to the
client, not a hang), `alive` turns false, and `on_dead` runs: `kvtier serve` then shuts the
server down with exit status 1, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from kvtier.engine import protocol
from kvtier.engine.admin import EngineStats
from kvtier.engine.client import EngineClient, EngineDeadError, FinishedHook
from kvtier.engine.loop import EngineLoop
from kvtier.engine.protocol import Fatal, FromEngine, Ready

logger = logging.getLogger("kvtier.server")

READY_TIMEOUT_S = 600.0
"""Longest wait for the engine process to load the model."""

ENGINE_MODULE = "kvtier.server.engine_proc"
"""What the engine process runs (`python -m`; its command line names it)."""


class ZmqTransport:
    """The engine process's end: commands from a PULL socket, messages to a PUSH socket, both
    msgpack-encoded protocol Structs. `receive` on the engine's main thread only; `send` from
    it and from the tiers' admin worker (serialised by a lock; ZMQ sockets are not thread-safe)."""

    def __init__(self, pull: Any, push: Any) -> None:
        self.pull = pull
        self.push = push
        self._lock = threading.Lock()

    def receive(self, timeout_s: float | None) -> list[Any]:
        cmds: list[Any] = []
        if not self.pull.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return cmds
        while True:
            try:
                raw = self.pull.recv(flags=1)  # zmq.NOBLOCK
            except Exception:  # noqa: BLE001 - zmq.Again: drained
                return cmds
            cmds.append(protocol.decode_to_engine_or_error(raw))

    def send(self, msg: FromEngine) -> None:
        raw = protocol.encode(msg)
        with self._lock:
            self.push.send(raw)


def engine_main() -> int:
    """The engine process: settings as one JSON line on stdin, which stays open until the
    server goes."""
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
    transport = ZmqTransport(pull, push)

    def watch_parent() -> None:  # stdin's EOF: the server is gone, so is this process's reason to run
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_parent, name="kvtier-parent-watch", daemon=True).start()
    try:
        from kvtier.threads.wait import apply_wait_policy

        apply_wait_policy()  # before kvtier.llm loads torch (and libgomp reads the policy)
        from kvtier.llm import LLM

        core = LLM(settings["model"], **settings["engine_kwargs"]).engine
        fleet = settings.get("fleet_keys")
        core.admin.apply_settings(
            settings.get("tenant_ttls", []), settings.get("tenant_quotas", []), tuple(fleet) if fleet else None
        )
    except BaseException as e:
        # a setting's fault (a master key the fleet does not use, a missing checkpoint file): the
        # starting process says it in one line, so no second line (or traceback) here
        bad_config = isinstance(e, (ValueError, OSError, ImportError))
        if bad_config:
            logger.debug("the engine could not start: %s", e)
        else:
            logger.exception("the engine could not start")
        transport.send(Fatal(f"{type(e).__name__}: {e}", bad_config))
        push.close(linger=2000)
        return 1
    plan = core.thread_plan
    transport.send(
        Ready(
            core.max_model_len,
            core.admin.has_tiers,
            core.admin.key_check_interval_s,
            plan.describe() if plan is not None else None,
            os.getpid(),
        )
    )
    try:
        EngineLoop(core, transport).run()
    finally:
        core.close()
        push.close(linger=2000)
        pull.close(linger=0)
    return 0


class ProcessEngineClient(EngineClient):
    """The server's handle on the engine process. `start_process()` before the event loop
    (blocks until the model is loaded), `start()` on it. Threads: a reader task on the event
    loop decodes the engine's messages; a watcher thread waits for the process to exit. The
    metrics scrape asks the engine for its EngineStats (`fetch_stats`) and renders that copy."""

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        *,
        tenant_ttls: list | None = None,
        tenant_quotas: list | None = None,
        fleet_keys: tuple[str, float] | None = None,
        log_level: str = "info",
        on_finished: FinishedHook | None = None,
        on_dead: Any = None,
    ) -> None:
        super().__init__(on_finished, on_dead)
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.settings = {
            "tenant_ttls": tenant_ttls or [],
            "tenant_quotas": tenant_quotas or [],
            "fleet_keys": list(fleet_keys) if fleet_keys else None,
            "log_level": log_level,
        }
        self.info: Ready | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._stats: EngineStats | None = None

    # ------------------------------------------------------------------ lifecycle
    def start_process(self, timeout_s: float = READY_TIMEOUT_S) -> Ready:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="kvtier-engine-")  # 0700
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._push = ctx.socket(zmq.PUSH)
        self._push.bind(f"ipc://{self._dir}/to-engine")
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/from-engine")
        settings = {
            **self.settings,
            "model": self.model,
            "engine_kwargs": self.engine_kwargs,
            "to_engine": f"ipc://{self._dir}/to-engine",
            "from_engine": f"ipc://{self._dir}/from-engine",
        }
        self._proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE], stdin=subprocess.PIPE, close_fds=True)
        stdin = self._proc.stdin
        assert stdin is not None  # stdin=PIPE
        stdin.write((json.dumps(settings) + "\n").encode())
        stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._pull.poll(200):
                msg = protocol.decode_from_engine(self._pull.recv())
                if isinstance(msg, Fatal):
                    self._cleanup()
                    error = ValueError if msg.bad_config else RuntimeError  # ValueError: the CLI's one line
                    raise error(f"the engine process could not start: {msg.message}")
                if isinstance(msg, Ready):
                    self.info = msg
                    logger.info("engine process %s ready (%s)", self._proc.pid, msg.threads)
                    return msg
            if self._proc.poll() is not None:
                self._cleanup()
                raise RuntimeError(f"the engine process exited with status {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                self._cleanup()
                raise RuntimeError(f"the engine process was not ready within {timeout_s:.0f} s")

    def _ready(self) -> Ready:
        assert self.info is not None, "start_process() first"
        return self.info

    @property
    def max_model_len(self) -> int:
        return self._ready().max_model_len

    @property
    def has_tiers(self) -> bool:
        return self._ready().has_tiers

    @property
    def key_check_interval_s(self) -> float | None:
        return self._ready().key_check_interval_s

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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (it aborts what is in flight) and wait for it."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._send(protocol.AdminCall(-1, protocol.AdminOp.STOP))
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
    def _send(self, msg: Any) -> None:
        self._push.send(protocol.encode(msg))

    async def _reader(self) -> None:
        while True:
            try:
                raw = await self._apull.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the socket closed
                return
            self._receive(protocol.decode_from_engine(raw))

    # ------------------------------------------------------------------ metrics
    def stats_now(self) -> EngineStats | None:
        return self._stats

    async def fetch_stats(self) -> EngineStats | None:
        self._stats = protocol.stats_value(await self._admin(protocol.AdminOp.STATS))
        return self._stats
