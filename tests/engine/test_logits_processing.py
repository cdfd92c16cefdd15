"""vLLM's logits processing in the offline API: penalties, logit_bias, allowed_token_ids,
bad_words, min_tokens masking, truncate_prompt_tokens, stop-token text, and the fields kvtier
refuses instead of ignoring. Penalised greedy output is checked token for token against a
float32 transformers loop applying vLLM's formulas."""

from __future__ import annotations

import pytest
import torch
from engineutil import clean

from kvtier import LLM, SamplingParams
from kvtier.model.sampler import SampleRow, process_row


def _vllm_penalised(
    logits: torch.Tensor, prompt: list[int], out: list[int], rp: float, fp: float, pp: float
) -> torch.Tensor:
    """vLLM's apply_penalties, written out plainly for one row."""
    logits = logits.clone()
    counts = torch.zeros_like(logits)
    for t in out:
        counts[t] += 1
    seen = set(prompt) | set(out)
    for t in seen:
        logits[t] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
    logits -= fp * counts
    logits -= pp * (counts > 0).float()
    return logits


def test_process_row_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    sp = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7)
    row = SampleRow(0, sp, None, prompt_ids=[1, 2, 3], output_ids=[3, 4, 4, 9])
    assert row.processed
    want = _vllm_penalised(logits, [1, 2, 3], [3, 4, 4, 9], 1.3, 0.4, 0.7)
    assert torch.allclose(process_row(logits, row), want)


def test_process_row_masks():
    logits = torch.zeros(20)
    sp = SamplingParams(logit_bias={5: 3.0, 6: -100.0}, allowed_token_ids=[5, 6, 7, 8])
    got = process_row(logits, SampleRow(0, sp, None, [], []))
    assert got[5] == 3.0 and got[6] == -100.0 and got[7] == 0.0
    assert torch.isinf(got[[0, 1, 9, 19]]).all()
    # min_tokens: EOS and stop_token_ids masked until min_tokens are out, not after
    sp = SamplingParams(min_tokens=2, stop_token_ids=[3])
    early = process_row(logits, SampleRow(0, sp, None, [], [1], eos_ids=(4,)))
    assert torch.isinf(early[[3, 4]]).all() and not torch.isinf(early[5])
    assert not SampleRow(0, sp, None, [], [1, 2], eos_ids=(4,)).processed
    # a two-token bad word: its last token is masked only after its first
    sp = SamplingParams()
    sp.bad_words_token_ids = [[7, 8], [9]]
    assert torch.isinf(process_row(logits, SampleRow(0, sp, None, [], [1, 7]))[[8, 9]]).all()
    assert not torch.isinf(process_row(logits, SampleRow(0, sp, None, [], [1, 6]))[8])


@pytest.mark.parametrize("rp,fp,pp", [(1.5, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, 1.2), (1.2, 0.3, 0.5)])
def test_penalised_greedy_matches_transformers(llm, byte_model_dir, reference_model, rp, fp, pp):
    model = reference_model(byte_model_dir)
    prompt = llm.tokenizer.encode("the cat sat on the mat and the cat")
    sp = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=rp,
        frequency_penalty=fp,
        presence_penalty=pp,
    )
    got = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(_vllm_penalised(logits, prompt, out, rp, fp, pp).argmax()))
    assert got == out
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert plain.outputs[0].token_ids != got or (rp, fp, pp) == (1.0, 0.0, 0.0)
    clean(llm)


def test_logit_bias_and_allowed_token_ids(llm):
    a, b = (
        llm.tokenizer.encode("a", add_special_tokens=False)[0],
        llm.tokenizer.encode("b", add_special_tokens=False)[0],
    )
    out = llm.generate("hello", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={a: 100.0}))[
        0
    ].outputs[0]
    assert out.token_ids == [a] * 8 and out.text == "a" * 8
    outs = llm.generate(
        "hello", SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[a, b])
    )[0]
    assert all(set(c.token_ids) <= {a, b} for c in outs.outputs)
    clean(llm)


def test_bad_words_never_generated(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = llm.generate("hello", sp)[0].outputs[0]
    banned = next((t for t in plain.token_ids if llm.tokenizer.decode([t]).strip()), None)
    if banned is None:
        pytest.skip("greedy output of this random model is all whitespace")
    word = llm.tokenizer.decode([banned])
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word])
    out = llm.generate("hello", sp)[0].outputs[0]
    assert banned not in out.token_ids
    clean(llm)


def test_min_tokens_masks_stop_tokens(llm):
    """With a stop token that greedy would pick first, min_tokens=4 keeps it out of the first
    four tokens (vLLM masks it; it is not generated and ignored)."""
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = llm.generate("hello", sp)[0].outputs[0].token_ids[0]
    out = llm.generate(
        "hello", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=4)
    )[0].outputs[0]
    assert first not in out.token_ids[:4]
    assert len(out.token_ids) >= 4
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == first and out.stop_reason == first
    clean(llm)


def test_stop_token_text_left_out(llm):
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = llm.generate("hello", sp)[0].outputs[0]
    stop = ref.token_ids[3]
    k = ref.token_ids.index(stop)
    out = llm.generate("hello", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref.token_ids[: k + 1]
    assert out.text == llm.tokenizer.decode(ref.token_ids[:k])
    kept = llm.generate(
        "hello",
        SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.outputs[0].text == llm.tokenizer.decode(ref.token_ids[: k + 1])
    clean(llm)


def test_truncate_prompt_tokens(llm):
    ids = llm.tokenizer.encode("a fairly long prompt that will be cut down")
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0.0, truncate_prompt_tokens=5)
    )[0]
    assert out.prompt_token_ids == ids[-5:]
    ref = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    clean(llm)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt_logprobs=-3), "prompt_logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
def test_bad_params_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_refusals_lose_nothing(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["hi", "there"], SamplingParams(max_tokens=2), priority=[0, 1])
    clean(llm)


def test_llm_vllm_names(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    outs = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 1
    clean(llm)


def test_prompt_logprobs_match_transformers(byte_model_dir, reference_model):
    """Chunked (8 tokens a step), after a cache hit on the same prompt, and beside a plain
    request in the same steps: each prompt position's log-probability equals transformers'."""
    model = reference_model(byte_model_dir)
    with LLM(str(byte_model_dir), dtype="float32", num_device_blocks=96, block_size=4, max_num_batched_tokens=8) as llm:
        ids = llm.tokenizer.encode("prompt logprobs over several chunks of text")
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))  # now cached
        outs = llm.generate(
            [{"prompt_token_ids": ids}, "a neighbour"],
            [
                SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2),
                SamplingParams(max_tokens=3, temperature=0.0),
            ],
        )
        out = outs[0]
        assert outs[1].prompt_logprobs is None
        assert out.num_cached_tokens == 0  # every position computed
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            entry = plp[pos]
            assert ids[pos] in entry and 2 <= len(entry) <= 3
            assert entry[ids[pos]] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
            top2 = torch.topk(ref[pos - 1], 2).indices.tolist()
            assert set(top2) <= set(entry)
            assert [entry[t].rank for t in top2] == [1, 2]
            true_rank = int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
            assert entry[ids[pos]].rank == true_rank
            assert entry[ids[pos]].decoded_token == llm.tokenizer.decode([ids[pos]], skip_special_tokens=False)
        plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0.0))[0]
        assert plain.outputs[0].token_ids == out.outputs[0].token_ids
        clean(llm)
