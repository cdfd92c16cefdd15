"""`kvtier serve`: the OpenAI-compatible HTTP server, its flags and how it starts the engine
(in its own process by default, or on a thread of this one)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvtier.cli.args import integer, port, positive_float, positive_int, size
from kvtier.cli.engine_args import add_engine_args


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _rate(text: str) -> str:
    """--rate-limit-per-key: checked here, parsed by the server (kvtier.server.http_limits)."""
    from kvtier.server.http_limits import parse_rate

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _structured_config(text: str) -> dict[str, Any]:
    value = _json_object(text)
    backend = value.pop("backend", "auto")
    if backend not in ("auto", "guidance", "llguidance"):
        raise argparse.ArgumentTypeError(
            f"backend {backend!r}: kvtier's grammar engine is llguidance (auto or guidance)"
        )
    unknown = sorted(set(value) - {"disable_any_whitespace", "disable_additional_properties"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key {unknown[0]!r}")
    if not all(isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError("disable_any_whitespace / disable_additional_properties are booleans")
    return value


def _origins(text: str) -> tuple[str, ...]:
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("a JSON list of origin strings, e.g. '[\"*\"]'")
        return tuple(value)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with Prometheus metrics",
        description="Serves /v1/completions, /v1/chat/completions (SSE streaming), "
        "/v1/models, /health and /metrics (Prometheus) for one local checkpoint.",
    )
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model directory or .gguf file (as vLLM's `vllm serve MODEL`)",
    )
    s.add_argument("--model", default=None, help="the same, as a flag")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="default 8000")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may send; the first is the one /v1/models lists and "
        "responses carry (default: the model argument)",
    )
    s.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for what requests leave out: auto (default) reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) as vLLM does; vllm: none; DIR: that folder's file",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the model's",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template (chat completions, /tokenize), as "
        "vLLM's flag; rendered in a sandbox bounded in size, loops and time. Off: a 400",
    )
    s.add_argument(
        "--structured-outputs-config",
        type=_structured_config,
        default={},
        metavar="JSON",
        help='as vLLM\'s: {"backend": "auto"|"guidance", "disable_any_whitespace": bool, '
        '"disable_additional_properties": bool}; kvtier\'s grammar engine is llguidance',
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let tool_choice 'auto' read tool calls out of the model's text (needs --tool-call-parser), as vLLM",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the tool-call format of the model, vLLM's names: hermes (Qwen2.5, Hermes; qwen, qwen3_json), "
        "llama3_json (llama4_json), mistral, pythonic, qwen3_coder (qwen3_xml), granite, granite-20b-fc, "
        "deepseek_v3, openai (gpt-oss)",
    )
    s.add_argument(
        "--allowed-origins",
        type=_origins,
        default=("*",),
        metavar="JSON|LIST",
        help='CORS origins, a JSON list or comma-separated (default ["*"]; [] turns CORS off)',
    )
    s.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (special tokens and chat template; lm-eval's remote "
        "tokenizer reads it), off by default as in vLLM",
    )
    s.add_argument(
        "--max-body-bytes",
        type=size,
        default=4 << 20,
        metavar="SIZE",
        help="larger request bodies get a 413 (default 4MiB); a larger declared "
        "Content-Length is answered at once, the body unread",
    )
    s.add_argument(
        "--header-timeout-s",
        type=_non_negative_float,
        default=10.0,
        metavar="S",
        help="a connection that has not sent a complete request head within S seconds is closed (default 10; 0: none)",
    )
    s.add_argument(
        "--body-timeout-s",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="a request body that stalls S seconds between chunks gets a 408 (default 30; 0: none)",
    )
    s.add_argument(
        "--max-connections",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="open connections at most; more get a 503 and are closed at once (default "
        "min(RLIMIT_NOFILE - 64, 4096), the soft limit raised to the hard one; 0: none)",
    )
    s.add_argument(
        "--stream-stall-timeout-s",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="a stream whose client reads nothing for S seconds is aborted and its KV "
        "blocks freed (default 30; 0: none)",
    )
    s.add_argument(
        "--max-concurrent-requests-per-key",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="requests in flight per API key (per client address without one, or without "
        "--api-key/--api-keys, where any key passes), streams "
        "until they end; more get a 429 with Retry-After (default 0: unbounded)",
    )
    s.add_argument(
        "--rate-limit-per-key",
        type=_rate,
        default="0",
        metavar="RATE",
        help="a token bucket per API key (as --max-concurrent-requests-per-key): RATE requests per "
        "second, or RATE/s:burst=N (burst default ceil(RATE)); over it a 429 with "
        "Retry-After (default 0: none)",
    )
    s.add_argument(
        "--rate-limit-pace-s",
        type=_non_negative_float,
        default=1.0,
        metavar="S",
        help="hold a per-key 429 this long (never past its Retry-After) before sending it, so a "
        "client that retries at once gets one answer per connection per S, not a tight loop "
        "(default 1; 0: answer at once)",
    )
    s.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=128,
        metavar="N",
        help="a /v1/completions batch of more prompts gets a 400, so one request "
        "cannot hold up the others (default 128)",
    )
    s.add_argument(
        "--max-seqs-per-request",
        type=positive_int,
        default=256,
        metavar="N",
        help="a request asking for more sequences (prompts x n) gets a 400 (default 256)",
    )
    s.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="a completions/chat request with a field the server does not know (e.g. a misspelt "
        "'max_token') gets a 400 naming it; by default the field is ignored and logged as a warning",
    )
    s.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default info)",
    )
    s.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="as vLLM: requests need one of these bearer keys (one tenant; --api-keys gives each key its own tenant)",
    )
    s.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"keys": {"KEY": "TENANT" | {"tenant": T, "admin": true}}}: requests '
        "need a listed key; each tenant's KV is isolated (its own cache salt)",
    )
    s.add_argument(
        "--admin-key-file",
        default=None,
        metavar="FILE",
        help="a file holding the admin bearer key: purges (DELETE /v1/cache) and /admin/* need "
        "it or a key marked admin in --api-keys; without either they are refused",
    )
    s.add_argument(
        "--metrics-auth",
        choices=("public", "api_key", "admin"),
        default="public",
        help="who may read /metrics (default public; api_key: any key of --api-keys)",
    )
    s.add_argument(
        "--metrics-names",
        choices=("kvtier", "vllm", "both"),
        default="both",
        help="the prefix of /metrics series: kvtier:, vllm: (what vLLM's dashboards, alert rules "
        "and KV-aware routers read) or both (default)",
    )
    s.add_argument(
        "--models-auth",
        choices=("public", "api_key", "admin"),
        default=None,
        help="who may read /v1/models (default public; api_key with --api-key, as vLLM "
        "guards every /v1 path with its key)",
    )
    s.add_argument(
        "--kv-master-key-file",
        default=None,
        metavar="FILE",
        help="fleet encryption: tenants' data keys wrapped by this 32-byte master key and kept "
        "in the remote tier, shared by every instance given the same file (needs --remote-cache-url)",
    )
    s.add_argument(
        "--kv-key-check-interval-s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="with --kv-master-key-file: how long a cached data key is used before it is "
        "re-checked, the bound on noticing another instance's purge (default 1; 0: every use)",
    )
    s.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished request (token ids, timestamps, tenant "
        "hash, cached tokens by tier; no text unless --request-log-text)",
    )
    s.add_argument("--request-log-text", action="store_true", help="also log prompt and output text")
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the server process instead of its own process "
        "(the default runs it in its own process, as vLLM's EngineCore)",
    )
    s.add_argument(
        "--ttl-sweep-interval-s",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="how often tenants' ttl_s (from --api-keys) is enforced in every tier (default 10)",
    )
    _add_vllm_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=run, subparser=s)


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


def _lora_module(text: str) -> tuple[str, str, str | None]:
    """--lora-modules: name=path, or vLLM's JSON {"name": ..., "path": ..., "base_model_name": ...}."""
    import json

    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("name"), str)
            or not isinstance(value.get("path"), str)
        ):
            raise argparse.ArgumentTypeError('a JSON object {"name": NAME, "path": DIR[, "base_model_name": M]}')
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown key {unknown[0]!r}")
        return value["name"], value["path"], value.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return name, path, None


