"""kvtier on Ray Serve: replicas across machines, placed by their KV cache, sharing one Redis
(Cluster) tier. Ray Serve does the replicas, health checks, restarts and autoscaling; kvtier
brings the engine, its server and a KV-event request router (`pip install 'kvtier[ray]'`).

    serve run kvtier.integrations.ray_serve:build_app model=/models/m num_replicas=2 num_cpus=4 \\
        router=kv_event remote-cache-url=redis://redis:6379

    HTTP --> Ray proxy --> KVTierIngress -- DeploymentHandle(stream) --> KVTierEngine replica
                            (any replica)    request router chooses      kvtier LLM + kvtier's
                            reads the body,  (KVEventRouter by default)  own FastAPI app
                            names prompt/messages/salt                   (kvtier.server.app)

Why this shape. The engine replicas run kvtier's own FastAPI app (`kvtier.server.app.build_app`,
the app of `kvtier serve --engine-in-process`), so every endpoint, request and response type,
error code, SSE stream, tenant and API-key check, structured output and admin call behaves
exactly as `kvtier serve`: nothing is rewritten for Ray. The ingress forwards each HTTP request
whole (`request.ForwardedRequest`: method, path, headers, body) through a DeploymentHandle with
`stream=True`; the replica feeds it to its app as an ASGI call and streams the response head and
body chunks back, which the ingress sends on unchanged. The one thing Ray's routers need is what
the request is about, so the forwarded request carries the body's `prompt` (completions) or
`messages` (chat) as attributes, as ray.serve.llm's requests do (Ray's
PrefixCacheAffinityRouter reads exactly those), plus the effective cache salt for the
KV-event router. Serving `build_app` directly as the replicas' `serve.ingress` would have been
simpler, but then the proxy picks a replica before anything has read the body, and no router
could place a request by its prompt.

Routers (`router=`): `kv_event` (default; `routers.KVEventRouter`: the replica holding the
longest stored prefix, from the replicas' vLLM-format KV events, with a queue-imbalance guard
and power-of-two choices as the fallback), `prefix` (Ray's PrefixCacheAffinityRouter as is: an
approximate tree of the text it routed, no engine state), `pow2` (Ray's default).

Each replica: `num_cpus` CPUs in `ray_actor_options`, and the engine's `num_threads` follows it
(unless `num-threads` is given). Any `kvtier serve` flag is an argument without its dashes
(`remote-cache-url=redis://...`, `api-keys=/etc/kvtier/keys.json`, `block-size=16`); a flag
without a value takes `true`. The model path and any files named must exist on every node.
Admin calls that act on the cache (DELETE /v1/cache, POST /admin/check_integrity) go to every
replica; /metrics and the per-key limits are per replica (the replica that answers).
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.ray_serve.deployments import (
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    KVTierEngine,
    KVTierIngress,
    parse_serve_args,
)

__all__ = ["ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "ROUTERS", "build_app", "router_class", "serve_argv"]

ROUTERS = ("kv_event", "prefix", "pow2")
RAY_KEYS = (
    "num_replicas",
    "num_cpus",
    "router",
    "imbalanced_threshold",
    "max_ongoing_requests",
    "autoscaling_config",
    "routing_stats_period_s",
    "health_check_period_s",
    "ingress_num_cpus",
    "resources",
    "ingress_resources",
    "max_replicas_per_node",
)


def router_class(name: str) -> str:
    """The import path of the request router class of `router=NAME` (kv_event, prefix, pow2)."""
    classes = {
        "kv_event": "KVEventRouter",
        "prefix": "PinnablePrefixRouter",
        "pow2": "PinnablePow2Router",
    }
    if name not in classes:
        raise ValueError(f"router={name!r}: one of {', '.join(ROUTERS)}")
    return f"kvtier.integrations.ray_serve.routers:{classes[name]}"


def serve_argv(args: dict[str, Any]) -> list[str]:
    """`kvtier serve` argv from builder arguments: model first, then `--key value` for each other
    key (underscores and dashes alike; a list gives several values; true: a bare flag; false or
    None: left out)."""
    args = dict(args)
    model = args.pop("model", None)
    if not model:
        raise ValueError("build_app needs model=PATH (a checkpoint directory or .gguf file on every node)")
    argv = [str(model)]
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False or (isinstance(value, str) and value.lower() == "false"):
            continue
        if value is True or (isinstance(value, str) and value.lower() == "true"):
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _resources(value: Any, name: str) -> dict[str, float]:
    """A Ray custom-resource request ({"name": amount}) from a dict or its JSON text."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}={value!r}: a JSON object of resource amounts ({exc})") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for k, v in value.items()
    ):
        raise ValueError(f'{name}={value!r}: a mapping of resource names to positive amounts, e.g. {{"gpu_node": 1}}')
    return {k: float(v) for k, v in value.items()}


