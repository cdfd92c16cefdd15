"""The two Ray Serve deployments: `KVTierEngine` (one kvtier engine and kvtier's own FastAPI app
per replica) and `KVTierIngress` (the HTTP entry: it reads each request, names what routers
need, and streams the chosen replica's answer back). See the package docstring for the design."""

import asyncio
import dataclasses
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvtier.integrations.ray_serve.request import ForwardedRequest, forwarded

logger = logging.getLogger("kvtier.ray_serve")

ENGINE_DEPLOYMENT = "KVTierEngine"
INGRESS_DEPLOYMENT = "KVTierIngress"
FAN_OUT = {("DELETE", "/v1/cache"), ("POST", "/admin/check_integrity")}
"""Admin calls the ingress sends to every engine replica (a purge must reach every copy)."""
FAN_OUT_TIMEOUT_S = 60.0
REPLICA_HEADER = "x-kvtier-replica"
"""A response header naming the engine replica that answered (its Ray Serve replica id)."""


def parse_serve_args(argv: list[str]) -> Any:
    """`kvtier serve` flags, parsed and checked by kvtier's own parser."""
    from kvtier.cli.engine_args import engine_kwargs
    from kvtier.cli.main import build_parser
    from kvtier.vllm_flags import check_vllm_flags

    args = build_parser().parse_args(["serve", *argv])
    args.engine_kwargs = engine_kwargs(args, args.subparser)
    check_vllm_flags(args)  # a refused vLLM flag is a ValueError here; no-ops pass
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class KVTierEngine:
    """One replica: `LLM(model, **engine flags)` with `num_threads` = the replica's `num_cpus`,
    its engine on a thread of this process (kvtier.engine.frontend.make_engine_client), served
    by kvtier.server.app.build_app exactly as `kvtier serve --engine-in-process` serves it. KV
    events are published on two free ports of this node and reported to the router through
    `record_routing_stats`."""

    def __init__(self, serve_argv: list[str], num_cpus: float) -> None:
        import ray
        from ray import serve

        from kvtier import LLM, threads
        from kvtier.cli.serve import engine_settings, server_settings, use_chat_template
        from kvtier.engine.frontend import make_engine_client
        from kvtier.server.app import build_app
        from kvtier.server.request_log import RequestLog

        args = parse_serve_args(serve_argv)
        config, tenants = server_settings(args)
        kw = dict(args.engine_kwargs)
        kw.setdefault("num_threads", max(1, int(num_cpus)))
        ev_port, replay_port = _free_port(), _free_port()
        events = dict(kw.get("kv_events_config") or {})
        events.update(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{ev_port}",
            replay_endpoint=f"tcp://*:{replay_port}",
        )
        kw["kv_events_config"] = events
        ip = ray.util.get_node_ip_address()
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        # built on a thread that ends: no OpenMP team of its own beside the engine thread's
        self.llm = threads.build_off_thread(lambda: LLM(args.model, **kw))
        use_chat_template(self.llm.tokenizer, args.chat_template)
        self.client = make_engine_client(core=self.llm.engine, **engine_settings(args, tenants))
        self.log = RequestLog(args.request_log, include_text=args.request_log_text) if args.request_log else None
        self.app = build_app(self.client, self.llm.tokenizer, config, tenants=tenants, request_log=self.log)
        self.stats = {
            "kv_events_endpoint": f"tcp://{ip}:{ev_port}",
            "kv_events_replay_endpoint": f"tcp://{ip}:{replay_port}",
            "block_size": int(self.llm.engine.kv.block_size),
            "fingerprint": bytes(self.llm.engine.runner.fingerprint).hex(),
        }
        self._lifespan: Any = None
        self._start_lock = asyncio.Lock()

    async def _started(self) -> None:
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()  # starts the engine client and the app's sweepers
                self._lifespan = lifespan

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the KV-event router needs of this replica (Ray Serve calls this periodically)."""
        await self._started()
        return dict(self.stats)

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine fails it, and Ray replaces the replica."""
        await self._started()
        if not self.client.alive:
            raise RuntimeError("the kvtier engine of this replica has stopped")

    async def handle(self, req: ForwardedRequest) -> AsyncIterator[Any]:
        """Run one HTTP request through this replica's kvtier app: yields the response head
        ({"status", "headers"}) first, then the body's chunks (bytes) as the app sends them. A
        caller that stops reading (its client went away) cancels this generator: the app then
        sees the client disconnect, and kvtier aborts the request and frees its blocks."""
        await self._started()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "root_path": "",
            "query_string": req.query_string,
            "headers": list(req.headers),
            "client": req.client,
            "server": None,
            "state": {},
        }
        sent: asyncio.Queue[Any] = asyncio.Queue(maxsize=4)  # the app waits while the caller lags
        gone = asyncio.Event()
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            await sent.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await sent.put(None)

        task = asyncio.ensure_future(run())
        try:
            while True:
                message = await sent.get()
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    headers.append((REPLICA_HEADER, self.replica_id))
                    yield {"status": int(message["status"]), "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
            await task
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                except Exception:  # noqa: BLE001 - whatever it was, the app's call is abandoned
                    task.cancel()

    async def __del__(self) -> None:
        """Ray Serve's replica shutdown: the app's lifespan ends (its tasks, then the engine)."""
        client, llm, log = getattr(self, "client", None), getattr(self, "llm", None), getattr(self, "log", None)
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        try:
            if lifespan is not None:
                await lifespan.__aexit__(None, None, None)
            elif client is not None:
                client.shutdown()
        finally:
            if llm is not None:
                llm.close()
            if log is not None:
                log.close()


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}, status_code=status
    )


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


