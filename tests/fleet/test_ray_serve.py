"""kvtier on Ray Serve (kvtier.integrations.ray_serve): a local Ray cluster, two engine replicas
of a tiny model on one CPU each, the KV-event router, one Redis tier with tenants and fleet
encryption. Greedy outputs through Ray equal kvtier's own engine (chat and completions,
streamed and not, through the `openai` client); a revisit goes to the replica that holds its
prefix; a purge through the app reaches every replica and Redis; a killed replica is dropped
from routing (its stream fails with a clear error, never wrong tokens), the other restores its
prefixes from Redis, and Ray restarts it. One Ray cluster for the module (marked `fleet`)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.bench.server import free_port, start_redis_server, stop_process

pytestmark = pytest.mark.fleet

try:
    import ray
    from ray import serve
except ImportError:
    if os.environ.get("KVTIER_REQUIRE_RAY") == "1":
        raise RuntimeError("KVTIER_REQUIRE_RAY=1 but ray[serve] is not installed (pip install 'kvtier[ray]')") from None
    pytest.skip("ray[serve] is not installed (pip install 'kvtier[ray]')", allow_module_level=True)

openai = pytest.importorskip("openai")
redis = pytest.importorskip("redis")
pytest.importorskip("cryptography")

REPO = Path(__file__).resolve().parents[2]
BS = 8
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
"""The word-level model's chat template: each message's words, in order."""
REPLICA = "x-kvtier-replica"


@dataclass
class Fleet:
    url: str
    model: Path
    redis_url: str
    args: dict
    app: str = "kvtier"

    def client(self, key: str = "sk-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def replicas(self) -> list[str]:
        from ray.serve.context import _get_global_client

        from kvtier.integrations.ray_serve import ENGINE_DEPLOYMENT

        details = _get_global_client().get_serve_details()
        replicas = details["applications"][self.app]["deployments"][ENGINE_DEPLOYMENT]["replicas"]
        return [r["actor_name"] for r in replicas if r["state"] == "RUNNING"]


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{3 + (seed * 131 + j * 17) % 500}" for j in range(n))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from kvtier.integrations.ray_serve import build_app
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_word_tokenizer

    tmp = tmp_path_factory.mktemp("ray_serve")
    model = tmp / "model"
    build_random_llama(
        model,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
        dtype="float32",
    )
    build_word_tokenizer(model, 512, 2048)
    keys = tmp / "keys.json"
    keys.write_text(
        json.dumps({"keys": {"sk-a": "alpha", "sk-b": "beta", "sk-admin": {"tenant": "ops", "admin": True}}})
    )
    master = tmp / "master.key"
    master.write_bytes(os.urandom(32))
    (tmp / "redis").mkdir()
    redis_proc, redis_port = start_redis_server(tmp / "redis")
    redis_url = f"redis://127.0.0.1:{redis_port}"
    port = free_port()
    try:
        env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="warning")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "model": str(model),
            "num_replicas": 2,
            "num_cpus": 1,
            "router": "kv_event",
            "served-model-name": "tiny",
            "generation-config": "vllm",
            "dtype": "float32",
            "block-size": BS,
            "num-device-blocks": 512,
            "max-model-len": 2048,
            "chat-template": TEMPLATE,
            "api-keys": str(keys),
            "remote-cache-url": redis_url,
            "restore-policy": "always",
            "kv-master-key-file": str(master),
            "kv-key-check-interval-s": 0,
        }
        serve.run(build_app(args), name="kvtier", route_prefix="/")
        yield Fleet(f"http://127.0.0.1:{port}", model, redis_url, args=args)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            stop_process(redis_proc)


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> Iterator[object]:
    """kvtier's own engine on the same checkpoint and template (the LLM API)."""
    from kvtier import LLM
    from kvtier.cli.serve import use_chat_template

    llm = LLM(str(fleet.model), dtype="float32", block_size=BS, num_threads=1, generation_config="vllm")
    use_chat_template(llm.tokenizer, TEMPLATE)
    yield llm
    llm.close()


