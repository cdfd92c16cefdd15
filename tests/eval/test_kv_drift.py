"""`kvtier eval-kv`: the positions it scores, what it reports, its CLI. A tiny random float32
model: the numbers mean nothing here (docs/benchmarks.md has them on trained weights), so the
tests check that the scored positions are the documented ones (against transformers), that a KV
dtype equal to the reference shows no drift and a quantized one does."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from kvtier.cli.main import main
from kvtier.eval.kv_drift import EvalKVConfig, evaluate_kv, format_table

LENGTHS = (24, 40)
SCORE = 8


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    d = tmp_path_factory.mktemp("eval_model")
    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=128,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    text = d / "text.txt"
    text.write_text("a cache of keys and values, kept in blocks, read by every step. " * 4)
    return d, text


def config(model_and_text, **kw) -> EvalKVConfig:
    model, text = model_and_text
    return EvalKVConfig(
        model=str(model),
        text=str(text),
        **{"context_lengths": LENGTHS, "score_tokens": SCORE, "num_windows": 2, "block_size": 4, **kw},
    )


def test_reference_scores_the_documented_positions(model_and_text):
    """The reference perplexity at length L is the one of each window's last S tokens given the
    L - S + 1 .. L tokens before them, which transformers computes independently in one pass."""
    transformers = pytest.importorskip("transformers")
    from kvtier.model.tokenizer import Tokenizer

    model_dir, text = model_and_text
    res = evaluate_kv(config(model_and_text, kv_dtypes=("float32",)))
    tokens = Tokenizer(model_dir).encode(text.read_text())
    span = max(LENGTHS) + 1
    windows = [tokens[i * span : (i + 1) * span] for i in range(2)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for L in LENGTHS:
        nll = []
        for win in windows:
            seq = win[span - (L + 1) :]
            with torch.no_grad():
                logits = hf(torch.tensor([seq])).logits[0]
            lp = torch.log_softmax(logits.double(), -1)
            nll += [-float(lp[p, seq[p + 1]]) for p in range(L - SCORE, L)]
        ref = next(r for r in res.rows if r.reference and r.context_length == L)
        assert ref.num_tokens == 2 * SCORE
        assert ref.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def test_same_dtype_as_reference_has_zero_drift_and_quantized_has_some(model_and_text):
    res = evaluate_kv(config(model_and_text, kv_dtypes=("float32", "fp8_e5m2", "int8")))
    rows = {(r.kv_dtype, r.context_length, r.reference): r for r in res.rows}
    assert len(rows) == 4 * len(LENGTHS)  # the reference + three KV dtypes, each length
    for L in LENGTHS:
        same = rows[("float32", L, False)]
        ref = rows[("float32", L, True)]
        assert same.mean_kl == 0.0 and same.top1_agreement == 1.0 and same.ppl == ref.ppl
        e5m2, int8 = rows[("fp8_e5m2", L, False)], rows[("int8", L, False)]
        # 2 mantissa bits vs 127 levels per block and head: e5m2 drifts more
        assert e5m2.mean_kl > int8.mean_kl > 0.0
        assert e5m2.max_kl >= e5m2.mean_kl
    table = format_table(res)
    assert "fp8_e5m2" in table and "float32*" in table


def test_default_compares_every_kv_dtype_but_the_reference(model_and_text):
    res = evaluate_kv(config(model_and_text, context_lengths=(24,), num_windows=1))
    compared = [r.kv_dtype for r in res.rows if not r.reference]
    assert compared == ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_rot", "int8_tok", "fp8_e4m3_rot"]


def test_config_and_text_errors(model_and_text, tmp_path):
    with pytest.raises(ValueError, match="score-tokens"):
        config(model_and_text, score_tokens=24)
    short = tmp_path / "short.txt"
    short.write_text("too short for a window of 100 tokens")
    with pytest.raises(ValueError, match="longer text"):
        evaluate_kv(EvalKVConfig(model=str(model_and_text[0]), text=str(short), context_lengths=(100,), score_tokens=8))
    with pytest.raises(ValueError, match="positions"):
        evaluate_kv(config(model_and_text, context_lengths=(500,), score_tokens=8))


def test_cli_json_and_plot(model_and_text, tmp_path, capsys):
    model, text = model_and_text
    png = tmp_path / "drift.png"
    argv = [
        "eval-kv",
        "--model",
        str(model),
        "--text",
        str(text),
        "--kv-dtypes",
        "int8",
        "--context-lengths",
        "24,40",
        "--score-tokens",
        "8",
        "--num-windows",
        "1",
        "--block-size",
        "4",
        "--json",
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["kv_dtype"], r["context_length"]) for r in out["rows"]] == [
        ("float32", 24),
        ("float32", 40),
        ("int8", 24),
        ("int8", 40),
    ]
    assert out["config"]["score_tokens"] == 8 and out["num_windows"] == 1
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_usage_errors(model_and_text, capsys):
    model, text = model_and_text
    with pytest.raises(SystemExit) as e:
        main(["eval-kv", "--model", str(model), "--text", str(text), "--kv-dtypes", "fp4"])
    assert e.value.code == 2 and "invalid KV dtype 'fp4'" in capsys.readouterr().err
    assert main(["eval-kv", "--model", str(model), "--text", str(text), "--context-lengths", "4000"]) == 2
    assert "exceeds the model's 128 positions" in capsys.readouterr().err