REPLICA_FAILED = (
    "the engine replica serving this request failed before it finished ({error}); no partial or "
    "substituted output was sent. Other replicas keep serving: retry the request"
)


def _own_internal_request_id() -> None:
    """Give the calling task its own Ray Serve internal request id (in its copy of the request
    context). Handle calls made while serving one request share that request's id, and Ray's
    router hands a chosen replica to the pending call with that id: calls fanned out from one
    admin request would take each other's replicas, and one pinned to a replica that cannot answer
    would hold up the rest. Ray's request context is a frozen dataclass in a context variable."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=generate_request_id()))  # type: ignore[arg-type]  # Ray annotates the variable as None


class KVTierIngress:
    """Every path of `kvtier serve`'s API, forwarded whole to an engine replica through a
    DeploymentHandle (the deployment's request router chooses which); the answer streams back
    unchanged. DELETE /v1/cache and POST /admin/check_integrity go to every replica and their
    answers are merged (`_merge`)."""

    def __init__(self, engine: Any, serve_argv: list[str], routing_tokenizer: bool = False) -> None:
        from kvtier.cli.serve import server_settings
        from kvtier.server.tenancy import SingleTenantResolver

        args = parse_serve_args(serve_argv)
        self.config, tenants = server_settings(args)
        self.resolver = tenants or SingleTenantResolver()
        self.engine = engine.options(stream=True, method_name="handle")
        if routing_tokenizer:  # KVEventRouter's, loaded before this replica says it is ready
            from kvtier.integrations.ray_serve.request import routing_tokenizer as load

            load(args.model, args.chat_template)

    def _forwarded(self, request: Request, body: bytes) -> ForwardedRequest:
        from kvtier.server.tenancy import api_key_from_header

        client = request.client
        req = forwarded(
            request.url.path,
            method=request.method,
            query_string=request.url.query.encode("latin-1"),
            headers=[(k, v) for k, v in request.headers.raw if k.lower() != b"host"],
            body=body,
            client=(client.host, client.port) if client is not None else None,
        )
        if req.body_json is not None:
            try:
                tenant = self.resolver.resolve(api_key_from_header(request.headers.get("authorization")))
                salt = req.body_json.get("cache_salt")
                req.cache_salt = tenant.effective_salt(salt if isinstance(salt, str) else None)
            except PermissionError:
                pass  # the replica answers the 401
        return req

    async def _body(self, request: Request) -> bytes:
        """The body, at most --max-body-bytes + 1 of it: past that the replica's app answers the 413
        (the rest is read and dropped up to a bound, as kvtier.server.app.read_json does)."""
        limit = self.config.max_body_bytes
        body = bytearray()
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if len(body) <= limit:
                body += chunk[: limit + 1 - len(body)]
            if seen > 16 * limit:
                break
        return bytes(body)

    async def __call__(self, request: Request) -> Response:
        body = await self._body(request)
        req = self._forwarded(request, body)
        if (req.method, req.path) in FAN_OUT:
            return await self._fan_out(req)
        stream = self.engine.remote(req)
        try:
            head = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or failed before answering: a clear 503
            logger.warning("kvtier ingress: %s %s failed on its replica: %r", req.method, req.path, e)
            return _error(503, REPLICA_FAILED.format(error=type(e).__name__), "replica_failed")
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:
                logger.warning("kvtier ingress: a response from a replica broke off: %r", e)
                if sse:  # the 200 is sent: the failure can only be reported in the stream
                    yield _sse_error(REPLICA_FAILED.format(error=type(e).__name__))
                else:
                    raise
            finally:
                stream.cancel()

        response = StreamingResponse(chunks(), status_code=head["status"])
        response.raw_headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in head["headers"]
            # Ray's proxy sets x-request-id itself (the client's, or one it made and passed on, which
            # the replica's app echoed): once is enough
            if k.lower() not in ("transfer-encoding", "connection", "x-request-id")
        ]
        return response

    async def _fan_out(self, req: ForwardedRequest) -> Response:
        replicas = self._engine_replicas()
        if not replicas:
            return _error(503, "no engine replica is running", "no_replicas")

        async def one(replica: str) -> tuple[int, dict[str, Any]]:
            pinned = dataclasses.replace(req, replica=replica)

            async def call() -> tuple[int, dict[str, Any]]:
                _own_internal_request_id()
                stream = self.engine.remote(pinned)
                head = await stream.__anext__()
                data = b"".join([chunk async for chunk in stream])
                return int(head["status"]), json.loads(data or b"{}")

            try:
                return await asyncio.wait_for(call(), FAN_OUT_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a replica that cannot answer is reported, not raised
                msg = f"replica {replica} did not answer: {type(e).__name__}"
                return 503, {"error": {"message": msg, "type": "server_error", "param": None, "code": "replica_failed"}}

        # at once, each call in its own task under its own internal request id (see
        # _own_internal_request_id): a replica that cannot answer delays none of the others
        answers = list(await asyncio.gather(*(one(r) for r in replicas)))
        return _merge(replicas, answers)

    def _engine_replicas(self) -> list[str]:
        """The full ids of the engine deployment's running replicas (from the Serve controller)."""
        from ray import serve
        from ray.serve.context import _get_global_client

        app = serve.get_replica_context().app_name
        client = _get_global_client()
        assert client is not None
        details = client.get_serve_details()
        deployment = details["applications"][app]["deployments"][ENGINE_DEPLOYMENT]
        return [r["actor_name"] for r in deployment["replicas"] if r.get("state") == "RUNNING" and r.get("actor_name")]


def _merge(replicas: list[str], answers: list[tuple[int, dict[str, Any]]]) -> Response:
    """One answer for an admin call every replica answered: a refusal (4xx) as the replicas gave
    it; else the replicas' purge counts summed, `complete` only when every replica completed,
    the worst status (a replica that failed makes it a 503), and each replica's own answer
    under `replicas`."""
    for status, body in answers:
        if 400 <= status < 500:
            return JSONResponse(body, status_code=status)
    merged: dict[str, Any] = dict(answers[0][1])
    merged.pop("error", None)
    if merged.get("object") == "cache.purge" or any(b.get("object") == "cache.purge" for _, b in answers):
        deleted: dict[str, int] = {}
        pending: list[str] = []
        for _, body in answers:
            for tier, n in (body.get("deleted_blocks") or {}).items():
                if isinstance(n, int):
                    deleted[tier] = deleted.get(tier, 0) + n
            pending += [p for p in body.get("pending", []) if p not in pending]
        merged.update(
            object="cache.purge",
            deleted_blocks=deleted,
            aborted_requests=sum(int(b.get("aborted_requests", 0)) for _, b in answers),
            pending=pending,
        )
        if "data_key_destroyed" in merged:
            merged["data_key_destroyed"] = any(bool(b.get("data_key_destroyed")) for _, b in answers)
        if "data_keys_destroyed" in merged:
            merged["data_keys_destroyed"] = sum(int(b.get("data_keys_destroyed", 0)) for _, b in answers)
    status = max(s for s, _ in answers)
    failed = [b["error"] for s, b in answers if s >= 500 and "error" in b]
    merged["complete"] = status < 400 and all(b.get("complete", True) for _, b in answers)
    merged["replicas"] = [{"replica": r, "status": s, "answer": b} for r, (s, b) in zip(replicas, answers)]
    if failed:
        merged["error"] = failed[0]
    return JSONResponse(merged, status_code=status)
