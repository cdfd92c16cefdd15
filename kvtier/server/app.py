"""The FastAPI app of `kvtier serve`: routes, body limits, OpenAI-style errors, lifecycle.

    POST /v1/completions        POST /v1/chat/completions       GET /v1/models
    GET  /health                GET  /metrics                   POST /admin/check_integrity

Every error a client can cause is a 4xx with `{"error": {"message", "type", "param", "code"}}`
and no stack trace; anything else is a 500 in the same shape (the trace goes to the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvtier.server.async_engine import AsyncEngine
from kvtier.server.metrics import ServerMetrics
from kvtier.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                    validation_error)
from kvtier.server.serving import ClientGone, OpenAIServing
from kvtier.server.tenancy import SingleTenantResolver, Tenant, TenantResolver, api_key_from_header

logger = logging.getLogger("kvtier.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `kvtier serve`."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kvtier"
    """The model id clients pass as `model` (and /v1/models lists)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get a 413."""
    ttl_sweep_interval_s: float = 10.0
    """How often tenants' TTLs are enforced in every tier."""


def build_app(engine: Any, tokenizer: Any, config: ServerConfig,
              tenants: TenantResolver | None = None, request_log: Any = None) -> FastAPI:
    """An app serving `engine` (an EngineCore, owned by the app's engine thread from startup
    until shutdown; the caller closes it afterwards). `request_log`: a RequestLog or None."""
    metrics = ServerMetrics(engine)

    def on_finished(out: Any, itl_s: list[float]) -> None:
        metrics.observe_finished(out, itl_s)
        if request_log is not None:
            request_log.write(out, itl_s)

    async_engine = AsyncEngine(engine, on_finished=on_finished)
    serving = OpenAIServing(async_engine, tokenizer, config.served_model_name, engine.max_model_len,
                            request_log=request_log)
    resolver = tenants or SingleTenantResolver()
    created = int(time.time())

    ttl_tenants = [t for t in getattr(resolver, "tenants", lambda: [])() if t.ttl_s is not None]
    for t in ttl_tenants:
        engine.set_tenant_ttl(t.name, t.ttl_s)
    for t in getattr(resolver, "tenants", lambda: [])():
        if t.host_bytes is not None or t.disk_bytes is not None:
            engine.set_tenant_quota(t.name, t.host_bytes, t.disk_bytes)

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(config.ttl_sweep_interval_s)
            try:
                await async_engine.run_soon(lambda core: core.sweep_expired())
            except Exception:  # noqa: BLE001 - keep sweeping; the engine reports its own death
                logger.exception("TTL sweep failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        task = asyncio.ensure_future(sweeper()) if ttl_tenants else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            async_engine.shutdown()

    app = FastAPI(title="kvtier", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = async_engine
    app.state.metrics = metrics
    _install_error_handlers(app)

    def tenant_of(request: Request) -> Tenant:
        try:
            return resolver.resolve(api_key_from_header(request.headers.get("authorization")))
        except PermissionError as e:
            raise APIError(str(e) or "invalid API key", 401, type="authentication_error",
                           code="invalid_api_key") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await read_json(request, config.max_body_bytes)
        return await serving.completions(_validate(CompletionRequest, body), tenant, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await read_json(request, config.max_body_bytes)
        return await serving.chat(_validate(ChatCompletionRequest, body), tenant, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": created,
            "owned_by": "kvtier", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return JSONResponse({"status": "engine not running"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def cache_target(request: Request) -> str:
        """The tenant a /v1/cache call acts on: the caller's, or with an admin key any named one."""
        tenant = tenant_of(request)
        named = request.query_params.get("tenant")
        if named is None or named == tenant.name:
            return tenant.name
        if not tenant.admin:
            raise APIError("only an admin key may name another tenant", 403, type="permission_error",
                           code="forbidden")
        return named

    @app.delete("/v1/cache")
    async def purge_cache(request: Request) -> Response:
        """Delete the caller's KV from every tier and destroy its data key (admin: ?tenant=NAME)."""
        if request.query_params.get("all") in ("1", "true"):
            if not isinstance(resolver, SingleTenantResolver) and not tenant_of(request).admin:
                raise APIError("only an admin key may purge every tenant", 403, type="permission_error",
                               code="forbidden")
            counts = await async_engine.run_soon(lambda core: core.purge_all())
            destroyed = counts.pop("keys_destroyed", 0)
            return JSONResponse({"object": "cache.purge", "tenant": None, "deleted_blocks": counts,
                                 "data_keys_destroyed": destroyed})
        target = cache_target(request)
        counts = await async_engine.run_soon(lambda core: core.purge_tenant(target))
        destroyed = bool(counts.pop("key_destroyed", 0))
        return JSONResponse({"object": "cache.purge", "tenant": target, "deleted_blocks": counts,
                             "data_key_destroyed": destroyed})

    @app.get("/v1/cache")
    async def cache_usage(request: Request) -> Response:
        """The caller's cached KV per tier (blocks, bytes where known)."""
        target = cache_target(request)
        usage = await async_engine.run_soon(lambda core: core.tenant_usage(target))
        return JSONResponse({"object": "cache.usage", "tenant": target, "tiers": usage})

    @app.post("/admin/check_integrity")
    async def check_integrity(request: Request) -> Response:
        """Runs the engine's invariant checks once it is idle (for load tests). With API keys,
        only an admin key may call it."""
        if not isinstance(resolver, SingleTenantResolver) and not tenant_of(request).admin:
            raise APIError("this endpoint needs an admin API key", 403, type="permission_error",
                           code="forbidden")
        def check(core: Any) -> dict[str, Any]:
            core.check_integrity()
            return {"ok": True, "kv_cache_usage_perc": core.kv.usage,
                    "num_free_blocks": core.kv.num_free_blocks, "num_blocks": core.kv.num_blocks,
                    "num_unfinished": core.num_unfinished}
        try:
            return JSONResponse(await async_engine.run_when_idle(check))
        except AssertionError as e:
            body = APIError(f"integrity check failed: {e}", 500, type="integrity_error").body()
            return JSONResponse({"ok": False, **body}, 500)

    return app


# ------------------------------------------------------------------ bodies and errors
async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past `max_bytes` (the rest is read and dropped,
    up to a bound, so the client sees the answer rather than a reset connection)."""
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > max_bytes
    body = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_bytes:
            too_big = True
        if too_big:
            body.clear()
            if seen > 16 * max_bytes:
                break
        else:
            body += chunk
    if too_big:
        raise APIError(f"the request body is larger than {max_bytes} bytes (--max-body-bytes)",
                       413, code="request_too_large")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the body is not valid JSON: {e}", 400, code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError("the body must be a JSON object", 400, code="invalid_json")
    return obj


def _validate(model: Any, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, e: RequestValidationError) -> Response:
        return JSONResponse(APIError(str(e.errors()[:1]), 400).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(str(e.detail), e.status_code, type=kind).body(), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        logger.exception("internal error serving %s", request.url.path)
        return JSONResponse(APIError("internal server error", 500, type="server_error").body(), 500)


def run_server(engine: Any, tokenizer: Any, config: ServerConfig, log_level: str = "info",
               tenants: TenantResolver | None = None, request_log: Any = None) -> None:
    """Serve until interrupted (uvicorn; one process, one engine thread)."""
    import uvicorn

    app = build_app(engine, tokenizer, config, tenants=tenants, request_log=request_log)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=5)