def _add_vllm_server_args(s: argparse.ArgumentParser) -> None:
    """vLLM's server flags with the same meaning in kvtier (README: vLLM flags)."""
    g = s.add_argument_group("vLLM server flags")
    g.add_argument(
        "--lora-modules",
        type=_lora_module,
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) requests name as their model (needs --enable-lora)",
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="sampling defaults set or replaced over --generation-config's, e.g. '{\"temperature\": 0.5}'",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role of chat replies (default assistant)",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens as token_id:N (also per request)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details (cached tokens) in responses",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="usage in every streamed response, asked for or not",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count requests in flight and serve GET /load",
    )
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's sampling parameters and prompt (INFO)",
    )
    g.add_argument(
        "--max-log-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --enable-log-requests: at most N characters / token ids of each prompt",
    )
    g.add_argument(
        "--root-path", default="", metavar="PATH", help="the path prefix of a proxy in front (FastAPI root_path)"
    )
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this key (and --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates for client certificates")
    g.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default=None,
        help="uvicorn's own log level (default: --log-level)",
    )
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access-log line per HTTP request")
    g.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="the engine on a thread of the server process, as --engine-in-process",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from kvtier import LLM, threads

    # kvtier's own loggers (tiers going down and back, corrupt entries, purges) at the level the
    # operator asked for, with the level and source on each line (uvicorn formats its own)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvtier.engine.frontend import make_engine_client
    from kvtier.server.app import run_server
    from kvtier.server.request_log import RequestLog

    config, tenants = server_settings(args)
    check_lora_modules(args)
    log = RequestLog(args.request_log, include_text=args.request_log_text) if args.request_log else None
    try:
        if args.engine_in_process:
            # built on a thread that ends: no OpenMP team of its own beside the engine thread's
            with threads.build_off_thread(lambda: LLM(args.model, **args.engine_kwargs)) as llm:
                use_chat_template(llm.tokenizer, args.chat_template)
                client = make_engine_client(core=llm.engine, **engine_settings(args, tenants))
                return run_server(
                    client, llm.tokenizer, config, log_level=args.log_level, tenants=tenants, request_log=log
                )
        return _serve_engine_process(args, config, tenants, log)
    finally:
        if log is not None:
            log.close()


