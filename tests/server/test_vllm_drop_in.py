"""A typical vLLM offline script and a typical model-card serving command, with only `vllm`
replaced by `kvtier`, run as they are (subprocesses, the tiny test model in place of a hub id)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from serverutil import REPO, Server, free_port, stop_server

pytest.importorskip("llguidance")

OFFLINE_SCRIPT = textwrap.dedent("""
    import sys

    from kvtier import LLM, SamplingParams
    from kvtier.sampling_params import StructuredOutputsParams

    MODEL = sys.argv[1]
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)

    llm = LLM(model=MODEL, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5,
              enable_prefix_caching=True, seed=0)
    outputs = llm.generate(prompts, sampling_params, use_tqdm=True)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")

    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"}]
    outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                                                    repetition_penalty=1.1), use_tqdm=False)
    out = outputs[0].outputs[0]
    for token_id, lp in zip(out.token_ids, out.logprobs):
        print("logprob", token_id, lp[token_id].logprob, lp[token_id].rank, repr(lp[token_id].decoded_token))
    print("decoded", tokenizer.decode(out.token_ids) == out.text or "stop text cut")

    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    print("choice", llm.generate("Is it?", choice)[0].outputs[0].text)
    prompt_lp = llm.generate("abc", SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    print("prompt_logprobs", prompt_lp[0], sorted(prompt_lp[1]))
    defaults = llm.get_default_sampling_params()
    print("defaults", type(defaults).__name__)
""")


def test_typical_offline_script(server_model_dir, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(script), str(server_model_dir)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("Prompt: ") for line in lines) == 2
    logprob_lines = [line.split() for line in lines if line.startswith("logprob ")]
    assert logprob_lines and all(float(f[2]) <= 0 and int(f[3]) >= 1 for f in logprob_lines)
    assert any(line in ("choice yes", "choice no") for line in lines), proc.stdout
    abc = next(line for line in lines if line.startswith("prompt_logprobs "))
    assert abc.startswith("prompt_logprobs None [")
    assert "defaults SamplingParams" in lines
    assert "Processed prompts" in proc.stderr  # use_tqdm=True shows vLLM's progress bar


def test_typical_model_card_serve_command(server_model_dir, tmp_path):
    """`vllm serve MODEL --dtype ... --max-model-len ... --gpu-memory-utilization ...
    --enable-prefix-caching --served-model-name A B --api-key KEY --generation-config auto
    --enable-auto-tool-choice --tool-call-parser hermes --chat-template FILE` as `kvtier serve`."""
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    port = free_port()
    exe = shutil.which("kvtier")
    launcher = [exe] if exe else [sys.executable, "-m", "kvtier"]
    cmd = [
        *launcher,
        "serve",
        str(server_model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float",
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.5",
        "--enable-prefix-caching",
        "--served-model-name",
        "tiny-chat",
        "tiny",
        "--api-key",
        "sk-card",
        "--generation-config",
        "auto",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        str(template),
        "--kv-cache-dtype",
        "auto",
        "--block-size",
        "16",
    ]
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, server.log()
            try:
                if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        import openai

        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # --api-key guards /v1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-card", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat", "tiny"]
        for name in ("tiny-chat", "tiny"):
            resp = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
            )
            assert resp.model == "tiny-chat" and resp.usage.completion_tokens >= 1
        # the --chat-template file renders the prompt
        tok = httpx.post(
            f"{server.url}/tokenize",
            headers={"Authorization": "Bearer sk-card"},
            json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
        )
        assert tok.status_code == 200 and "".join(tok.json()["token_strs"]).startswith("<user>hi<assistant>")
    finally:
        stop_server(server)
    assert "Traceback" not in server.log(), server.log()
