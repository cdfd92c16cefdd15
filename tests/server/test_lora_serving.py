"""LoRA adapters over HTTP, as vLLM serves them (kvtier.server.lora_adapters): a real `kvtier
serve --enable-lora --max-loras 2 --lora-modules a=DIR b=DIR` (PEFT adapters made by
tests/lorautil.py), driven with the openai client. A request whose `model` names an adapter runs
it (greedy tokens equal the offline LLM's with that `lora_request`, which tests/engine and
tests/model prove equal to transformers + PEFT) and answers with the adapter's name; /v1/models
lists the adapters with their parent; one prompt under a, b and the base model shares no KV;
admins load and unload adapters at runtime; bad settings fail at start. Each cache scenario
ends with the engine's integrity check."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from serverutil import (
    BLOCK_SIZE,
    ENGINE_MODES,
    MODEL_NAME,
    NUM_DEVICE_BLOCKS,
    Server,
    free_port,
    start_server,
    stop_server,
)

pytest.importorskip("peft", reason="PEFT makes the test adapters (pip install 'kvtier[test]')")

from lorautil import make_adapter

from kvtier import LLM, LoRARequest, SamplingParams

# Which adapter a request names, /v1/models, the admin routes and the KV keys are the server's and
# the engine's alike in either engine mode: the default process mode only (conftest.py). What
# crosses the engine client runs in both: requests carrying an adapter
# (test_adapters_and_base_model_in_concurrent_requests_match_offline) and the runtime load,
# the engine's refusal of one included (test_load_and_unload_round_trip).
pytestmark = pytest.mark.engine_modes("process")
ADMIN_KEY = "lora-admin-key-for-the-tests"
MAX_TOKENS = 8
PROMPTS = {  # token ids of the byte-level tokenizer, one prompt per request of the concurrent batch
    "a": [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33],
    "b": [84, 104, 101, 32, 113, 117, 105, 99, 107],
    MODEL_NAME: [76, 111, 114, 65, 32, 116, 101, 115, 116, 32, 111, 110, 101],
}


@pytest.fixture(scope="module")
def adapters(server_model_dir, tmp_path_factory) -> dict[str, Path]:
    """a: every projection; b: q, v and down; c, d: more for runtime loads; big: rank 32 (above
    the default --max-lora-rank 16)."""
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "a": make_adapter(server_model_dir, root / "a", seed=1),
        "b": make_adapter(server_model_dir, root / "b", targets=["q_proj", "v_proj", "down_proj"], seed=2),
        "c": make_adapter(server_model_dir, root / "c", targets=["q_proj", "k_proj", "o_proj"], seed=3),
        "d": make_adapter(server_model_dir, root / "d", seed=4),
        "big": make_adapter(server_model_dir, root / "big", r=32, seed=5),
    }


@pytest.fixture(scope="module")
def admin_key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora_admin") / "admin.key"
    path.write_text(ADMIN_KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def lserver(server_model_dir, tmp_path_factory, engine_mode, adapters, admin_key_file):
    s = start_server(
        server_model_dir,
        tmp_path_factory.mktemp("lora_serve"),
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"a={adapters['a']}",
        f"b={adapters['b']}",
        "--admin-key-file",
        str(admin_key_file),
        engine_mode=engine_mode,
    )
    yield s
    try:
        assert "Traceback" not in s.log(), s.log()[-5000:]
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def offline(server_model_dir, adapters):
    """greedy(prompt, adapter name or None) -> the offline engine's tokens (LoRA on)."""
    llm = LLM(
        str(server_model_dir),
        dtype="float32",
        num_device_blocks=NUM_DEVICE_BLOCKS,
        block_size=BLOCK_SIZE,
        enable_lora=True,
        max_loras=2,
    )
    ids = {name: i for i, name in enumerate(adapters, start=1)}
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def greedy(prompt: list[int], adapter: str | None) -> list[int]:
        lora = None if adapter is None else LoRARequest(adapter, ids[adapter], str(adapters[adapter]))
        return list(llm.generate([prompt], sp, lora_request=lora)[0].outputs[0].token_ids)

    yield greedy
    llm.close()


def admin(s: Server, path: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{s.url}{path}", json=body, headers=headers, timeout=60)


def check_integrity(s: Server) -> None:
    """The engine's invariants hold once it is idle, and no block is in use."""
    r = admin(s, "/admin/check_integrity", {})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] is True and body["num_unfinished"] == 0, body
    assert body["num_free_blocks"] == body["num_blocks"], body


def complete(s: Server, model: str, prompt: list[int] | str) -> openai.types.Completion:
    return s.openai().completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def token_ids(c: openai.types.Completion) -> list[int]:
    return list(c.choices[0].model_extra["token_ids"])