def server_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """(ServerConfig, tenant resolver or None) from parsed `kvtier serve` flags, checked before
    any model loads; `args.model` is set from the positional MODEL. Also what each Ray Serve
    replica runs (kvtier.integrations.ray_serve), so both serve with the same settings."""
    from kvtier.sampling_params import generation_defaults
    from kvtier.server.app import ServerConfig
    from kvtier.server.serving import RequestLimits
    from kvtier.server.tenancy import ApiKeyResolver, read_admin_key

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ValueError("serve needs a model: kvtier serve MODEL (a checkpoint directory or .gguf file)")
    from kvtier.model.resolve import resolve_model

    # a hub id becomes its cached snapshot here, once: the engine (in its own process or not)
    # and the tokenizer read the same path; clients keep sending the id (the served name)
    model_id = args.model
    kw = args.engine_kwargs
    args.model = resolve_model(model_id, kw.pop("revision", None), kw.get("download_dir"))
    if kw.get("tokenizer"):
        kw["tokenizer"] = resolve_model(kw["tokenizer"], None, kw.get("download_dir"))
    kw.pop("download_dir", None)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (
        ("--ssl-keyfile", args.ssl_keyfile),
        ("--ssl-certfile", args.ssl_certfile),
        ("--ssl-ca-certs", args.ssl_ca_certs),
    ):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if args.lora_modules:
        if not kw.get("enable_lora"):
            raise ValueError("--lora-modules needs --enable-lora (as in vLLM)")
        lora_names = [m[0] for m in args.lora_modules]
        if len(set(lora_names)) != len(lora_names):
            raise ValueError(f"--lora-modules: a name given twice: {lora_names}")
        for name, path, _ in args.lora_modules:
            if not os.path.isdir(path):
                raise ValueError(f"--lora-modules {name}={path}: no such directory (a PEFT adapter directory)")
    if args.disable_frontend_multiprocessing:
        args.engine_in_process = True
    if args.api_key and args.api_keys:
        raise ValueError("--api-key and --api-keys exclude each other: one shared key, or a file of keys and tenants")
    if args.enable_auto_tool_choice != bool(args.tool_call_parser):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (as in vLLM)")
    if args.tool_call_parser:
        from kvtier.server.tools import make_parser

        make_parser(args.tool_call_parser)  # an unknown name fails before the model loads
    names = tuple(args.served_model_name or (model_id,))
    defaults = generation_defaults(args.model, args.generation_config, args.override_generation_config)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=names[0],
        model_aliases=names[1:],
        allowed_origins=args.allowed_origins,
        enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        structured_defaults=tuple(sorted(args.structured_outputs_config.items())),
        sampling_defaults=tuple(sorted(defaults.items())),
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(
            max_prompts_per_request=args.max_prompts_per_request, max_seqs_per_request=args.max_seqs_per_request
        ),
        ttl_sweep_interval_s=args.ttl_sweep_interval_s,
        admin_key=read_admin_key(args.admin_key_file) if args.admin_key_file else None,
        metrics_auth=args.metrics_auth,
        metrics_names=args.metrics_names,
        models_auth=args.models_auth or ("api_key" if args.api_key else "public"),
        strict_request_fields=args.strict_request_fields,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        stream_stall_timeout_s=args.stream_stall_timeout_s,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        rate_limit_per_key=args.rate_limit_per_key,
        rate_limit_pace_s=args.rate_limit_pace_s,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_server_load_tracking=args.enable_server_load_tracking,
        response_role=args.response_role,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        enable_lora=bool(args.engine_kwargs.get("enable_lora")),
        lora_modules=tuple(args.lora_modules or ()),
    )
    tenants = ApiKeyResolver.from_file(args.api_keys) if args.api_keys else None
    if args.api_key:
        from kvtier.server.tenancy import DEFAULT_TENANT

        tenants = ApiKeyResolver({key: DEFAULT_TENANT for key in args.api_key})
    if args.kv_master_key_file:
        from kvtier.tiers.keyring import read_master_key

        read_master_key(args.kv_master_key_file)  # a bad file fails before the model loads
        if not args.engine_kwargs.get("remote_cache_url"):
            raise ValueError("--kv-master-key-file needs --remote-cache-url: the wrapped data keys live there")
    return config, tenants


