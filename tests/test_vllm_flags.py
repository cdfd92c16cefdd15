"""vLLM's flags on kvtier's command line (kvtier.vllm_flags): each one vLLM 0.32 users paste
is implemented, a logged no-op, or refused with one line; never a traceback, never silently
ignored. The README's table is the module's table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier.cli.main import build_parser, engine_kwargs, main
from kvtier.vllm_flags import VLLM_FLAGS, check_llm_kwargs, human_readable_int, markdown_table, max_model_len

README = Path(__file__).resolve().parents[1] / "README.md"


def parse(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    return args, engine_kwargs(args, args.subparser)


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1m", 1_000_000), ("2M", 2 << 20)],
)
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["4.5K", "x", "4kb", "", "-5"])
def test_human_readable_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_max_model_len_forms():
    assert max_model_len("auto") is None and max_model_len("-1") is None and max_model_len("AUTO") is None
    assert max_model_len("4k") == 4000
    with pytest.raises(argparse.ArgumentTypeError):
        max_model_len("0")
    _, kw = parse("m", "--max-model-len", "4K")
    assert kw["max_model_len"] == 4096
    _, kw = parse("m", "--max-model-len", "auto")
    assert "max_model_len" not in kw  # the checkpoint's


def test_vllm_names_map_to_kvtier_settings():
    _, kw = parse(
        "m",
        "--kv-cache-memory-bytes",
        "1GiB",
        "--no-enable-chunked-prefill",
        "--tokenizer",
        "tok",
        "--revision",
        "v1",
        "--download-dir",
        "/cache",
    )
    assert kw["kv_cache_bytes"] == 1 << 30
    assert kw["enable_chunked_prefill"] is False
    assert (kw["tokenizer"], kw["revision"], kw["download_dir"]) == ("tok", "v1", "/cache")
    _, kw = parse("m", "--gpu-memory-utilization", "0.9")
    assert kw == {"gpu_memory_utilization": 0.9}
    _, kw = parse("m", "--kv-cache-memory-fraction", "0.3")
    assert kw == {"kv_cache_memory_fraction": 0.3}


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory-utilization", "0.9", "--kv-cache-bytes", "1GiB"],
        ["--gpu-memory-utilization", "0.9", "--kv-cache-memory-fraction", "0.2"],
        ["--quantization", "awq"],
        ["--max-model-len", "4.5K"],
        ["--bogus-flag"],
    ],
)
def test_usage_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse("m", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error:") and err.count("\n") == 1, err


NO_OPS = [
    ["--tensor-parallel-size", "1"],
    ["-tp", "1"],
    ["--pipeline-parallel-size", "1"],
    ["--data-parallel-size", "1"],
    ["--trust-remote-code"],
    ["--enforce-eager"],
    ["--disable-log-stats"],
    ["--disable-log-requests"],
    ["--distributed-executor-backend", "mp"],
    ["--load-format", "safetensors"],
    ["--tokenizer-mode", "auto"],
    ["--compilation-config", '{"level": 0}'],
    ["-O", "0"],
    ["--swap-space", "4"],
    ["--device", "cpu"],
]
REFUSED = [
    ["--tensor-parallel-size", "2"],
    ["--data-parallel-size", "4"],
    ["--distributed-executor-backend", "ray"],
    ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
    ["--reasoning-parser", "deepseek_r1"],
    ["--cpu-offload-gb", "10"],
    ["--hf-overrides", '{"rope_scaling": null}'],
    ["--limit-mm-per-prompt", '{"image": 2}'],
    ["--load-format", "bitsandbytes"],
    ["--enable-sleep-mode"],
    ["--device", "cuda"],
]


@pytest.mark.parametrize("flags", NO_OPS, ids=lambda f: " ".join(f))
def test_no_op_flags_are_accepted_and_said(flags, capsys, tmp_path):
    """A no-op flag passes the check and its note says so; the run then fails on the missing
    model, proving the flag itself was accepted (exit 2 with the model's one-line error)."""
    missing = tmp_path / "no-such-model"
    assert main(["serve", str(missing), *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert any("accepted, no effect" in line for line in err), err
    assert err[-1].startswith("kvtier: error: model") and "no such file" in err[-1], err


@pytest.mark.parametrize("flags", REFUSED, ids=lambda f: " ".join(f))
def test_refused_flags_say_one_line(flags, capsys, tmp_path):
    assert main(["serve", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1, err
    assert "not supported" in err and "Traceback" not in err


def test_negated_refused_flag_is_what_kvtier_does():
    args, _ = parse("m", "--no-enable-sleep-mode", "--no-trust-remote-code")
    from kvtier.vllm_flags import check_vllm_flags

    notes = check_vllm_flags(args)
    assert notes == ["--trust-remote-code accepted, no effect: " + VLLM_FLAGS[4].note]


def test_llm_kwargs():
    assert check_llm_kwargs({"tensor_parallel_size": 1, "enforce_eager": True, "trust_remote_code": None})
    with pytest.raises(ValueError, match="tensor_parallel_size 2: not supported"):
        check_llm_kwargs({"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        check_llm_kwargs({"speculative_config": {"method": "ngram"}})
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_paralel_size'"):
        check_llm_kwargs({"tensor_paralel_size": 1})


def test_readme_table_is_the_modules():
    """The README lists every vLLM flag kvtier knows with what it does, from this table."""
    text = README.read_text(encoding="utf-8")
    assert markdown_table() in text, "README's vLLM flag table is stale: python -m kvtier.vllm_flags"
