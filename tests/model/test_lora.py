"""LoRA adapters in the forward pass (kvtier.model.lora) and their loading (kvtier.lora), against
transformers + PEFT in float32:

- one step with rows of two adapters and of the base model (prefill chunks over shuffled blocks,
  then decode rows beside a prefill chunk) gives PEFT's logits for every row;
- rslora, per-module ranks (rank_pattern) and alphas (alpha_pattern) scale as PEFT scales;
- on a model whose projections stay quantized (a Q8_0 GGUF file) the adapter adds to the quantized
  projection's output, a step with adapter rows never takes the one-call fused decode (a base-only
  step still does), and greedy tokens equal transformers' GGUF loading + PEFT;
- what kvtier cannot serve (DoRA, LoRA biases, embedding or lm_head LoRA, modules_to_save, a rank
  above max_lora_rank, another model's adapter, a missing or broken directory) is a ValueError
  naming the adapter.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from lorautil import make_adapter, peft_greedy, peft_model
from quantutil import spy_fused_decode

from kvtier.lora import LoRAConfig, LoRARegistry, LoRARequest, load_adapter
from kvtier.model import native
from kvtier.model.lora import LoRABatch
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput
from tests.model.test_gguf import needs_smollm2, smollm2_path

pytest.importorskip("peft", reason="PEFT is the reference (pip install 'kvtier[test]')")

BLOCK_SIZE = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    """family -> (adapter a: every projection, adapter b: q/v/down with rslora)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        d = tiny_model_dirs[family]
        a = make_adapter(d, root / family / "a", seed=1)
        b = make_adapter(d, root / family / "b", targets=["q_proj", "v_proj", "down_proj"], seed=2, use_rslora=True)
        out[family] = (a, b)
    return out


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def peft_logits(model_dir: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        model = peft_model(str(model_dir), None if adapter is None else str(adapter))
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def registry(runner: ModelRunner, max_rank: int = 16) -> LoRARegistry:
    return LoRARegistry(LoRAConfig(max_loras=2, max_lora_rank=max_rank), runner.arch, runner.dtype)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_of_two_adapters_and_the_base_model_in_one_step_match_peft(family, tiny_model_dirs, adapters):
    model_dir = tiny_model_dirs[family]
    path_a, path_b = adapters[family]
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=64)
    runner.enable_lora(2)
    loras = registry(runner)
    a = loras.get(LoRARequest("a", 1, str(path_a)))
    b = loras.get(LoRARequest("b", 2, str(path_b)))
    # four sequences: a, base, b, a (adapter a's rows are not contiguous), over shuffled blocks
    specs = [
        (a, path_a, prompt(1, 13)),
        (None, None, prompt(2, 9)),
        (b, path_b, prompt(3, 11)),
        (a, path_a, prompt(4, 6)),
    ]
    rng = random.Random(5)
    pool = list(range(64))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(8)] for _ in specs]
    refs = [peft_logits(model_dir, path, ids) for _, path, ids in specs]

    def seq(i: int, start: int, end: int) -> ScheduledSeq:
        adapter, _, ids = specs[i]
        return ScheduledSeq(f"s{i}", ids[start:end], start, tables[i], sample=True, lora=adapter)

    # step 1: every prompt but its last token (sequence 3: but its last two)
    ends = [len(ids) - 1 for _, _, ids in specs]
    ends[3] -= 1
    logits = runner.execute(SchedulerOutput(seqs=[seq(i, 0, e) for i, e in enumerate(ends)]))
    for i, e in enumerate(ends):
        torch.testing.assert_close(logits[i], refs[i][e - 1], atol=ATOL, rtol=0, msg=f"sequence {i}")
    # step 2: decode rows of 0-2 beside a two-token chunk of 3
    step2 = [
        seq(0, ends[0], ends[0] + 1),
        seq(1, ends[1], ends[1] + 1),
        seq(2, ends[2], ends[2] + 1),
        seq(3, ends[3], ends[3] + 2),
    ]
    logits = runner.execute(SchedulerOutput(seqs=step2))
    for i in range(4):
        torch.testing.assert_close(logits[i], refs[i][-1], atol=ATOL, rtol=0, msg=f"sequence {i}")
    # the adapters change the output (else this test would prove nothing)
    base = peft_logits(model_dir, None, specs[0][2])
    assert (base[-1] - refs[0][-1]).abs().max() > 0.1