def _greedy(max_tokens: int) -> object:
    from kvtier import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_greedy_outputs_equal_kvtiers_own_engine(fleet: Fleet, reference: object) -> None:
    client = fleet.client()
    prompt = _words(1, 40)
    messages = [{"role": "user", "content": _words(2, 30)}, {"role": "assistant", "content": _words(3, 5)}]
    want = reference.generate([prompt], _greedy(12), use_tqdm=False)[0].outputs[0].text  # type: ignore[attr-defined]
    want_chat = reference.chat(messages, _greedy(12), use_tqdm=False)[0].outputs[0].text  # type: ignore[attr-defined]
    extra = {"ignore_eos": True}

    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert out.choices[0].text == want and out.usage.completion_tokens == 12
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want

    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.content == want_chat
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want_chat

    # X-Request-Id: the response id's suffix, echoed back once (as `kvtier serve`)
    res = httpx.post(
        fleet.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": "Bearer sk-a", "X-Request-Id": "trace-42"},
        timeout=120,
    )
    assert res.status_code == 200 and res.json()["id"] == "cmpl-trace-42", res.text
    assert res.headers.get_list("x-request-id") == ["trace-42"]

    # a body over --max-body-bytes (4 MiB by default): the 413 of `kvtier serve`
    res = httpx.post(
        fleet.url + "/v1/completions",
        content=b'{"prompt": "' + b"w5 " * (2 << 20) + b'"}',
        headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"},
        timeout=120,
    )
    assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large", res.text

    # the same errors as `kvtier serve`: a bad key, an unknown model
    with pytest.raises(openai.AuthenticationError):
        fleet.client("sk-nobody").completions.create(model="tiny", prompt=prompt, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=1)


def _complete(fleet: Fleet, prompt: str, key: str = "sk-a") -> tuple[str, dict]:
    """(the replica that answered, the usage) of a 2-token greedy completion."""
    raw = fleet.client(key).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    return raw.headers[REPLICA], raw.parse().usage.model_dump()


def test_kv_event_router_sends_a_revisit_where_its_prefix_is(fleet: Fleet) -> None:
    prefixes = [_words(100 + i, 48) for i in range(8)]
    first = []
    for p in prefixes:  # cold: power-of-two choices spreads them over both replicas
        replica, usage = _complete(fleet, p)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        first.append(replica)
    for i, p in enumerate(prefixes):  # each revisit comes several requests after its first visit
        replica, usage = _complete(fleet, p + f" w{10 + i} w{20 + i}")
        details = usage["prompt_tokens_details"]
        assert replica == first[i], (i, first)
        assert details["cached_tokens"] >= 48 - BS, (i, details)
        assert details["cached_tokens_by_tier"].get("remote", 0) == 0, (i, details)

    # chats: the router renders the chat template as the replica does
    def chat(messages: list[dict]) -> tuple[str, dict]:
        raw = fleet.client().chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        return raw.headers[REPLICA], raw.parse().usage.model_dump()

    talks = [[{"role": "user", "content": _words(200 + i, 48)}] for i in range(6)]
    first = [chat(t)[0] for t in talks]
    for i, t in enumerate(talks):
        turn = [*t, {"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": f"w{50 + i}"}]
        replica, usage = chat(turn)
        assert replica == first[i], (i, first)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 48 - BS, (i, usage)


def _redis_keys(fleet: Fleet) -> set[bytes]:
    r = redis.Redis.from_url(fleet.redis_url)
    try:
        return {k for k in r.scan_iter(match="kvtier:*") if not k.endswith(b":keycheck")}
    finally:
        r.close()


