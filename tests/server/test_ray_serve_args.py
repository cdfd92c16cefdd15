"""kvtier.integrations.ray_serve's pieces that need no Ray cluster: builder arguments become the
`kvtier serve` flags kvtier's own parser checks, requests are forwarded as the class Ray's
routers read, and fanned-out admin answers merge (the cluster itself: tests/fleet/test_ray_serve.py)."""

from __future__ import annotations

import json

import pytest

from kvtier.integrations.ray_serve import serve_argv
from kvtier.integrations.ray_serve.deployments import _merge, parse_serve_args
from kvtier.integrations.ray_serve.request import ForwardedChat, ForwardedCompletion, ForwardedRequest, forwarded


def test_builder_arguments_are_kvtier_serve_flags() -> None:
    # as `serve run ... model=m block-size=16 enable_prefix_caching=true` passes them: strings
    argv = serve_argv(
        {
            "model": "m",
            "block-size": "16",
            "remote_cache_url": "redis://h:6379",
            "trust-request-chat-template": "true",
            "strict-request-fields": False,
            "served-model-name": ["a", "b"],
            "kv-events-config": {"enable_kv_cache_events": True},
        }
    )
    assert argv == [
        "m",
        "--block-size",
        "16",
        "--remote-cache-url",
        "redis://h:6379",
        "--trust-request-chat-template",
        "--served-model-name",
        "a",
        "b",
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True}),
    ]
    args = parse_serve_args(argv)
    assert args.engine_kwargs["block_size"] == 16 and args.engine_kwargs["remote_cache_url"] == "redis://h:6379"
    assert args.trust_request_chat_template and args.served_model_name == ["a", "b"]
    with pytest.raises(ValueError, match="model="):
        serve_argv({"block-size": 16})
    with pytest.raises(SystemExit):  # kvtier's parser refuses an unknown flag, as `kvtier serve` does
        parse_serve_args(serve_argv({"model": "m", "no-such-flag": 1}))


def test_completions_and_chats_carry_only_their_own_field() -> None:
    body = json.dumps({"model": "x", "prompt": "w5 w6", "cache_salt": "s"}).encode()
    c = forwarded("/v1/completions", method="POST", body=body)
    assert isinstance(c, ForwardedCompletion) and c.prompt == "w5 w6" and not hasattr(c, "messages")
    chat = forwarded(
        "/v1/chat/completions",
        method="POST",
        body=json.dumps({"messages": [{"role": "user", "content": "w5"}]}).encode(),
    )
    assert isinstance(chat, ForwardedChat) and chat.messages[0]["content"] == "w5" and not hasattr(chat, "prompt")
    for other in (
        forwarded("/v1/completions", method="POST", body=b"not json"),  # the replica answers the 400
        forwarded("/v1/models", method="GET"),
        forwarded("/v1/cache", method="DELETE"),
    ):
        assert type(other) is ForwardedRequest and other.body_json is None


def test_fanned_out_purge_answers_merge() -> None:
    def purge(device: int, pending: list[str] | None = None) -> dict:
        return {
            "object": "cache.purge",
            "tenant": "t",
            "deleted_blocks": {"device": device, "remote": 1},
            "aborted_requests": 1,
            "complete": not pending,
            "pending": pending or [],
            "data_key_destroyed": device > 1,
        }

    ok = json.loads(_merge(["r1", "r2"], [(200, purge(1)), (200, purge(2))]).body)
    assert ok["deleted_blocks"] == {"device": 3, "remote": 2} and ok["aborted_requests"] == 2
    assert ok["complete"] is True and ok["data_key_destroyed"] is True and len(ok["replicas"]) == 2
    failed = _merge(["r1", "r2"], [(200, purge(1)), (503, {"error": {"message": "gone", "code": "replica_failed"}})])
    body = json.loads(failed.body)
    assert failed.status_code == 503 and body["complete"] is False and body["error"]["code"] == "replica_failed"
    refused = _merge(["r1", "r2"], [(403, {"error": {"message": "no"}}), (403, {"error": {"message": "no"}})])
    assert refused.status_code == 403 and json.loads(refused.body) == {"error": {"message": "no"}}


def test_custom_resources_are_checked_before_anything_deploys() -> None:
    from kvtier.integrations.ray_serve import _resources

    assert _resources({"machine_a": 1}, "resources") == {"machine_a": 1.0}
    assert _resources('{"kvtier_head": 0.1}', "ingress_resources") == {"kvtier_head": 0.1}
    for bad in ("not json", '["a"]', {"a": 0}, {"a": True}, {"a": "1"}):
        with pytest.raises(ValueError, match="resources"):
            _resources(bad, "resources")