def test_rank_and_alpha_patterns_scale_as_peft(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["llama"]
    path = make_adapter(
        model_dir,
        tmp_path / "p",
        r=8,
        alpha=16,
        seed=3,
        rank_pattern={"v_proj": 4, "down_proj": 2},
        alpha_pattern={"down_proj": 6, "q_proj": 3},
    )
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=16)
    runner.enable_lora(1)
    adapter = registry(runner).get(LoRARequest("p", 1, str(path)))
    assert adapter.max_rank == 8
    ids = prompt(6, 10)
    logits = runner.execute(SchedulerOutput(seqs=[ScheduledSeq("s", ids, 0, [0, 1, 2], True, lora=adapter)]))
    torch.testing.assert_close(logits[0], peft_logits(model_dir, path, ids)[-1], atol=ATOL, rtol=0)


def test_the_step_groups_rows_by_adapter(tiny_model_dirs, adapters):
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="float32", device="cpu", block_size=4, num_blocks=4)
    loras = registry(runner)
    a = loras.get(LoRARequest("a", 1, str(adapters["llama"][0])))
    b = loras.get(LoRARequest("b", 2, str(adapters["llama"][1])))
    assert LoRABatch.build([None, None], [3, 1], runner.device) is None
    batch = LoRABatch.build([a, None, b, b, a], [3, 2, 4, 1, 1], runner.device)
    assert batch is not None
    groups = {w.name: rows for w, rows in batch.groups}
    assert groups["b"] == slice(5, 10)  # two neighbouring sequences of b: one slice
    assert isinstance(groups["a"], torch.Tensor) and groups["a"].tolist() == [0, 1, 2, 10]
    # a second copy of an adapter's files under another name is the same adapter (same key)
    assert loras.get(LoRARequest("a-again", 7, str(adapters["llama"][0]))).key == a.key != b.key


def test_a_bfloat16_model_runs_adapters_in_bfloat16(tiny_model_dirs, adapters):
    """The adapter's product in the model dtype: bfloat16 logits within bfloat16 rounding of the
    float32 ones, far nearer them than to the base model's."""
    ids = prompt(9, 12)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(tiny_model_dirs["llama"], dtype=dtype, device="cpu", block_size=4, num_blocks=8)
        runner.enable_lora(1)
        adapter = registry(runner).get(LoRARequest("a", 1, str(adapters["llama"][0])))
        assert adapter.layers[0][0] is not None and adapter.layers[0][0][0].dtype == runner.dtype
        seqs = [ScheduledSeq("s", ids, 0, [0, 1, 2], True, lora=adapter), ScheduledSeq("t", ids, 0, [3, 4, 5], True)]
        logits[dtype] = runner.execute(SchedulerOutput(seqs=seqs)).float()
    with_lora, base = logits["float32"]
    error = float((logits["bfloat16"][0] - with_lora).abs().max())
    assert error < 0.1 < float((with_lora - base).abs().max())


def test_adapter_weights_take_the_model_dtype(tiny_model_dirs, adapters):
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="float32", device="cpu", block_size=4, num_blocks=4)
    w = load_adapter(LoRARequest("a", 1, str(adapters["llama"][0])), runner.arch, torch.bfloat16, 16)
    ab = [t for layer in w.layers for pair in layer if pair is not None for t in pair]
    assert len(ab) == 2 * 4 * runner.arch.num_layers and all(t.dtype == torch.bfloat16 for t in ab)


# ------------------------------------------------------------------------ quantized projections
def test_lora_on_quantized_projections_and_the_fused_decode_step(tiny_model_dirs, adapters, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    from peft import PeftModel

    from kvtier import LLM, LoRARequest, SamplingParams
    from tests.model.test_gguf import write_gguf

    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "llama-q8.gguf", "llama", matrix_type="Q8_0")
    adapter = adapters["llama"][0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ref = PeftModel.from_pretrained(ref, str(adapter)).eval()
    calls = spy_fused_decode(monkeypatch)
    llm = LLM(str(path), dtype="float32", num_device_blocks=32, block_size=4, enable_lora=True)
    fused = llm.engine.runner.model.fused_decode is not None and native.decode_model_f32_lib() is not None
    ids = prompt(7, 9)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = llm.generate([ids], sp, lora_request=LoRARequest("a", 1, str(adapter)))[0].outputs[0].token_ids
    with torch.inference_mode():
        want = ref.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert list(got) == want
    assert calls == []  # every step had the adapter's rows: never the fused call
    base = llm.generate([ids], sp)[0].outputs[0].token_ids
    assert base != got
    if fused:
        assert calls and all(calls)  # base-only decode steps still take it
    llm.check_integrity()


# ------------------------------------------------------------------------ what is refused
@pytest.fixture(scope="module")
def llama_arch(tiny_model_dirs):
    from kvtier.model.loader import arch_config

    return arch_config(tiny_model_dirs["llama"])


def load(path: Path, arch, max_rank: int = 16):
    return load_adapter(LoRARequest("bad", 3, str(path)), arch, torch.float32, max_rank)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, r"DoRA"),
        ({"bias": "lora_only"}, r"bias='lora_only' is not supported"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save"),
        ({"targets": ["q_proj", "embed_tokens"]}, r"embed_tokens"),
        ({"targets": ["q_proj", "lm_head"]}, r"lm_head"),
    ],
    ids=["dora", "bias", "modules_to_save", "embedding", "lm_head"],
)
def test_what_kvtier_cannot_serve_is_a_clear_error(config, message, tiny_model_dirs, llama_arch, tmp_path):
    config = dict(config)
    path = make_adapter(tiny_model_dirs["llama"], tmp_path / "x", targets=config.pop("targets", None), **config)
    with pytest.raises(ValueError, match=rf"LoRA adapter 'bad' .*{message}"):
        load(path, llama_arch)


