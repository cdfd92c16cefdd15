"""Request-supplied chat templates (--trust-request-chat-template) rendered in worker
processes of their own.

A request's template is arbitrary Jinja: RenderLimits bounds its output, its `range()` work
and its time, but while it runs on a thread of the server it still holds the server's GIL,
and the event loop (and an in-process engine thread) wait behind it for whole switch
intervals each time they want it back. In a worker process it shares nothing: the server's
thread only waits on a pipe. Each worker's address space is capped (`memory_bytes`,
RLIMIT_AS), so a template that allocates past the size checks fails with a MemoryError there,
not in the server. A render that does not come back within its time limit plus a margin
(a worker killed, or stuck in C code the deadline cannot interrupt) tears the pool down; the
next render starts a fresh one. Workers are spawned at the first request template (about
0.1 s) and reused.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any

from jinja2.sandbox import SecurityError

from kvtier.model.tokenizer import RenderLimits, TokenizerError, render_request_template

logger = logging.getLogger(__name__)

MARGIN_S = 5.0
"""How much longer than RenderLimits.timeout_s a render may take to come back (spawning a
worker, pickling) before its pool is torn down."""


def _render_in_worker(*args: Any) -> tuple[str, str]:
    """In the worker: ("ok", text), or (kind, message) for a failure (exceptions travel as
    text: not every jinja2 exception survives pickling)."""
    from jinja2 import TemplateError

    try:
        return "ok", render_request_template(*args)
    except TokenizerError as e:
        return "tokenizer", str(e)
    except MemoryError:
        return "memory", ""
    except TemplateError as e:
        return "template", str(e)
    except Exception as e:  # noqa: BLE001 - a bug, not the template's fault: comes back as text, raised there
        return "error", f"{type(e).__name__}: {e}"


def _cap_memory(memory_bytes: int) -> None:
    """Pool initializer: cap the worker's address space."""
    import resource

    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


class TemplateProcesses:
    """`render(...)`: render_request_template in one of `workers` spawned processes. Blocks
    the calling thread (a render-pool thread, never the event loop) until it is done; raises
    what the render raised: TokenizerError (the messages), or jinja2's SecurityError (a
    TemplateError) for the template's own failures and for running out of memory or time."""

    def __init__(self, workers: int = 2, memory_bytes: int = 1 << 30) -> None:
        self.workers = workers
        self.memory_bytes = memory_bytes
        self._pool: Any = None
        self._lock = threading.Lock()

    def _get_pool(self) -> Any:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")
                self._pool = ctx.Pool(self.workers, initializer=_cap_memory, initargs=(self.memory_bytes,))
            return self._pool

    def _discard(self, pool: Any) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.terminate()

    def render(
        self,
        chat_template: str,
        bos_token: str | None,
        eos_token: str | None,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict] | None,
        continue_final_message: bool,
        kwargs: dict[str, Any],
        limits: RenderLimits | None = None,
    ) -> str:
        limits = limits or RenderLimits()
        pool = self._get_pool()
        args = (
            chat_template,
            bos_token,
            eos_token,
            messages,
            add_generation_prompt,
            tools,
            continue_final_message,
            limits,
            kwargs,
        )
        pending = pool.apply_async(_render_in_worker, args)
        try:
            kind, text = pending.get(timeout=limits.timeout_s + MARGIN_S)
        except multiprocessing.TimeoutError:
            logger.warning(
                "a request's chat template did not come back from its worker process within %g s; "
                "the template workers are restarted",
                limits.timeout_s + MARGIN_S,
            )
            self._discard(pool)
            raise SecurityError(f"the chat template ran past its {limits.timeout_s:g} s limit") from None
        if kind == "ok":
            return text
        if kind == "tokenizer":
            raise TokenizerError(text)
        if kind == "memory":
            raise SecurityError(f"the chat template used more than {self.memory_bytes >> 20} MiB of memory")
        if kind == "template":
            raise SecurityError(text)
        raise RuntimeError(f"the chat template worker failed: {text}")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