def check_lora_modules(args: argparse.Namespace) -> None:
    """--lora-modules read and checked against the model (shapes, targets, rank) before the engine
    starts, so an adapter the engine would refuse is one line at start, not a failed startup."""
    if not args.lora_modules:
        return
    from pathlib import Path

    import torch

    from kvtier.lora import LoRARequest, load_adapter
    from kvtier.model.loader import arch_config

    arch = arch_config(Path(args.model))
    rank = args.engine_kwargs.get("max_lora_rank", 16)
    for i, (name, path, base) in enumerate(args.lora_modules, 1):
        try:
            load_adapter(LoRARequest(name, i, path, base), arch, torch.float32, rank)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None


def use_chat_template(tokenizer: Any, template: str | None) -> None:
    """--chat-template: a file's text, or the argument itself when it is no file."""
    if template is None:
        return
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer; this model has none")
    from pathlib import Path

    path = Path(template)
    text = path.read_text(encoding="utf-8") if path.is_file() else template
    if "{" not in text:
        raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template")
    tokenizer.set_chat_template(text)


def engine_settings(args: argparse.Namespace, tenants: Any) -> dict[str, Any]:
    """make_engine_client's tenant and fleet key settings, the same in both engine modes."""
    from kvtier.server.app import tenant_settings
    from kvtier.server.tenancy import SingleTenantResolver

    ttls, quotas = tenant_settings(tenants or SingleTenantResolver())
    fleet = (args.kv_master_key_file, args.kv_key_check_interval_s) if args.kv_master_key_file else None
    return {"tenant_ttls": ttls, "tenant_quotas": quotas, "fleet_keys": fleet}


def _serve_engine_process(args: argparse.Namespace, config: Any, tenants: Any, log: Any) -> int:
    """The engine core in its own process (kvtier.engine.process); this one serves HTTP."""
    from kvtier import threads
    from kvtier.engine.frontend import make_engine_client
    from kvtier.model.tokenizer import Tokenizer, has_tokenizer
    from kvtier.server.app import run_server

    tok_dir = args.engine_kwargs.get("tokenizer") or args.model
    tokenizer = Tokenizer(tok_dir) if has_tokenizer(tok_dir) else None
    use_chat_template(tokenizer, args.chat_template)
    # the engine's plan (a bad --cpu-threads-bind fails here, before the model loads)
    plan = threads.plan_threads(args.engine_kwargs.get("cpu_threads_bind"), args.engine_kwargs.get("num_threads"))
    client = make_engine_client(
        model=args.model, engine_kwargs=args.engine_kwargs, log_level=args.log_level, **engine_settings(args, tenants)
    )
    try:
        # this process is the engine's helper: off its compute CPUs where there are spare ones
        if plan.compute_cpus and set(plan.io_cpus).isdisjoint(plan.compute_cpus):
            os.sched_setaffinity(0, set(plan.io_cpus))
        return run_server(client, tokenizer, config, log_level=args.log_level, tenants=tenants, request_log=log)
    finally:
        client.shutdown()
