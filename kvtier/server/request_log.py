"""`--request-log FILE`: one JSON line per finished request, for traffic analysis.

Token ids, timestamps (wall clock, seconds), a hash of the tenant, cached tokens by tier, the
restore decision. No text unless `include_text` (KV and prompts are user data).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from kvtier.outputs import RequestOutput


class RequestLog:
    def __init__(self, path: str, include_text: bool = False) -> None:
        self.path = path
        self.include_text = include_text
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self._tenants: dict[str, str] = {}
        # RequestMetrics holds monotonic times; the log wants wall-clock ones
        self._wall_minus_mono = time.time() - time.monotonic()

    def register(self, request_id: str, tenant_hash: str) -> None:
        with self._lock:
            self._tenants[request_id] = tenant_hash

    def write(self, out: RequestOutput, itl_s: list[float] | None = None) -> None:
        m = out.metrics
        off = self._wall_minus_mono
        with self._lock:
            tenant = self._tenants.pop(out.request_id, None)
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
        line = json.dumps(rec, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
