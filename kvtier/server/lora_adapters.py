"""LoRA adapters as `kvtier serve` serves them (vLLM's OpenAIServingModels, its LoRA part): each
adapter is a model id that clients pass as `model`; a request naming one runs the base model with
that adapter (kvtier.lora), and its answer carries the adapter's name.

    --lora-modules a=DIR b=DIR      loaded by the engine at startup (ids 1..n)
    POST /v1/load_lora_adapter      admin: {"lora_name", "lora_path"}, loaded by the engine first
    POST /v1/unload_lora_adapter    admin: {"lora_name"}; later requests naming it get a 404
    GET  /v1/models                 a card per adapter: id (its name), root (its path), parent

Every load gets an id never used before, so a name loaded again (after an unload, or in place)
is read from its files afresh. Its KV never meets another adapter's, whatever the names: block
keys carry the adapter's content digest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.engine.client import EngineClient, EngineDeadError
from kvtier.lora import LoRARequest
from kvtier.server.protocol import APIError

logger = logging.getLogger("kvtier.server")


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    request: LoRARequest
    parent: str
    """The base model's served name (vLLM's ModelCard.parent)."""
    created: int
    """When it was loaded (Unix seconds)."""


class LoRAAdapters:
    """The adapters this server serves, by name. `enabled`: the engine runs with enable_lora
    (--enable-lora); without it every load is a 400 saying so. Event loop only; loads and
    unloads run one at a time."""

    def __init__(self, engine: EngineClient, base_names: tuple[str, ...], enabled: bool) -> None:
        self.engine = engine
        self.base_names = base_names
        """The base model's served names (the first is every adapter's default parent)."""
        self.enabled = enabled
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def check_enabled(self) -> None:
        """A 400 unless the engine serves LoRA."""
        if not self.enabled:
            raise APIError(
                "LoRA is off on this server: start kvtier serve with --enable-lora to load adapters",
                code="lora_not_enabled",
            )

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served as `name`, or None."""
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.request

    def cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries, as vLLM's."""
        return [
            {
                "id": name,
                "object": "model",
                "created": a.created,
                "owned_by": "kvtier",
                "root": a.request.lora_path,
                "parent": a.parent,
                "max_model_len": max_model_len,
            }
            for name, a in self._adapters.items()
        ]

    async def load_modules(self, modules: tuple[tuple[str, str, str | None], ...]) -> None:
        """--lora-modules, in order (ids 1..n); a ValueError naming the first that cannot load."""
        for name, path, base_model_name in modules:
            try:
                await self.load(name, path, base_model_name)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None

    async def load(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """Have the engine load the adapter in `path` and serve it as `name`; `replace`: an
        adapter loaded under this name is replaced (vLLM's load_inplace). APIError: 400 for a
        name taken or an adapter the engine refuses (its reason), 404 for a path with no
        adapter (vLLM's), 503 when the engine is gone."""
        self.check_enabled()
        if not name or not path:
            raise APIError(
                "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name" if not name else "lora_path"
            )
        if name in self.base_names:
            raise APIError(f"the LoRA adapter name {name!r} conflicts with a served base model", param="lora_name")
        async with self._lock:
            if name in self._adapters and not replace:
                raise APIError(
                    f"the LoRA adapter {name!r} has already been loaded; unload it first, or set "
                    "load_inplace to true to replace it",
                    param="lora_name",
                )
            root = Path(path)
            if not (root / "adapter_config.json").is_file():
                raise APIError(
                    f"Loading lora {name} failed: No adapter found for {path} (give the directory "
                    "PEFT's save_pretrained wrote, with adapter_config.json, on the server's machine)",
                    404,
                    type="not_found_error",
                    param="lora_path",
                    code="lora_adapter_not_found",
                )
            parent = self.base_names[0]
            if base_model_name is not None:
                if base_model_name in self.base_names:
                    parent = base_model_name
                else:
                    logger.warning(
                        "LoRA adapter %r: base_model_name %r is not a served model name; its parent is %r",
                        name,
                        base_model_name,
                        parent,
                    )
            request = LoRARequest(name, next(self._ids), path, base_model_name=parent)
            try:
                await self.engine.load_lora(request)
            except ValueError as e:
                raise APIError(str(e), param="lora_path", code="invalid_lora_adapter") from None
            except EngineDeadError as e:
                raise APIError(str(e), 503, type="server_error") from None
            self._adapters[name] = ServedAdapter(request, parent, int(time.time()))
        logger.info("Loaded LoRA adapter %r from %s (id %d)", name, path, request.lora_int_id)
        return request

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """Stop serving `name`: later requests naming it get a 404 (those running finish with
        it). A 404 for a name not loaded, or not under `lora_int_id` when that is given."""
        self.check_enabled()
        async with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None or (lora_int_id is not None and adapter.request.lora_int_id != lora_int_id):
                shown = name if len(name) <= 100 else name[:100] + "..."
                under = "" if lora_int_id is None or adapter is None else f" under id {lora_int_id}"
                raise APIError(
                    f"The lora adapter '{shown}' cannot be found{under}.",
                    404,
                    type="not_found_error",
                    param="lora_name",
                    code="lora_adapter_not_found",
                )
            del self._adapters[name]
        logger.info("Unloaded LoRA adapter %r", name)