def test_a_purge_through_the_app_reaches_every_replica_and_redis(fleet: Fleet) -> None:
    before = _redis_keys(fleet)
    prompts = [_words(300 + i, 40) for i in range(4)]
    for p in prompts:
        _complete(fleet, p, key="sk-b")
    beta = _redis_keys(fleet) - before
    assert beta, "tenant beta's blocks reached Redis"

    res = httpx.delete(
        fleet.url + "/v1/cache", params={"tenant": "beta"}, headers={"Authorization": "Bearer sk-admin"}, timeout=120
    )
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["complete"] is True and body["data_key_destroyed"] is True
    assert sorted(r["replica"] for r in body["replicas"]) == sorted(fleet.replicas())
    assert all(r["status"] == 200 for r in body["replicas"])
    assert not (_redis_keys(fleet) & beta)  # nothing of beta's left in Redis
    for p in prompts:  # nor on any replica: every revisit computes from scratch
        _, usage = _complete(fleet, p, key="sk-b")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # a tenant's key cannot purge another tenant, on the app as on `kvtier serve`
    res = httpx.delete(
        fleet.url + "/v1/cache", params={"tenant": "alpha"}, headers={"Authorization": "Bearer sk-b"}, timeout=120
    )
    assert res.status_code == 403, res.text


def test_a_killed_replica_fails_its_stream_clearly_and_the_other_serves_and_restores(
    fleet: Fleet, reference: object
) -> None:
    prefix = _words(500, 48)
    holder, _ = _complete(fleet, prefix)
    prompt = prefix + " w7"
    want = reference.generate([prompt], _greedy(1500), use_tqdm=False)[0].outputs[0].text  # type: ignore[attr-defined]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    # and a request that is not streamed, sent first, on the same replica (it holds the prefix)
    whole_prompt = prefix + " w8"
    want_whole = reference.generate([whole_prompt], _greedy(1500), use_tqdm=False)[0].outputs[0].text  # type: ignore[attr-defined]
    whole: dict = {}

    def send_whole() -> None:
        r = httpx.post(
            fleet.url + "/v1/completions",
            json={**body, "prompt": whole_prompt, "stream": False},
            headers={"Authorization": "Bearer sk-a"},
            timeout=120,
        )
        whole.update(status=r.status_code, body=r.json())

    sender = threading.Thread(target=send_whole)
    sender.start()
    text, events = "", []
    with httpx.stream(
        "POST", fleet.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"}, timeout=120
    ) as res:
        assert res.status_code == 200 and res.headers[REPLICA] == holder  # the prefix's replica
        lines = res.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        ray.kill(ray.get_actor(holder, namespace="serve"), no_restart=False)
        for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                events.append(event)
                if "choices" in event:
                    text += event["choices"][0]["text"]
    assert events and events[-1]["error"]["code"] == "replica_failed", events[-1:]
    assert want.startswith(text) and len(text) < len(want)  # what came was right; the rest never came
    sender.join()
    if whole["status"] == 200:  # it reached the other replica after all: then whole and right
        assert whole["body"]["choices"][0]["text"] == want_whole
    else:  # it was in flight on the killed replica: a clear error, no output
        assert whole["status"] == 503 and whole["body"]["error"]["code"] == "replica_failed", whole

    # the other replica serves on, and restores the killed one's prefix from Redis
    for i in range(3):
        replica, usage = _complete(fleet, prefix + f" w{30 + i}")
        assert replica != holder
        tiers = usage["prompt_tokens_details"]["cached_tokens_by_tier"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 48 - BS
        if i == 0:
            assert tiers.get("remote", 0) >= 48 - BS, usage

    deadline = time.monotonic() + 180  # Ray restarts the killed replica
    while time.monotonic() < deadline:
        running = fleet.replicas()
        if len(running) == 2 and holder not in running:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the killed replica was not replaced: {fleet.replicas()}")
    for i in range(4):
        replica, _ = _complete(fleet, _words(700 + i, 20))
        assert replica in running


def test_rays_prefix_router_places_revisits_too(fleet: Fleet) -> None:
    """Ray's PrefixCacheAffinityRouter as is (imported without vLLM), on the same app: a revisit
    of a text goes to the replica that served it (runs last: it redeploys the app)."""
    from kvtier.integrations.ray_serve import build_app

    serve.delete(fleet.app)
    serve.run(build_app({**fleet.args, "router": "prefix"}), name=fleet.app, route_prefix="/")
    prefixes = [_words(900 + i, 48) for i in range(6)]
    first = [_complete(fleet, p)[0] for p in prefixes]
    for i, p in enumerate(prefixes):
        replica, usage = _complete(fleet, p + f" w{40 + i}")
        assert replica == first[i], (i, first)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 48 - BS
