"""The third-party clients vLLM users point at a server, against `kvtier serve` unchanged:
LangChain's ChatOpenAI (`with_structured_output`, `bind_tools`), LiteLLM's vLLM provider with
tools, lm-evaluation-harness `local-completions` on a multiple-choice task written here (its
loglikelihoods, through `echo`, checked against kvtier's offline prompt logprobs), and curl
streaming tool-call deltas. Each client is skipped with its reason when it is not installed
(the `test` extra installs them all)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Literal

import pytest
from serverutil import MODEL_NAME

pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")

PAINT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "paint", "description": "Paint something.", "parameters": PAINT}}]
NAMED = {"type": "function", "function": {"name": "paint"}}
COLORS = ("red", "green", "blue")


class Paint(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(serve):
    # a random model picks whitespace as readily as anything: compact JSON ends in bounded tokens
    s = serve(
        "--structured-outputs-config",
        '{"disable_any_whitespace": true, "disable_additional_properties": true}',
        "--enable-tokenizer-info-endpoint",
    )
    yield s
    assert "Traceback" not in s.log(), s.log()


def test_langchain_structured_output_and_tools(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL_NAME, base_url=f"{server.url}/v1", api_key="unused", temperature=0.0, max_tokens=60, max_retries=0
    )
    for method in ("json_schema", "function_calling"):
        out = chat.with_structured_output(Paint, method=method).invoke("Paint the fence.")
        assert isinstance(out, Paint), (method, out)
    # json_mode: any JSON object (the schema is left to the prompt)
    raw = chat.bind(response_format={"type": "json_object"}).invoke("Paint the fence, in JSON.")
    assert isinstance(json.loads(raw.content), dict)
    msg = chat.bind_tools(TOOLS, tool_choice="paint").invoke("Paint the fence.")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "paint" and call["args"]["color"] in COLORS and call["id"]
    # the tool's answer goes back in the conversation and the model replies in text
    from langchain_core.messages import HumanMessage, ToolMessage

    reply = chat.invoke(
        [HumanMessage("Paint the fence."), msg, ToolMessage(content="painted", tool_call_id=call["id"])]
    )
    assert isinstance(reply.content, str) and not reply.tool_calls


def test_litellm_vllm_provider_with_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm")
    kw = dict(
        model=f"hosted_vllm/{MODEL_NAME}", api_base=f"{server.url}/v1", api_key="unused", max_tokens=60, temperature=0.0
    )
    resp = litellm.completion(
        messages=[{"role": "user", "content": "Paint the fence."}], tools=TOOLS, tool_choice=NAMED, **kw
    )
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "paint" and json.loads(call.function.arguments)["color"] in COLORS
    assert resp.choices[0].finish_reason in ("stop", "tool_calls")  # LiteLLM maps a call to "tool_calls"
    streamed = litellm.completion(messages=[{"role": "user", "content": "hello"}], stream=True, **kw)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    plain = litellm.completion(messages=[{"role": "user", "content": "hello"}], **kw)
    assert text == plain.choices[0].message.content


def test_curl_streams_tool_call_deltas(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Paint it."}],
        "max_tokens": 60,
        "stream": True,
        "tools": TOOLS,
        "tool_choice": NAMED,
    }
    out = subprocess.run(
        [
            curl,
            "-sN",
            "--max-time",
            "60",
            f"{server.url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    calls = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in chunks
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert calls and calls[0][0]["function"]["name"] == "paint" and calls[0][0]["id"]
    arguments = "".join(d[0]["function"].get("arguments") or "" for d in calls)
    assert json.loads(arguments)["color"] in COLORS
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


ITEMS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two makes", "choices": ["four", "seven", "a bird"], "answer": 0},
    {"question": "Ice is water that is", "choices": ["frozen", "burning", "sung"], "answer": 0},
    {"question": "A cat says", "choices": ["meow", "moo", "quack"], "answer": 0},
]
TASK = """task: kvtier_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


# 10-16 s a mode; the echo + logprobs path it drives runs in both modes in test_vllm_extras.py
@pytest.mark.engine_modes("process")
def test_lm_eval_local_completions_loglikelihood(server, server_model_dir, tmp_path):
    """lm-eval's local-completions sends `echo: true, logprobs: 1, max_tokens: 1` and reads the
    prompt's token logprobs back; its remote tokenizer reads /tokenizer_info and /tokenize.
    Every loglikelihood it records equals the one kvtier computes offline for the same ids."""
    if shutil.which("lm_eval") is None and not _has_module("lm_eval"):
        pytest.skip("lm-evaluation-harness (lm_eval) is not installed")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvtier_mc.yaml").write_text(TASK.format(data=data))
    out_dir = tmp_path / "results"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OPENAI_API_KEY": "unused",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        f"model={MODEL_NAME},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,tokenized_requests=True",
        "--tasks",
        "kvtier_mc",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = [json.loads(line) for f in out_dir.rglob("samples_kvtier_mc_*.jsonl") for line in f.open()]
    assert len(samples) == len(ITEMS)
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    acc = results["results"]["kvtier_mc"]["acc,none"]

    from kvtier import LLM, SamplingParams

    tok_llm = LLM(str(server_model_dir), dtype="float32", block_size=4, num_device_blocks=64)
    try:
        tok = tok_llm.tokenizer
        correct = 0
        for s in samples:
            doc = s["doc"]
            context = f"Q: {doc['question']}\nA:"
            lls = []
            for k, choice in enumerate(doc["choices"]):
                ctx = tok.encode(context, add_special_tokens=False)
                ids = tok.encode(context + " " + choice, add_special_tokens=False)
                out = tok_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
                ll = sum(out.prompt_logprobs[p][ids[p]] for p in range(len(ctx), len(ids)))
                lls.append(ll)
                assert float(s["filtered_resps"][k][0]) == pytest.approx(ll, abs=1e-3), (doc, choice)
            correct += max(range(len(lls)), key=lls.__getitem__) == doc["answer"]
        assert acc == pytest.approx(correct / len(samples))
    finally:
        tok_llm.close()


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