def build_app(args: dict[str, Any]) -> Any:
    """The Ray Serve application: `serve run kvtier.integrations.ray_serve:build_app model=...`,
    or `import_path: kvtier.integrations.ray_serve:build_app` with `args:` in a Serve config.

    Ray arguments: num_replicas (default 1), num_cpus per engine replica (default 1),
    router (kv_event | prefix | pow2; default kv_event), imbalanced_threshold (queue-length
    difference beyond which load wins over the cache; default 8 for kv_event, Ray's default for
    prefix), max_ongoing_requests per replica (default 64), autoscaling_config (Ray's; replaces
    num_replicas), routing_stats_period_s (how often replicas report their KV event endpoints;
    default 1), health_check_period_s (default 2), ingress_num_cpus (default 0), resources and
    ingress_resources (Ray custom resources per engine / ingress replica, a dict or its JSON: to
    pin them to machines that declare them), max_replicas_per_node (Ray's: 1 spreads the engine
    replicas over machines). Every other key
    is a `kvtier serve` flag (see serve_argv), checked here before anything deploys."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    args = dict(args)
    ray_args = {k: args.pop(k) for k in RAY_KEYS if k in args}
    argv = serve_argv(args)
    parsed = parse_serve_args(argv)
    from kvtier.cli.serve import server_settings

    server_settings(parsed)  # a bad flag combination fails here, not in every replica
    num_cpus = float(ray_args.get("num_cpus", 1))
    router = str(ray_args.get("router", "kv_event"))
    kwargs: dict[str, Any] = {}
    if router == "kv_event":
        kwargs = {"model": parsed.model, "chat_template": parsed.chat_template}
        kwargs["imbalanced_threshold"] = float(ray_args.get("imbalanced_threshold", 8))
    elif router == "prefix" and "imbalanced_threshold" in ray_args:
        kwargs["imbalanced_threshold"] = float(ray_args["imbalanced_threshold"])
    router_options: dict[str, Any] = {
        "request_router_class": router_class(router),
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": float(ray_args.get("routing_stats_period_s", 1.0)),
    }
    router_config = RequestRouterConfig(**router_options)
    engine_actor: dict[str, Any] = {"num_cpus": num_cpus}
    if ray_args.get("resources"):
        engine_actor["resources"] = _resources(ray_args["resources"], "resources")
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": engine_actor,
        "max_ongoing_requests": int(ray_args.get("max_ongoing_requests", 64)),
        "request_router_config": router_config,
        "health_check_period_s": float(ray_args.get("health_check_period_s", 2.0)),
    }
    if ray_args.get("max_replicas_per_node") is not None:
        options["max_replicas_per_node"] = int(ray_args["max_replicas_per_node"])
    autoscaling = ray_args.get("autoscaling_config")
    if autoscaling:
        if isinstance(autoscaling, str):
            import json

            autoscaling = json.loads(autoscaling)
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = int(ray_args.get("num_replicas", 1))
    engine = serve.deployment(**options)(KVTierEngine).bind(argv, num_cpus)
    ingress_actor: dict[str, Any] = {"num_cpus": float(ray_args.get("ingress_num_cpus", 0))}
    if ray_args.get("ingress_resources"):
        ingress_actor["resources"] = _resources(ray_args["ingress_resources"], "ingress_resources")
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options=ingress_actor,
        max_ongoing_requests=1000,
    )(KVTierIngress)
    return ingress.bind(engine, argv, router == "kv_event")
