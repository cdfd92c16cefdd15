"""ModelRunner logits against transformers, in float32, for every supported family.

The runner only returns logits of sampled tokens, so each test samples at the positions it wants
to check and compares with transformers' logits of the whole sequence at those positions.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtier.model import attention, linear
from kvtier.model.linear import can_pack_linears
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import BlockCopy, ScheduledSeq, SchedulerOutput

FAMILIES = ["llama", "llama3_rope", "llama_tied", "mistral", "qwen2", "qwen3"]
BLOCK_SIZE = 4  # small, so short prompts span many blocks
NUM_BLOCKS = 64
ATOL = 1e-4


def make_runner(model_dir: Path, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def hf_logits(reference_model, model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(token_ids), vocab]."""
    with torch.inference_mode():
        return reference_model(model_dir)(torch.tensor([token_ids])).logits[0].float()


def blocks_for(num_tokens: int, rng: random.Random, pool: list[int]) -> list[int]:
    """Take ceil(num_tokens / BLOCK_SIZE) random, non-contiguous block ids out of `pool`."""
    return [pool.pop(rng.randrange(len(pool))) for _ in range(-(-num_tokens // BLOCK_SIZE))]


def step(*seqs: ScheduledSeq, copies: list[BlockCopy] | None = None) -> SchedulerOutput:
    return SchedulerOutput(seqs=list(seqs), block_copies=copies or [])


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prefill_matches_transformers(family, tiny_model_dirs, reference_model):
    model_dir = tiny_model_dirs[family]
    ids = prompt(1, 29)
    runner = make_runner(model_dir)
    logits = runner.execute(step(ScheduledSeq("a", ids, 0, list(range(8)), sample=True)))
    assert logits.shape == (1, runner.arch.vocab_size)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_logits(reference_model, model_dir, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("fold_max_tokens", [attention.FOLD_MAX_QUERY_TOKENS, 2], ids=["folded", "repeated"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_over_shuffled_blocks_matches_transformers(
    family, fold_max_tokens, tiny_model_dirs, reference_model, monkeypatch
):
    """Chunks continue from cached blocks; "repeated" forces the long-chunk attention path."""
    monkeypatch.setattr(attention, "FOLD_MAX_QUERY_TOKENS", fold_max_tokens)
    model_dir = tiny_model_dirs[family]
    ids = prompt(2, 30)
    ref = hf_logits(reference_model, model_dir, ids)
    rng = random.Random(3)
    table = blocks_for(len(ids), rng, list(range(NUM_BLOCKS)))
    runner = make_runner(model_dir)
    start = 0
    for size in (7, 1, 9, 4, 1, 8):  # chunks of one token take the batched decode path
        logits = runner.execute(step(ScheduledSeq("a", ids[start : start + size], start, table, sample=True)))
        start += size
        torch.testing.assert_close(logits[0], ref[start - 1], atol=ATOL, rtol=0, msg=f"chunk ending at {start}")
    assert start == len(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_of_prefill_chunks_and_decodes_matches_transformers(family, tiny_model_dirs, reference_model):
    """Step 1: a first chunk (not sampled) + three full prompts; step 2: the second chunk + three
    decode tokens, with one decode not sampled; logits come back in seq order, sampled ones only."""
    model_dir = tiny_model_dirs[family]
    runner = make_runner(model_dir)
    rng = random.Random(4)
    pool = list(range(NUM_BLOCKS))
    long_prompt = prompt(10, 17)
    prompts = {"b": prompt(11, 5), "c": prompt(12, 13), "d": prompt(13, 22)}
    next_tokens = {"b": 7, "c": 99, "d": 400}
    tables = {"a": blocks_for(len(long_prompt), rng, pool)}
    tables |= {r: blocks_for(len(p) + 1, rng, pool) for r, p in prompts.items()}

    first = runner.execute(
        step(
            ScheduledSeq("a", long_prompt[:6], 0, tables["a"], sample=False),
            *(ScheduledSeq(r, p, 0, tables[r], sample=True) for r, p in prompts.items()),
        )
    )
    assert first.shape[0] == 3
    for row, (_r, p) in enumerate(prompts.items()):
        torch.testing.assert_close(first[row], hf_logits(reference_model, model_dir, p)[-1], atol=ATOL, rtol=0)

    second = runner.execute(
        step(
            ScheduledSeq("b", [next_tokens["b"]], len(prompts["b"]), tables["b"], sample=True),
            ScheduledSeq("a", long_prompt[6:], 6, tables["a"], sample=True),
            ScheduledSeq("c", [next_tokens["c"]], len(prompts["c"]), tables["c"], sample=False),
            ScheduledSeq("d", [next_tokens["d"]], len(prompts["d"]), tables["d"], sample=True),
        )
    )
    assert second.shape[0] == 3
    expected = [
        hf_logits(reference_model, model_dir, prompts["b"] + [next_tokens["b"]])[-1],
        hf_logits(reference_model, model_dir, long_prompt)[-1],
        hf_logits(reference_model, model_dir, prompts["d"] + [next_tokens["d"]])[-1],
    ]
    torch.testing.assert_close(second, torch.stack(expected), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_copy_of_partial_block_continues_like_transformers(family, tiny_model_dirs, reference_model):
    """B shares A's first 10 tokens: A's full blocks are shared by reference, the first 2 slots of
    A's third block are copied into B's own block, and B computes from position 10 on."""
    model_dir = tiny_model_dirs[family]
    runner = make_runner(model_dir)
    shared = prompt(20, 10)
    a_ids = shared + prompt(21, 3)  # A's third block holds tokens 8..11, B may only take 8..9
    b_ids = shared + prompt(22, 6)
    a_table = [5, 17, 3, 40]
    runner.execute(step(ScheduledSeq("a", a_ids, 0, a_table, sample=True)))
    b_table = [5, 17, 29, 11]
    runner.kv_pool[:, :, :, 29].fill_(3.0)  # stale data that the copy must overwrite (slots 0..1)
    logits = runner.execute(
        step(
            ScheduledSeq("b", b_ids[10:], 10, b_table, sample=True),
            copies=[BlockCopy(src_block=3, dst_block=29, num_tokens=2)],
        )
    )
    torch.testing.assert_close(logits[0], hf_logits(reference_model, model_dir, b_ids)[-1], atol=ATOL, rtol=0)
    # A's block is untouched by B's writes
    torch.testing.assert_close(
        runner.execute(step(ScheduledSeq("a", [1], 13, a_table, sample=True)))[0],
        hf_logits(reference_model, model_dir, a_ids + [1])[-1],
        atol=ATOL,
        rtol=0,
    )


def test_blocks_restored_into_other_ids_give_bit_identical_logits(tiny_llama_dir):
    """A tier restore (read_blocks -> write_blocks into other block ids) and a device hit continue
    with exactly the same float32 logits when the continuing step is the same."""
    ids = prompt(5, 22)
    hit = make_runner(tiny_llama_dir)
    hit.execute(step(ScheduledSeq("a", ids[:16], 0, [0, 1, 2, 3], sample=False)))
    saved = hit.read_blocks([0, 1, 2, 3])
    assert saved.shape == (4, 2, 2, 2, BLOCK_SIZE, 16)  # [blocks, layers, K/V, kv heads, slots, head_dim]

    restored = make_runner(tiny_llama_dir)
    restored.write_blocks([9, 30, 4, 12], saved)
    logits_hit = hit.execute(step(ScheduledSeq("a", ids[16:], 16, [0, 1, 2, 3, 5, 6], sample=True)))
    logits_restored = restored.execute(step(ScheduledSeq("a", ids[16:], 16, [9, 30, 4, 12, 5, 6], sample=True)))
    assert torch.equal(logits_hit, logits_restored)


def test_no_sampled_seq_returns_empty_logits(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    logits = runner.execute(step(ScheduledSeq("a", prompt(6, 5), 0, [0, 1], sample=False)))
    assert logits.shape == (0, runner.arch.vocab_size)
    assert runner.execute(SchedulerOutput(block_copies=[BlockCopy(0, 2, 3)])).shape == (0, runner.arch.vocab_size)
    assert torch.equal(runner.kv_pool[:, :, :, 2, :3], runner.kv_pool[:, :, :, 0, :3])


def test_block_table_too_short_is_rejected(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(step(ScheduledSeq("a", prompt(7, 9), 0, [0, 1], sample=True)))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_prefill_and_decode_stay_close_to_float32(family, tiny_model_dirs, reference_model):
    model_dir = tiny_model_dirs[family]
    runner = make_runner(model_dir, dtype="bfloat16")
    assert runner.kv_pool.dtype == torch.bfloat16
    ids = prompt(8, 21)
    first = runner.execute(step(ScheduledSeq("a", ids, 0, list(range(6)), sample=True)))
    second = runner.execute(step(ScheduledSeq("a", [3], 21, list(range(6)), sample=True)))
    assert first.dtype == second.dtype == torch.float32
    for logits, ref in (
        (first[0], hf_logits(reference_model, model_dir, ids)[-1]),
        (second[0], hf_logits(reference_model, model_dir, ids + [3])[-1]),
    ):
        assert torch.isfinite(logits).all()
        assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


def test_packed_projection_weights_give_identical_bf16_logits(tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs["qwen2"]  # has q/k/v biases
    if not can_pack_linears(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN weight packing is not available in this torch build")
    monkeypatch.setenv(linear.PLAN_ENV, "onednn")  # not the measured plan: oneDNN at every size
    packed = ModelRunner(model_dir, dtype="bfloat16", device="cpu", block_size=BLOCK_SIZE, num_blocks=8)
    monkeypatch.setenv(linear.PLAN_ENV, "dense")
    plain = ModelRunner(
        model_dir, dtype="bfloat16", device="cpu", block_size=BLOCK_SIZE, num_blocks=8, pack_weights=False
    )
    assert packed.model.layers[0].self_attn.qkv_proj.packed_weight is not None
    assert plain.model.layers[0].self_attn.qkv_proj.packed_weight is None
    ids = prompt(9, 13)
    for runner_step in (
        step(ScheduledSeq("a", ids, 0, [0, 1, 2, 3], sample=True)),
        step(ScheduledSeq("a", [5], 13, [0, 1, 2, 3], sample=True)),
    ):
        assert torch.equal(packed.execute(runner_step), plain.execute(runner_step))