def test_a_rank_above_max_lora_rank_names_the_adapter_and_module(tiny_model_dirs, llama_arch, tmp_path):
    path = make_adapter(tiny_model_dirs["llama"], tmp_path / "r32", r=32, alpha=32)
    with pytest.raises(
        ValueError, match=r"LoRA adapter 'bad' .*model\.layers\.0\.\S+ has rank 32, above max_lora_rank=16"
    ):
        load(path, llama_arch)
    assert load(path, llama_arch, max_rank=32).max_rank == 32


def test_an_adapter_of_another_model_is_refused(tiny_model_dirs, tmp_path):
    from kvtier.model.loader import arch_config

    path = make_adapter(tiny_model_dirs["qwen3"], tmp_path / "q3")  # head_dim 32: other q/k/v shapes
    with pytest.raises(ValueError, match=r"do not fit the base model"):
        load(path, arch_config(tiny_model_dirs["llama"]))


def test_missing_and_broken_adapter_files(tiny_model_dirs, adapters, llama_arch, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA adapter 'bad' .*no adapter_config.json"):
        load(tmp_path / "nowhere", llama_arch)
    d = tmp_path / "copy"
    shutil.copytree(adapters["llama"][0], d)
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no adapter_model.safetensors or adapter_model.bin"):
        load(d, llama_arch)
    shutil.copy(adapters["llama"][0] / "adapter_model.safetensors", d)
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"does not read as JSON"):
        load(d, llama_arch)
    config = json.loads((adapters["llama"][0] / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match=r"peft_type 'IA3' is not supported"):
        load(d, llama_arch)
    with pytest.raises(ValueError, match=r"lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, str(d))


def test_a_bin_adapter_loads_as_the_safetensors_one(tiny_model_dirs, adapters, llama_arch, tmp_path):
    from safetensors.torch import load_file

    src = adapters["llama"][0]
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(src / "adapter_config.json", d)
    torch.save(load_file(str(src / "adapter_model.safetensors")), d / "adapter_model.bin")
    a, b = load(src, llama_arch), load(d, llama_arch)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for pa, pb in zip(la, lb, strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None and pb is not None:
                assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


@needs_smollm2
def test_smollm2_with_an_adapter_matches_transformers_and_peft(tmp_path):
    """SmolLM2-135M (Q4_1, served from its quantized blocks) with an adapter: the greedy tokens of
    transformers + PEFT on the same weights dequantized (`kvtier convert` writes them exactly as
    transformers' GGUF loading does, tests/model/test_gguf.py, and loads far faster)."""
    transformers = pytest.importorskip("transformers")
    from peft import LoraConfig, get_peft_model

    from kvtier import LLM, LoRARequest, SamplingParams
    from kvtier.cli.main import main

    path = smollm2_path()
    assert path is not None and main(["convert", str(path), str(tmp_path / "hf")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ref = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ref.save_pretrained(str(tmp_path / "smol"))  # the reference is the PEFT model that saved it
    ref.eval()
    llm = LLM(str(path), dtype="float32", num_device_blocks=64, enable_lora=True)
    ids = llm.get_tokenizer().encode("The capital of France is")
    with torch.inference_mode():
        want = ref.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    lora = LoRARequest("smol", 1, str(tmp_path / "smol"))
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": ids}], sp, lora_request=lora)[0].outputs[0].token_ids
    assert list(out) == want[0, len(ids) :].tolist()
    assert list(out) != list(llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids)
    llm.check_integrity()


def test_peft_greedy_helper_is_the_reference(tiny_model_dirs, adapters):
    """The engine tests compare with `peft_greedy`; it must run the adapter (not the base)."""
    d = tiny_model_dirs["llama"]
    ids = prompt(8, 7)
    assert peft_greedy(d, adapters["llama"][0], ids, 6) != peft_greedy(d, None, ids, 6)