def cached_tokens(c: openai.types.Completion) -> int:
    return c.usage.prompt_tokens_details.cached_tokens


def model_ids(s: Server) -> dict[str, dict]:
    return {m.id: m.model_dump() for m in s.openai().models.list().data}


# ------------------------------------------------------------------ requests naming adapters
@pytest.mark.engine_modes(*ENGINE_MODES)
def test_adapters_and_base_model_in_concurrent_requests_match_offline(lserver, offline):
    """a, b and the base model at once (two adapters: --max-loras 2), each twice: greedy
    tokens equal the offline engine's with the same adapter; each answer names its model."""
    jobs = [(model, PROMPTS[model]) for model in PROMPTS] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: complete(lserver, *job), jobs))
    for (model, prompt), out in zip(jobs, outs):
        assert out.model == model
        assert token_ids(out) == offline(prompt, None if model == MODEL_NAME else model), model
    # one prompt, three models: three continuations (the adapters change the output)
    same = PROMPTS["a"]
    assert len({tuple(offline(same, m)) for m in ("a", "b", None)}) == 3
    check_integrity(lserver)


def test_chat_and_responses_run_the_adapter(lserver):
    """Chat (streamed and not) and the Responses API run the adapter the model names; the chat
    answers and every chunk carry its name."""
    client = lserver.openai()
    messages = [{"role": "user", "content": "Say something."}]
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    texts = {}
    for model in ("b", MODEL_NAME):
        body = client.chat.completions.create(model=model, messages=messages, **kw)
        assert body.model == model
        texts[model] = body.choices[0].message.content
    assert texts["b"] != texts[MODEL_NAME]
    chunks = list(client.chat.completions.create(model="b", messages=messages, stream=True, **kw))
    assert {c.model for c in chunks} == {"b"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["b"]
    resp = client.responses.create(
        model="b", input=messages, max_output_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert resp.output_text == texts["b"] and resp.model == "b"
    check_integrity(lserver)


def test_models_lists_the_adapters_with_their_parent(lserver, adapters):
    models = model_ids(lserver)
    assert set(models) == {MODEL_NAME, "a", "b"}
    for name in ("a", "b"):
        card = models[name]
        assert card["object"] == "model" and card["parent"] == MODEL_NAME, card
        assert card["root"] == str(adapters[name]), card


def test_unknown_model_is_still_a_404(lserver):
    with pytest.raises(openai.NotFoundError):
        complete(lserver, "no-such-adapter", "Hello")


def test_one_prompt_under_two_adapters_and_the_base_shares_no_kv(lserver):
    """Block keys carry the adapter: the same prompt under a, then b, then the base model hits
    nothing; again under a, it hits a's blocks."""
    text = f"[{lserver.engine_mode}] One prompt, long enough to fill several KV blocks."
    for model in ("a", "b", MODEL_NAME):
        assert cached_tokens(complete(lserver, model, text)) == 0, model
    again = complete(lserver, "a", text)
    assert cached_tokens(again) >= len(text) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    check_integrity(lserver)


# ------------------------------------------------------------------ loading and unloading
@pytest.mark.engine_modes(*ENGINE_MODES)
def test_load_and_unload_round_trip(lserver, adapters, offline):
    # an adapter the engine refuses: its reason comes back over the engine client, nothing stays
    r = admin(lserver, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["big"])})
    assert r.status_code == 400 and "above max_lora_rank=16" in r.json()["error"]["message"], r.text
    assert set(model_ids(lserver)) == {MODEL_NAME, "a", "b"}
    with pytest.raises(openai.NotFoundError):
        complete(lserver, "x", "Hello")

    load = {"lora_name": "c", "lora_path": str(adapters["c"])}
    with pytest.raises(openai.NotFoundError):
        complete(lserver, "c", PROMPTS["a"])
    # an admin credential is needed
    assert admin(lserver, "/v1/load_lora_adapter", load, key=None).status_code == 401
    assert admin(lserver, "/v1/load_lora_adapter", load, key="not-the-admin").status_code == 403
    r = admin(lserver, "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully.", r.text
    card = model_ids(lserver)["c"]
    assert card["parent"] == MODEL_NAME and card["root"] == str(adapters["c"])
    out = complete(lserver, "c", PROMPTS["a"])
    assert out.model == "c" and token_ids(out) == offline(PROMPTS["a"], "c")
    # loaded already: a 400, unless replaced in place
    r = admin(lserver, "/v1/load_lora_adapter", load)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"], r.text
    assert admin(lserver, "/v1/load_lora_adapter", {**load, "load_inplace": True}).status_code == 200
    assert token_ids(complete(lserver, "c", PROMPTS["a"])) == offline(PROMPTS["a"], "c")

    unload = {"lora_name": "c"}
    assert admin(lserver, "/v1/unload_lora_adapter", unload, key=None).status_code == 401
    r = admin(lserver, "/v1/unload_lora_adapter", unload)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully.", r.text
    with pytest.raises(openai.NotFoundError):
        complete(lserver, "c", PROMPTS["a"])
    assert "c" not in model_ids(lserver)
    r = admin(lserver, "/v1/unload_lora_adapter", unload)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name", r.text
    check_integrity(lserver)


def test_another_adapter_loaded_under_a_name_never_meets_the_old_ones_kv(lserver, adapters, offline):
    text = f"[{lserver.engine_mode}] Under one name, two adapters one after the other."
    load = {"lora_name": "e", "lora_path": str(adapters["c"])}
    assert admin(lserver, "/v1/load_lora_adapter", load).status_code == 200
    assert cached_tokens(complete(lserver, "e", text)) == 0
    assert cached_tokens(complete(lserver, "e", text)) > 0
    assert admin(lserver, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    load = {"lora_name": "e", "lora_path": str(adapters["d"])}
    assert admin(lserver, "/v1/load_lora_adapter", load).status_code == 200
    out = complete(lserver, "e", text)
    assert cached_tokens(out) == 0
    assert token_ids(complete(lserver, "e", PROMPTS["b"])) == offline(PROMPTS["b"], "d")
    assert admin(lserver, "/v1/unload_lora_adapter", {"lora_name": "e", "lora_int_id": 1}).status_code == 404
    assert admin(lserver, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    check_integrity(lserver)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        # (an adapter the engine refuses, rank 32: test_load_and_unload_round_trip, both modes)
        ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 404, "No adapter found for /no/such/adapter"),
        ({"lora_name": MODEL_NAME, "lora_path": "ADAPTER:c"}, 400, "conflicts with a served base model"),
        ({"lora_name": "a", "lora_path": "ADAPTER:c"}, 400, "already been loaded"),
        ({"lora_name": "", "lora_path": "ADAPTER:c"}, 400, "must be provided"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "ADAPTER:c", "is_3d_lora_weight": True}, 400, "is_3d_lora_weight"),
        ({"lora_name": "x", "lora_path": "ADAPTER:c", "scale": 2}, 400, "scale"),
    ],
)
def test_load_refusals_are_clear_and_leave_nothing(lserver, adapters, body, status, says):
    body = {k: str(adapters[v.split(":", 1)[1]]) if str(v).startswith("ADAPTER:") else v for k, v in body.items()}
    r = admin(lserver, "/v1/load_lora_adapter", body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert set(model_ids(lserver)) == {MODEL_NAME, "a", "b"}
    with pytest.raises(openai.NotFoundError):
        complete(lserver, "x", "Hello")


# ------------------------------------------------------------------ servers without LoRA
def test_lora_endpoints_need_enable_lora(server_model_dir, tmp_path, admin_key_file):
    """Without --enable-lora: loading is a 400 saying what to start the server with, and an
    adapter's name is an unknown model."""
    s = start_server(server_model_dir, tmp_path, "--admin-key-file", str(admin_key_file))
    try:
        r = admin(s, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "lora_not_enabled"
        assert admin(s, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 400
        assert admin(s, "/v1/load_lora_adapter", {"lora_name": "c"}, key=None).status_code == 401
        with pytest.raises(openai.NotFoundError):
            complete(s, "c", "Hello")
        assert "Traceback" not in s.log(), s.log()
    finally:
        stop_server(s)


def serve_args(model_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(free_port()),
        "--dtype",
        "float32",
        "--num-device-blocks",
        "64",
        *flags,
    ]


def test_lora_modules_without_enable_lora_fails_in_one_line(server_model_dir, adapters):
    p = subprocess.run(
        serve_args(server_model_dir, "--lora-modules", f"a={adapters['a']}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--lora-modules needs --enable-lora" in lines[0], p.stderr


def test_a_module_the_engine_refuses_fails_the_start(server_model_dir, adapters):
    """vLLM loads --lora-modules at startup: an adapter that does not fit stops the start in one
    line, naming it and the reason, before the engine starts."""
    p = subprocess.run(
        serve_args(server_model_dir, "--enable-lora", "--lora-modules", f"a={adapters['a']}", f"big={adapters['big']}"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: --lora-modules big="), p.stderr
    assert "above max_lora_rank=16" in lines[0] and "Traceback" not in p.stderr
