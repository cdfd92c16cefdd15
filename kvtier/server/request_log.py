"""`--request-log FILE`: one JSON line per finished request, for traffic analysis; and
`--enable-log-requests` (RequestLogger): each request as it arrives, in the log.

Token ids, timestamps (wall clock, seconds), a hash of the tenant, cached tokens by tier, the
restore decision. No text unless `include_text` (KV and prompts are user data).

`write` is called on the engine thread for every finished request, so it only queues the
output: a writer thread builds the JSON line and appends it (a slow or full disk delays the
log, never a stream). `close` writes what is queued.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import stat
import threading
import time
from typing import Any

from kvtier.outputs import RequestOutput

logger = logging.getLogger("kvtier.server")


def open_private_log(path: str) -> Any:
    """Open `path` for appending, owner-only (0600) like every file of user data: created 0600
    whatever the umask, an existing file narrowed to 0600, one of another user refused."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(f"--request-log {path} is owned by uid {st.st_uid}: choose a file of your own")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8", buffering=1)
    except BaseException:
        os.close(fd)
        raise


class RequestLog:
    def __init__(self, path: str, include_text: bool = False) -> None:
        self.path = path
        self.include_text = include_text
        self._file = open_private_log(path)
        self._lock = threading.Lock()
        self._tenants: dict[str, str] = {}
        # RequestMetrics holds monotonic times; the log wants wall-clock ones
        self._wall_minus_mono = time.time() - time.monotonic()
        self._queue: queue.SimpleQueue[tuple[RequestOutput, str | None] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-request-log", daemon=True)
        self._writer.start()

    def register(self, request_id: str, tenant_hash: str) -> None:
        with self._lock:
            self._tenants[request_id] = tenant_hash

    def write(self, out: RequestOutput, itl_s: list[float] | None = None) -> None:
        """Queue one finished request's line (returns at once; the writer thread appends it)."""
        with self._lock:
            tenant = self._tenants.pop(out.request_id, None)
        self._queue.put((out, tenant))

    def _line(self, out: RequestOutput, tenant: str | None) -> str:
        m = out.metrics
        off = self._wall_minus_mono
        rec: dict[str, Any] = {
            "request_id": out.request_id,
            "tenant": tenant,
            "arrival_time": round(m.arrival_time + off, 6),
            "first_token_time": None if m.first_token_time is None else round(m.first_token_time + off, 6),
            "finished_time": None if m.finished_time is None else round(m.finished_time + off, 6),
            "prompt_token_ids": out.prompt_token_ids,
            "output_token_ids": [c.token_ids for c in out.outputs],
            "finish_reasons": [c.finish_reason for c in out.outputs],
            "num_cached_tokens": out.num_cached_tokens,
            "cached_tokens_by_tier": out.cached_tokens_by_tier,
            "restore_decision": out.restore_decision,
        }
        if self.include_text:
            rec["prompt"] = out.prompt
            rec["output_text"] = [c.text for c in out.outputs]
        return json.dumps(rec, separators=(",", ":"))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                line = self._line(*item)
                self._file.write(line + "\n")
            except Exception:
                logger.exception("request log: could not write a line to %s", self.path)

    def close(self) -> None:
        """Write what is queued, then close the file."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(30.0)
        self._file.close()


class RequestLogger:
    """vLLM's --enable-log-requests, as vLLM 0.32 logs: each engine request at INFO with its
    sampling params and prompt length, and at DEBUG its prompt (text and token ids, each cut
    to `max_log_len` characters / ids: --max-log-len; None: whole). Prompts are user data, so
    they need --log-level debug, as in vLLM."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len
        self.logger = logging.getLogger("kvtier.server.requests")
        if not self.logger.isEnabledFor(logging.INFO):
            self.logger.warning(
                "--enable-log-requests is set but the log level is above INFO: no request will be logged"
            )

    def log(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            cut = self.max_log_len
            self.logger.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s.",
                request_id,
                prompt if cut is None or prompt is None else prompt[:cut],
                prompt_token_ids if cut is None else prompt_token_ids[:cut],
            )
        self.logger.info(
            "Received request %s: params: %s, num_prompt_tokens: %d.", request_id, params, len(prompt_token_ids)
        )
