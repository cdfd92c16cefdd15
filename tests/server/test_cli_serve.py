"""`kvtier serve` flags: the server's own and the shared engine/tier flags."""

from __future__ import annotations

import pytest

from kvtier.cli.main import build_parser, engine_kwargs, main


def parse(*argv: str):
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    return args, engine_kwargs(args, args.subparser)


def test_defaults_and_shared_engine_flags():
    args, kw = parse(
        "--model", "m", "--num-device-blocks", "64", "--host-cache-bytes", "1GiB", "--tier-faults", "host=latency_ms=1"
    )
    assert (args.host, args.port, args.served_model_name, args.max_body_bytes) == ("127.0.0.1", 8000, None, 4 << 20)
    assert kw == {"num_device_blocks": 64, "host_cache_bytes": 1 << 30, "tier_faults": {"host": "latency_ms=1"}}


def test_server_flags():
    args, _ = parse(
        "--model",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--served-model-name",
        "llama",
        "--max-body-bytes",
        "64KiB",
    )
    assert (args.host, args.port, args.served_model_name, args.max_body_bytes) == ("0.0.0.0", 9001, ["llama"], 64 << 10)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "m", "--port", "70000"],
        ["--model", "m", "--max-body-bytes", "0"],
        ["--model", "m", "--disk-cache-bytes", "1GiB"],
    ],
)
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "kvtier: error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["a", "--model", "b"]])
def test_serve_needs_one_model(argv, capsys):
    """vLLM's `serve MODEL` or kvtier's `--model`: none, or two different ones, is a usage error."""
    assert main(["serve", *argv]) == 2
    assert "kvtier: error:" in capsys.readouterr().err
