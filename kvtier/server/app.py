"""The FastAPI app of `kvtier serve`: routes, body limits, OpenAI-style errors, lifecycle.

    POST /v1/completions        POST /v1/chat/completions       GET /v1/models
    POST /tokenize              POST /detokenize                GET /version
    GET /tokenizer_info (with --enable-tokenizer-info-endpoint)
    GET  /health, /ping         GET  /metrics                   POST /admin/check_integrity
    POST /invocations (SageMaker: chat, completions or Responses by the body's shape)
    GET  /load (requests in flight, with --enable-server-load-tracking)
    POST /reset_prefix_cache (admin)  DELETE, GET /v1/cache     GET /openapi.json, /docs, /redoc
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin; kvtier.server.lora_adapters)

As vLLM's server: CORS for --allowed-origins (default any origin: the API authenticates by
bearer key, never by cookie), and an `X-Request-Id` header becomes the response id's suffix
and is echoed back.

Every error a client can cause is a 4xx with `{"error": {"message", "type", "param", "code"}}`
and no stack trace; anything else is a 500 in the same shape (the trace goes to the log).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import Counter
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvtier.engine.client import EngineClient
from kvtier.engine.frontend import reset_prefix_cache as reset_engine_cache
from kvtier.server.http_limits import (
    HTTPLimits,
    KeyLimiter,
    RateLimited,
    default_max_connections,
    install_accept_error_filter,
    limited_h11_protocol,
    parse_rate,
    raise_nofile_limit,
)
from kvtier.server.lora_adapters import LoRAAdapters
from kvtier.server.metrics import PREFIX, ServerMetrics
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_json_object,
    validation_error,
)
from kvtier.server.responses_api import install_responses_api
from kvtier.server.serving import (
    ClientGone,
    OpenAIServing,
    RequestLimits,
    _CleanupStreamingResponse,
    valid_request_id,
)
from kvtier.server.tenancy import AdminAuth, SingleTenantResolver, Tenant, TenantResolver, api_key_from_header

logger = logging.getLogger("kvtier.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `kvtier serve`."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kvtier"
    """The model id clients pass as `model` (and /v1/models lists); responses carry it."""
    model_aliases: tuple[str, ...] = ()
    """More ids clients may pass as `model` (vLLM's --served-model-name with several names)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get a 413."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Prompts and sequences one request may ask for (--max-prompts/seqs-per-request)."""
    ttl_sweep_interval_s: float = 10.0
    """How often tenants' TTLs are enforced in every tier (and pending purges retried)."""
    admin_key: str | None = None
    """The bearer key of admin endpoints (--admin-key-file), beside keys marked admin in
    --api-keys. See tenancy.AdminAuth for who may call what."""
    metrics_auth: str = "public"
    """Who may read /metrics: 'public', 'api_key' (any valid key) or 'admin'."""
    metrics_names: str = "both"
    """The prefix of /metrics series: 'kvtier' (kvtier:...), 'vllm' (vllm:..., what vLLM's
    dashboards, alert rules and KV-aware routers read) or 'both'."""
    models_auth: str = "public"
    """Who may read /v1/models: 'public', 'api_key' or 'admin'."""
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    """Sampling defaults for what a request leaves out (generation_config.json: --generation-config)."""
    structured_defaults: tuple[tuple[str, Any], ...] = ()
    """--structured-outputs-config: disable_any_whitespace / disable_additional_properties for
    requests that do not set them."""
    tool_call_parser: str | None = None
    """--enable-auto-tool-choice --tool-call-parser NAME: tool_choice 'auto' reads tool calls
    out of the model's text in this format (kvtier.server.tools.PARSERS)."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS: origins a browser may call the API from (empty: no CORS headers)."""
    enable_tokenizer_info: bool = False
    """--enable-tokenizer-info-endpoint: GET /tokenizer_info (it shows the chat template)."""
    trust_request_chat_template: bool = False
    """--trust-request-chat-template: requests may carry their own `chat_template` (rendered in
    the bounded sandbox); without it such a request is a 400."""
    strict_request_fields: bool = False
    """--strict-request-fields: a completions or chat field the server does not know is a 400
    naming it (default: a warning in the log naming the ignored fields, as vLLM)."""
    header_timeout_s: float = 10.0
    """--header-timeout-s: a connection that has not sent a complete request head this long
    after connecting (or after its first byte of a keep-alive request) is closed (0: none)."""
    body_timeout_s: float = 30.0
    """--body-timeout-s: a request body that stalls this long between chunks gets a 408 and
    the connection closed (0: none)."""
    max_connections: int | None = None
    """--max-connections: connections beyond this get a 503 and are closed at once (None:
    min(RLIMIT_NOFILE - 64, 4096), after raising the soft limit to the hard one; 0: none)."""
    stream_stall_timeout_s: float | None = 30.0
    """--stream-stall-timeout-s: a stream that could send nothing this long (the client does
    not read) is aborted, its blocks freed (None or 0: none)."""
    max_concurrent_requests_per_key: int = 0
    """--max-concurrent-requests-per-key: requests in flight per API key (per client address
    without one, or when the server checks no keys: then any key passes); streams hold their
    slot until they end. More get a 429 (0: unbounded)."""
    rate_limit_per_key: str = "0"
    """--rate-limit-per-key: a token bucket per API key (client address without one), `RATE`
    or `RATE/s:burst=N` requests per second; over it a 429 with Retry-After ("0": none)."""
    rate_limit_pace_s: float = 1.0
    """--rate-limit-pace-s: a per-key 429 is held this long (never past its Retry-After)
    before it is sent (KeyLimiter.pace; 0: at once)."""
    enable_server_load_tracking: bool = False
    """--enable-server-load-tracking: GET /load counts the completions and chat requests in
    flight (streams until they end); off, it answers 0, as vLLM."""
    return_tokens_as_token_ids: bool = False
    """--return-tokens-as-token-ids: logprobs name tokens `token_id:N` unless a request's
    `return_tokens_as_token_ids` says otherwise."""
    response_role: str = "assistant"
    """--response-role: the role of chat replies when add_generation_prompt is true."""
    enable_force_include_usage: bool = False
    """--enable-force-include-usage: streams carry usage in every chunk and at the end even
    when the client did not ask (vLLM 0.32's meaning)."""
    enable_prompt_tokens_details: bool = False
    """--enable-prompt-tokens-details: accepted; kvtier reports usage.prompt_tokens_details
    (cached_tokens, by tier too) in every answer whether or not it is set."""
    enable_log_requests: bool = False
    """--enable-log-requests: each request's sampling params at INFO, its prompt at DEBUG
    (kvtier.server.request_log.RequestLogger)."""
    max_log_len: int | None = None
    """--max-log-len: logged prompts are cut to this many characters / token ids (None: whole)."""
    root_path: str = ""
    """--root-path: the path prefix a proxy serves the API under (FastAPI's root_path)."""
    ssl_keyfile: str | None = None
    """--ssl-keyfile: serve HTTPS with this private key (and --ssl-certfile)."""
    ssl_certfile: str | None = None
    """--ssl-certfile: the certificate (chain) served with --ssl-keyfile."""
    ssl_ca_certs: str | None = None
    """--ssl-ca-certs: CA certificates uvicorn loads (for client certificates)."""
    uvicorn_log_level: str | None = None
    """--uvicorn-log-level: uvicorn's own log level (None: the server's --log-level)."""
    disable_uvicorn_access_log: bool = False
    """--disable-uvicorn-access-log: no access log line per HTTP request."""
    enable_lora: bool = False
    """--enable-lora: the engine serves LoRA adapters; requests name them as `model`, and
    admins load and unload them (kvtier.server.lora_adapters)."""
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    """--lora-modules: (name, PEFT directory, base_model_name or None) of each adapter the
    engine loads at startup (ids 1..n, in order)."""

    def __post_init__(self) -> None:
        """Settings that cannot work are a ValueError (one line) before any model loads."""
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile (it applies to HTTPS)")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level {self.uvicorn_log_level!r}: one of {', '.join(UVICORN_LOG_LEVELS)}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path {self.root_path!r}: a path such as /api/llm (a leading /, no trailing /)")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len {self.max_log_len}: must be >= 0")
        if not self.response_role:
            raise ValueError("--response-role must not be empty")
        self._check_lora_modules()

    def _check_lora_modules(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora (as in vLLM)")
        seen: set[str] = set()
        for name, path, _ in self.lora_modules:
            if not name or name in seen:
                raise ValueError(f"--lora-modules: the name {name!r} is {'given twice' if name else 'empty'}")
            if name in (self.served_model_name, *self.model_aliases):
                raise ValueError(f"--lora-modules {name}={path}: {name!r} is a served name of the base model")
            if not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(
                    f"--lora-modules {name}={path}: no adapter_config.json there (give the directory "
                    "PEFT's save_pretrained wrote)"
                )
            seen.add(name)


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


MIN_KEY_CHECK_PERIOD_S = 0.1
"""The periodic fleet key check runs at most this often (--kv-key-check-interval-s 0 means
'on every admission'; the periodic check then runs every 0.1 s)."""


def tenant_settings(resolver: TenantResolver) -> tuple[list[tuple[str, float]], list[tuple[str, Any, Any]]]:
    """The TTLs and host/disk quotas the tenants file sets: ([(tenant, ttl_s)], [(tenant, host, disk)])."""
    tenants: list[Tenant] = getattr(resolver, "tenants", list)()
    ttls = [(t.name, t.ttl_s) for t in tenants if t.ttl_s is not None]
    quotas = [
        (t.name, t.host_bytes, t.disk_bytes) for t in tenants if t.host_bytes is not None or t.disk_bytes is not None
    ]
    return ttls, quotas


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    config: ServerConfig,
    tenants: TenantResolver | None = None,
    request_log: Any = None,
) -> FastAPI:
    """An app serving `engine`, an EngineClient not yet started (kvtier.engine.frontend.
    make_engine_client: the engine on a thread of this process or in its own, given the
    tenants' TTLs and quotas there); the app starts it at startup and shuts it down at
    shutdown. `request_log`: a RequestLog or None."""
    async_engine = engine
    metrics = ServerMetrics(
        async_engine.stats_now,
        model_name=config.served_model_name,
        names=config.metrics_names,
        max_model_len=async_engine.max_model_len,
    )

    def on_finished(out: Any, itl_s: list[float]) -> None:
        metrics.observe_finished(out, itl_s)
        if request_log is not None:
            request_log.write(out, itl_s)

    async_engine.on_finished = on_finished
    serving = OpenAIServing(
        async_engine,
        tokenizer,
        config.served_model_name,
        async_engine.max_model_len,
        request_log=request_log,
        limits=config.limits,
        model_aliases=config.model_aliases,
        on_added=metrics.note_request,
        sampling_defaults=dict(config.sampling_defaults),
        trust_request_chat_template=config.trust_request_chat_template,
    )
    if config.tool_call_parser:
        from kvtier.server.tools import make_parser

        serving.tool_parser = make_parser(config.tool_call_parser)
    serving.structured_defaults = dict(config.structured_defaults)
    serving.on_structured_error = metrics.structured_output_error
    serving.strict_request_fields = config.strict_request_fields
    serving.return_tokens_as_token_ids = config.return_tokens_as_token_ids
    serving.response_role = config.response_role
    serving.force_include_usage = config.enable_force_include_usage
    if config.enable_log_requests:
        from kvtier.server.request_log import RequestLogger

        serving.request_logger = RequestLogger(config.max_log_len)
    adapters = LoRAAdapters(async_engine, serving.model_names, config.enable_lora)
    serving.adapters = adapters
    resolver = tenants or SingleTenantResolver()
    created = int(time.time())

    ttl_tenants, _ = tenant_settings(resolver)

    admin = AdminAuth(resolver, config.admin_key)

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(config.ttl_sweep_interval_s)
            try:  # the tier part and pending-purge retries run off the engine thread
                await async_engine.sweep()
            except Exception:
                logger.exception("TTL sweep failed")

    async def key_checker(interval_s: float) -> None:
        """Fleet keys: a purge made by another instance reaches this one's copies within the
        check interval, whether or not the tenant sends this instance a request."""
        while True:
            await asyncio.sleep(max(interval_s, MIN_KEY_CHECK_PERIOD_S))
            try:
                await async_engine.check_keys()
            except Exception:
                logger.exception("fleet key check failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            await adapters.load_modules(config.lora_modules)
        except BaseException as e:
            logger.error("kvtier serve cannot start: %s", e)
            async_engine.shutdown()
            raise
        sweep = ttl_tenants or async_engine.has_tiers  # pending purges too
        tasks = [asyncio.ensure_future(sweeper())] if sweep else []
        key_check_s = async_engine.key_check_interval_s
        if key_check_s is not None:
            tasks.append(asyncio.ensure_future(key_checker(key_check_s)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            async_engine.shutdown()

    from kvtier import __version__

    # /openapi.json, /docs and /redoc as FastAPI builds them (as vLLM serves them)
    app = FastAPI(title="kvtier", version=__version__, lifespan=lifespan)
    app.root_path = config.root_path  # as vLLM (FastAPI's constructor argument is deprecated)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.server_load_metrics = 0
    """Completions and chat requests in flight (--enable-server-load-tracking; GET /load)."""
    _install_error_handlers(app)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )

    app.add_middleware(_EchoRequestId)

    def tenant_of(request: Request) -> Tenant:
        try:
            return resolver.resolve(api_key_from_header(request.headers.get("authorization")))
        except PermissionError as e:
            raise APIError(
                str(e) or "invalid API key", 401, type="authentication_error", code="invalid_api_key"
            ) from None

    rate, burst = parse_rate(config.rate_limit_per_key)
    limiter = KeyLimiter(config.max_concurrent_requests_per_key, rate, burst, pace_s=config.rate_limit_pace_s)
    keys_checked = tenants is not None  # without --api-key(s) any key passes: count addresses
    app.state.limiter = limiter
    stream_aborts = Counter(
        PREFIX + "stream_aborts",
        "Streams the server aborted (their requests' blocks freed), by reason.",
        ["model_name", "reason"],
        registry=metrics.registry,
    )
    stream_aborts.labels(config.served_model_name, "client_stalled")

    def stream_stalled() -> None:
        stream_aborts.labels(config.served_model_name, "client_stalled").inc()
        logger.warning(
            "a stream's client read nothing for %g s (--stream-stall-timeout-s): its requests are aborted",
            config.stream_stall_timeout_s,
        )

    def unload() -> None:
        app.state.server_load_metrics -= 1

    async def limited(request: Request, handle: Callable[[], Awaitable[Response]]) -> Response:
        """`handle()` under the caller's per-key limits and the stream stall bound, counted in
        /load's server load: a stream keeps its slot (and its count) until it ends."""
        releases: list[Callable[[], None]] = []
        if limiter.enabled:
            key = _client_key(request, keys_checked)
            try:
                releases.append(limiter.acquire(key))
            except RateLimited as refusal:
                await limiter.pace(key, refusal)
                raise
        if config.enable_server_load_tracking:
            app.state.server_load_metrics += 1
            releases.append(unload)
        try:
            response = await handle()
        except BaseException:
            for release in releases:
                release()
            raise
        if isinstance(response, _CleanupStreamingResponse):
            response.stall_timeout_s = config.stream_stall_timeout_s or None
            response.on_stalled = stream_stalled
            response.also_cleanup.extend(releases)
        else:
            for release in releases:
                release()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)

        async def handle() -> Response:
            req = await read_json(
                request,
                config.max_body_bytes,
                precheck=serving.precheck_completion,
                then=lambda body: _validate(CompletionRequest, body),
            )
            return await serving.completions(req, tenant, request)

        return await limited(request, handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)

        async def handle() -> Response:
            req = await read_json(
                request, config.max_body_bytes, then=lambda body: _validate(ChatCompletionRequest, body)
            )
            return await serving.chat(req, tenant, request)

        return await limited(request, handle)

    install_responses_api(app, serving, tenant_of, limited, read_json, config.max_body_bytes)

    def authorize(request: Request, mode: str) -> None:
        """--metrics-auth / --models-auth: 'public', 'api_key' (a valid key) or 'admin'."""
        if mode == "admin":
            require_admin(request)
        elif mode == "api_key" and not admin.is_admin_key(api_key_from_header(request.headers.get("authorization"))):
            tenant_of(request)  # 401 unless the key is listed in --api-keys

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, config.models_auth)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvtier",
                    "root": config.served_model_name,
                    "max_model_len": async_engine.max_model_len,
                }
                for name in (config.served_model_name, *config.model_aliases)
            ]
            + adapters.cards(async_engine.max_model_len),
        }

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: the engine loads the adapter at `lora_path` (a 400 with its reason when it
        cannot), then requests may name it as `model` (admin)."""
        require_admin(request)
        adapters.check_enabled()
        req = await read_json(request, config.max_body_bytes, then=lambda b: _validate(LoadLoRAAdapterRequest, b))
        if req.is_3d_lora_weight:
            raise APIError(
                "is_3d_lora_weight (MoE LoRA weights) is not supported: kvtier serves LoRA on dense "
                "models; leave it out",
                param="is_3d_lora_weight",
            )
        await adapters.load(req.lora_name, req.lora_path, replace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: later requests naming the adapter get a 404 (admin)."""
        require_admin(request)
        adapters.check_enabled()
        req = await read_json(request, config.max_body_bytes, then=lambda b: _validate(UnloadLoRAAdapterRequest, b))
        await adapters.unload(req.lora_name, req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        tenant_of(request)
        body = await read_json(request, config.max_body_bytes)
        return JSONResponse(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        tenant_of(request)
        body = await read_json(request, config.max_body_bytes)
        return JSONResponse(await serving.detokenize(body))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        if not config.enable_tokenizer_info:
            return JSONResponse(
                status_code=404,
                content={
                    "error": {
                        "message": "/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
            )
        tenant_of(request)
        return JSONResponse(serving.tokenizer_info())

    @app.get("/version")
    async def version() -> dict[str, str]:
        from kvtier import __version__

        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return JSONResponse({"status": "engine not running"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health check (GET or POST, as vLLM): /health's answer."""
        return await health()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: completions and chat requests in flight (0 unless the server
        runs with --enable-server-load-tracking, as vLLM answers)."""
        return {"server_load": app.state.server_load_metrics}

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one inference endpoint (as vLLM): a body with `messages` is a chat
        completion, one with `prompt` a completion, one with `input` a Responses API call
        (where /v1/responses is served); the answer is that route's."""
        body = await read_body(request, config.max_body_bytes)
        obj = (
            parse_json_object(body)
            if len(body) <= _INLINE_BODY_BYTES
            else await asyncio.to_thread(parse_json_object, body)
        )
        return _Forward(_invocation_route(app, obj), body)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        authorize(request, config.metrics_auth)
        await async_engine.fetch_stats()  # the engine process's counters now (in process: read at render)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def require_admin(request: Request) -> None:
        key = api_key_from_header(request.headers.get("authorization"))
        if not admin.is_admin(key):
            status, message = admin.refusal(key)
            raise APIError(
                message,
                status,
                type="authentication_error" if status == 401 else "permission_error",
                code="invalid_api_key" if status == 401 else "forbidden",
            )

    def cache_target(request: Request, destructive: bool) -> str:
        """The tenant a /v1/cache call acts on: the caller's, or with an admin key any named one.
        Without --api-keys every caller (every `--api-key` key too) shares one tenant, so
        purging it takes an admin credential; a key of a tenant of its own purges only that."""
        key = api_key_from_header(request.headers.get("authorization"))
        named = request.query_params.get("tenant")
        if admin.is_admin_key(key):
            if named is None and admin.multi_tenant:
                raise APIError(
                    "the admin key acts on a named tenant: add ?tenant=NAME (or ?all=true)", 400, code="missing_tenant"
                )
            return named if named is not None else admin.shared_tenant
        tenant = tenant_of(request)
        if named is not None and named != tenant.name:
            if not tenant.admin:
                raise APIError(
                    "only an admin key may name another tenant", 403, type="permission_error", code="forbidden"
                )
            return named
        if destructive and not admin.owns(tenant) and not admin.is_admin(key):
            status, message = admin.refusal(key)  # the shared tenant is everyone's cache
            raise APIError(
                f"this cache is shared by every key of this server, so purging it is an admin action: {message}",
                status,
                type="authentication_error" if status == 401 else "permission_error",
                code="invalid_api_key" if status == 401 else "forbidden",
            )
        return tenant.name

    def purge_answer(tenant: str | None, counts: dict[str, Any]) -> Response:
        """200 when every tier is purged; 503 (an error the client cannot miss) naming the tiers
        whose part is pending: recorded, the tenant fenced off, completed when they answer."""
        pending = counts.pop("pending", [])
        aborted = counts.pop("aborted_requests", 0)
        body: dict[str, Any] = {
            "object": "cache.purge",
            "tenant": tenant,
            "deleted_blocks": counts,
            "aborted_requests": aborted,
            "complete": not pending,
            "pending": pending,
        }
        if tenant is None:
            body["data_keys_destroyed"] = counts.pop("keys_destroyed", 0)
        else:
            body["data_key_destroyed"] = bool(counts.pop("key_destroyed", 0))
        if not pending:
            return JSONResponse(body)
        err = APIError(
            f"the purge is not complete: {', '.join(pending)} could not be reached, so "
            "those entries are not deleted yet. The purge is recorded and finishes when "
            "the tier answers (each DELETE /v1/cache and the sweeper retry it); until "
            "then this server neither reads nor writes the tenant's entries there.",
            503,
            type="server_error",
            code="purge_incomplete",
        )
        return JSONResponse({**err.body(), **body}, 503)

    @app.delete("/v1/cache")
    async def purge_cache(request: Request) -> Response:
        """Delete the caller's KV from every tier and destroy its data key (admin: ?tenant=NAME,
        ?all=true). The tenant's unfinished requests are aborted first (`aborted_requests`)."""
        if request.query_params.get("all") in ("1", "true"):
            require_admin(request)
            return purge_answer(None, await async_engine.purge(None, every_tenant=True))
        target = cache_target(request, destructive=True)
        return purge_answer(target, await async_engine.purge(target))

    @app.get("/v1/cache")
    async def cache_usage(request: Request) -> Response:
        """The caller's cached KV per tier (blocks, bytes where known)."""
        target = cache_target(request, destructive=False)
        usage = await async_engine.usage(target)
        return JSONResponse({"object": "cache.usage", "tenant": target, "tiers": usage})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's dev-mode endpoint, an admin one here: empty the prefix cache in
        ?tiers=device,host,disk,remote (default device,host,disk: a shared remote tier only
        when named). Blocks running requests hold stay on the device (`blocks_in_use`)."""
        require_admin(request)
        tiers = _reset_tiers(request)
        try:
            answer = await reset_engine_cache(async_engine, tiers)
        except ValueError as e:
            raise APIError(str(e), param="tiers") from None
        failed = {name: t["error"] for name, t in answer["tiers"].items() if "error" in t}
        body = {"object": "cache.reset", "success": not failed, **answer}
        if not failed:
            return JSONResponse(body)
        err = APIError(
            "the prefix cache reset is not complete: " + "; ".join(failed.values()), 503, type="server_error"
        )
        return JSONResponse({**err.body(), **body}, 503)

    @app.post("/admin/check_integrity")
    async def check_integrity(request: Request) -> Response:
        """Runs the engine's invariant checks once it is idle (for load tests). Needs an admin
        credential, except on a server that has none at all (read-only; AdminAuth.open_reads)."""
        if not admin.open_reads:
            require_admin(request)
        try:
            return JSONResponse(await async_engine.check_integrity())
        except AssertionError as e:
            body = APIError(f"integrity check failed: {e}", 500, type="integrity_error").body()
            return JSONResponse({"ok": False, **body}, 500)

    return app


# ------------------------------------------------------------------ bodies and errors
_INLINE_BODY_BYTES = 64 << 10


async def read_json(
    request: Request,
    max_bytes: int,
    then: Callable[[dict[str, Any]], Any] | None = None,
    precheck: Callable[[dict[str, Any]], Any] | None = None,
) -> Any:
    """The request body as a JSON object (`parse_json_object`'s checks, `precheck` first), or
    `then(body)` of it; `read_body`'s errors. A body over 64 KiB is parsed and handed to `then`
    (validation) on a worker thread, so that a large one does not stall the event loop."""
    body = await read_body(request, max_bytes)

    def parse() -> Any:
        obj = parse_json_object(body, precheck)
        return obj if then is None else then(obj)

    if len(body) <= _INLINE_BODY_BYTES:
        return parse()
    return await asyncio.to_thread(parse)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, declared JSON (a 415 otherwise); 413 past `max_bytes` (the rest is
    read and dropped, up to a bound, so the client sees the answer rather than a reset
    connection)."""
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
        raise APIError(
            f"the request body is larger than {max_bytes} bytes (--max-body-bytes)", 413, code="request_too_large"
        )
    _check_json_content_type(request)
    return bytes(body)


INVOCATION_SHAPES = (
    ("messages", "/v1/chat/completions", "a chat completion"),
    ("prompt", "/v1/completions", "a completion"),
    ("input", "/v1/responses", "a Responses API call"),
)
"""/invocations: (the body field that tells, the route that answers, what it is), first match
wins (vLLM tries chat first, then completions)."""


def _invocation_route(app: FastAPI, body: dict[str, Any]) -> Any:
    """The POST route of this app that answers an /invocations `body`, or a 400 naming the
    shapes this server takes (the Responses API only where /v1/responses is registered)."""
    routes = {r.path: r for r in app.routes if isinstance(r, APIRoute) and "POST" in (r.methods or ())}
    served = [shape for shape in INVOCATION_SHAPES if shape[1] in routes]
    for field_name, path, _ in served:
        if field_name in body:
            return routes[path]
    expected = "; ".join(f"`{f}` for {what} ({path})" for f, path, what in served)
    extra = " (this server has no /v1/responses, so `input` is not taken)" if "input" in body else ""
    raise APIError(
        f"/invocations could not tell which API this body is for: it needs {expected}{extra}",
        400,
        code="unknown_invocation",
    )


class _Forward(Response):
    """The answer of another route of this app (`route`) to this request, its body (read
    already, `request_body`) handed to it again: the route's own auth, limits, errors and
    streaming apply."""

    def __init__(self, route: Any, request_body: bytes) -> None:
        super().__init__()
        self.route = route
        self.request_body = request_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()  # disconnect detection, as for any request
            replayed = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}

        path = self.route.path
        inner = {k: v for k, v in scope.items() if k not in ("fastapi", "route", "endpoint")}
        inner.update(path=path, raw_path=path.encode())
        _, child = self.route.matches(inner)
        inner.update(child)
        await self.route.handle(inner, replay, send)


def _reset_tiers(request: Request) -> list[str]:
    """The tiers a /reset_prefix_cache call clears: ?tiers=a,b (kvtier.engine.reset.TIERS),
    else vLLM's reset_external=false alone: the device's, else DEFAULT_TIERS. A query parameter
    it does not know, or reset_running_requests=true (vLLM's preemption of running requests,
    not done here), is a 400."""
    from kvtier.engine.reset import DEFAULT_TIERS, TIERS

    params = request.query_params
    unknown = sorted(set(params) - {"tiers", "reset_external", "reset_running_requests"})
    if unknown:
        raise APIError(
            f"unknown query parameter {unknown[0][:100]!r}: /reset_prefix_cache takes tiers=NAME,... "
            f"(of {', '.join(TIERS)})",
            param=unknown[0][:100],
        )
    if _query_flag(params.get("reset_running_requests"), "reset_running_requests"):
        raise APIError(
            "reset_running_requests=true is not supported by kvtier: running requests keep their "
            "blocks (counted in the answer as the device's blocks_in_use); leave it out",
            param="reset_running_requests",
        )
    external = params.get("reset_external")
    if "tiers" in params:
        if external is not None:
            raise APIError("give tiers or reset_external, not both", param="reset_external")
        names = [t.strip() for t in params["tiers"].split(",") if t.strip()]
        bad = [t for t in names if t not in TIERS]
        if bad or not names:
            shown = repr(bad[0][:100]) if bad else "none"
            raise APIError(f"tiers: unknown tier {shown}; the tiers are {', '.join(TIERS)}", param="tiers")
        return names
    if external is not None and not _query_flag(external, "reset_external"):
        return ["device"]
    return list(DEFAULT_TIERS)


def _query_flag(value: str | None, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (true/false, 1/0, yes/no, on/off)."""
    if value is None:
        return False
    text = value.lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise APIError(f"{name} must be true or false, not {value[:40]!r}", param=name)


def _check_json_content_type(request: Request) -> None:
    """A 415 unless the body is declared `application/json` (any parameters, e.g. charset,
    allowed): a form, text or multipart body that happens to parse is not taken as JSON."""
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = "no Content-Type" if declared is None else f"Content-Type {declared[:100]!r}"
        raise APIError(
            f"the request has {shown}; send the JSON body with Content-Type: application/json",
            415,
            code="unsupported_media_type",
        )


class _EchoRequestId:
    """ASGI middleware: a usable `X-Request-Id` request header comes back on the response (a
    plain ASGI wrapper of `send`, so streams and disconnect detection are untouched)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None:
            return await self.app(scope, receive, send)
        text = rid.decode("latin-1")
        if not valid_request_id(text):
            return await self.app(scope, receive, send)

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _client_key(request: Request, keys_checked: bool) -> str:
    """Who the per-key limits count: the bearer key (hashed) where the server checks keys
    (a client cannot mint new ones), else the client's address."""
    key = api_key_from_header(request.headers.get("authorization")) if keys_checked else None
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()
    return "addr:" + (request.client.host if request.client else "unknown")


def _validate(model: Any, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:  # parse_json_object bounds the depth; this is the backstop
        raise APIError("the body is nested too deeply to validate", 400, code="invalid_json") from None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, e: RequestValidationError) -> Response:
        return JSONResponse(APIError(str(e.errors()[:1]), 400).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(str(e.detail), e.status_code, type=kind).body(), e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(ClientDisconnect)
    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        logger.exception("internal error serving %s", request.url.path)
        return JSONResponse(APIError("internal server error", 500, type="server_error").body(), 500)


def run_server(
    engine: EngineClient,
    tokenizer: Any,
    config: ServerConfig,
    log_level: str = "info",
    tenants: TenantResolver | None = None,
    request_log: Any = None,
) -> int:
    """Serve `engine` (an EngineClient not yet started) until interrupted (uvicorn); when the
    engine dies on its own the server shuts down. Returns the exit status: 1 when the engine
    died."""
    import uvicorn

    app = build_app(engine, tokenizer, config, tenants=tenants, request_log=request_log)
    nofile = raise_nofile_limit()
    max_connections = default_max_connections(nofile) if config.max_connections is None else config.max_connections
    limits = HTTPLimits(config.header_timeout_s, config.body_timeout_s, config.max_body_bytes, max_connections)
    install_accept_error_filter()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.uvicorn_log_level or log_level,
            access_log=not config.disable_uvicorn_access_log,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs,
            timeout_graceful_shutdown=5,
            http=limited_h11_protocol(limits),
        )
    )

    def engine_died() -> None:  # uvicorn's graceful shutdown: the open streams were failed
        server.should_exit = True

    engine.on_dead = engine_died
    server.run()
    return 1 if engine.error is not None else 0
