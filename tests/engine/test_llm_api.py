"""The offline API's behaviour beyond greedy parity: text in/out, chat, stop conditions,
logprobs, sampling knobs, and clear errors that lose nothing."""

from __future__ import annotations

import math

import pytest
from engineutil import clean

from kvtier import LLM, SamplingParams
from kvtier.identity import ANONYMOUS, Tenancy
from kvtier.kvcache import root_key
from kvtier.tiers.owners import owner_id


def test_pool_reported(llm):
    assert llm.num_device_blocks == 96 and llm.block_size == 4


def test_text_prompt_roundtrip(llm):
    out = llm.generate("hello there", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.prompt == "hello there"
    assert out.prompt_token_ids == llm.tokenizer.encode("hello there")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.ttft_s is not None and out.metrics.ttft_s > 0
    assert out.metrics.e2e_s >= out.metrics.ttft_s
    clean(llm)


def test_prompt_forms_agree(llm):
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("same prompt")
    a, b, c = llm.generate(["same prompt", ids, {"prompt_token_ids": ids}], sp)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    clean(llm)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("<|user|>hi</s><|assistant|>", add_special_tokens=False)
    outs = llm.chat(
        [msgs, msgs + [{"role": "assistant", "content": "yo"}]], SamplingParams(max_tokens=2, temperature=0)
    )
    assert len(outs) == 2
    clean(llm)


def test_stop_strings_cut_the_text(llm):
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate("abc", sp)[0].outputs[0]
    # pick a stop string from the middle of the greedy text
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    out = llm.generate("abc", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < len(full.token_ids)
    incl = llm.generate(
        "abc",
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert incl.text == text[: text.find(stop) + len(stop)]
    clean(llm)


def test_streamed_text_is_decoded_in_the_engine_and_held_back_near_a_stop_string(llm):
    """A request added with stream_text: each running output carries the text final so far (a
    prefix of the next), never the start of a possible stop string; the last is the whole text."""
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    text = llm.generate("abc", sp)[0].outputs[0].text
    stop = text[6:9]
    ids = llm.tokenizer.encode("abc")
    for stops in ([], [stop]):
        core = llm.engine
        rid = core.add_request(
            ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=stops), stream_text=True
        )
        seen = [""]
        while core.has_unfinished:
            for out in core.step():
                if out.request_id == rid:
                    c = out.outputs[0]
                    assert c.text.startswith(seen[-1]) or c.finish_reason is not None
                    seen.append(c.text)
        final = seen[-1]
        assert final == (text[: text.find(stop)] if stops else text)
        running = seen[1:-1]
        assert running and all(final.startswith(t) for t in running)
        if stops:  # what could start the stop string was held back, never sent
            assert all(stop not in t for t in running)
        else:
            assert running[-1] == text[: len(running[-1])] and len(running[-1]) >= len(text) - 4
    clean(llm)


def test_stop_token_ids_and_eos(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    toks = llm.generate("xyz", sp)[0].outputs[0].token_ids
    out = llm.generate("xyz", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[toks[4]]))[0].outputs[0]
    assert out.token_ids == toks[: toks.index(toks[4]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == toks[4]
    clean(llm)


def test_logprobs(llm):
    out = llm.generate("q", SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the top token
        assert all(v <= 0 for v in lp.values())
        # vLLM's Logprob shape: .logprob, .rank (1 = most likely), .decoded_token
        assert lp[tok].rank == 1 and lp[tok].logprob == lp[tok]
        assert lp[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        assert sorted(v.rank for v in lp.values()) == list(range(1, len(lp) + 1))
    assert math.isclose(out.cumulative_logprob, sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)), rel_tol=1e-5)


def test_sampling_knobs_are_respected(llm):
    # top_k=1 is greedy whatever the temperature
    greedy = llm.generate("k", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    topk1 = (
        llm.generate("k", SamplingParams(max_tokens=6, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert topk1 == greedy
    tiny_p = (
        llm.generate("k", SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert tiny_p == greedy
    minp = (
        llm.generate("k", SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert minp == greedy
    a = llm.generate("k", SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True))[0]
    b = llm.generate("k", SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    clean(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n must be"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_input_is_rejected_and_nothing_is_lost(llm):
    sp = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], sp)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**6]], sp)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 300], sp)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=100))
    # a batch with one bad prompt adds none of them
    with pytest.raises(ValueError):
        llm.generate(["fine", [1, 2, -5]], sp)
    assert not llm.engine.has_unfinished
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], sp)
    clean(llm)
    assert llm.generate("still works", sp)[0].outputs[0].finish_reason in ("length", "stop")
    clean(llm)


def test_abort_frees_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(llm.tokenizer.encode("abort me please"), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    clean(llm)


def test_errors_for_missing_model(tmp_path):
    from kvtier.model.hf_config import ModelLoadError

    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "nope"))


@pytest.mark.parametrize("stop", ["max_tokens", "stop_token"])
def test_n_samples_whose_parent_finishes_on_its_first_token(llm, stop):
    """n > 1 where the first sampled token already ends the parent (max_tokens=1, or its stop
    token): the parent's KV is freed in that step, and each other sample still gets its own
    first token and finishes (found by the server's fuzz test: it used to crash the step)."""
    prompt = llm.tokenizer.encode("fork me")
    if stop == "max_tokens":
        sp = SamplingParams(n=4, max_tokens=1, temperature=1.0, seed=3)
    else:
        first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
        sp = SamplingParams(n=3, max_tokens=8, temperature=0.0, stop_token_ids=[first])
    out = llm.generate([prompt], sp)[0]
    assert len(out.outputs) == sp.n and all(o.finish_reason in ("length", "stop") for o in out.outputs)
    assert all(len(o.token_ids) >= 1 for o in out.outputs)
    if stop == "max_tokens":
        assert all(len(o.token_ids) == 1 for o in out.outputs)
    else:  # greedy: every sample stops on the same first token
        assert all(o.finish_reason == "stop" for o in out.outputs)
    again = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(again.outputs[0].token_ids) == 3  # the engine still serves
    clean(llm)


def test_a_requests_tenancy_is_made_once_at_the_one_entry_point(llm):
    """`add_request(tenancy=...)` (the engine loop's way, from the server) and the offline
    `tenant=`/`cache_salt=` keywords give a request the same Tenancy: the same root key, the
    owner id the tiers store under (owner_id of the name), on the request and its blocks."""
    core, sp = llm.engine, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    tenancy = Tenancy.of("acme", "acme-salt")
    a = core.add_request(list(range(10, 22)), sp, tenancy=tenancy)
    b = core.add_request(list(range(10, 22)), sp, tenant="acme", cache_salt="acme-salt")
    c = core.add_request(list(range(10, 22)), sp)
    ra, rb, rc = (core.scheduler.requests[r] for r in (a, b, c))
    assert ra.tenancy == rb.tenancy == tenancy and rc.tenancy == ANONYMOUS
    assert ra.tenancy.owner_id == owner_id("acme") and rc.tenancy.owner_id == owner_id(None)
    assert ra.root_key == rb.root_key == root_key(core.runner.fingerprint, "acme-salt")
    assert rc.root_key == root_key(core.runner.fingerprint, None) != ra.root_key
    with pytest.raises(ValueError, match="not both"):
        core.add_request([1, 2], sp, tenancy=tenancy, tenant="acme")
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        core.add_request([1, 2], sp, cache_salt=3)
    while core.has_unfinished:
        core.step()
    owners = {n.owner for n in core.kv.index.nodes()}
    assert tenancy in owners and ANONYMOUS in owners
    assert core.tenants.device_usage("acme")["blocks"] == 3  # one copy of the salted prefix
    clean(llm)
