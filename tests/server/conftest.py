"""A real `kvtier serve` subprocess on a free loopback port, driven over HTTP.

`serve(*flags)` starts one (tiny float32 byte-level model, small pool) and waits for /health;
the module-scoped `server` fixture is shared by the tests of a file. Helpers: serverutil.py.

Both engine clients, one fixture: every test that asks for `serve`, `server` or `engine_mode`
(directly or through a fixture of its module) runs twice, `[process]` (the engine core in its
own process, `kvtier serve`'s default) and `[in-process]` (--engine-in-process, the engine in
a thread of the server); the mode is the first part of the test id (`-k in-process` selects
one mode). `serve` adds --engine-in-process for the second, once (a test passing it itself is
not doubled). Hypothesis fuzzing (seconds a mode) and the hostile-input matrix run in both
modes too. CI time: run twice, tests/server took 779 s instead of 513 s on a shared 2-core
machine (issue 30); the slowest new duplicates, 72 s of that, run in the default process
mode only (an `engine_modes("process")` marker where each is, saying why): the load test
test_concurrent_streaming_clients, test_lm_eval_local_completions_loglikelihood (its echo +
logprobs path runs in both modes in test_vllm_extras.py), test_fleet_keys.py (two servers
and Redis a test; purges run in both modes in test_purge*.py) and
test_per_key_concurrency_429_with_retry_after (a limit of the HTTP layer, before the engine).
The HTTP-layer features added later are pinned to the process mode by module (the engine mode
is the transport under them, not part of them), each keeping in both modes the test that
crosses the engine client: test_responses_api.py (a translation onto the chat route; one
request plain and streamed, test_text_and_stream_agree, in both), test_lora_serving.py (adapter
names, /v1/models, the admin routes; requests carrying adapters and the runtime load, the
engine's refusal of one included, in both), test_vllm_endpoints.py (SageMaker routes, /load,
request fields, TLS; the reset of the prefix cache and its tiers in both) and
test_grafana_queries.py (series names, types and twins; the dashboard's queries, which read the
engine's statistics, in both): 55 fewer runs, about 10 s of tests/server's 734 s (most of a
duplicate's cost is its server's start, and each module still starts one per mode).

One mode only, each for its own reason:
- an `engine_modes(...)` marker (pyproject's markers) pins a test, class or module;
  test_grammar_hardening's in-process validation test is in-process only (it starts its own
  --engine-in-process server and counts its decode errors from 0).
- PINNED below, for modules owned elsewhere: test_engine_process.py is about the engine
  process (its pid, a crash of it, its metrics): process only, but for its
  --engine-in-process test (in-process only).
Not through `serve`, so not parametrized: test_vllm_drop_in.py and test_vllm_command_lines.py
(vLLM's command lines as they are: the default process mode), the in-process apps over an engine in the test process
(test_metrics.py, test_ttl.py, test_drift_metrics.py's offline part), test_async_engine.py
(the in-process client itself) and the unit tests (flags, detokenizer, tool parsers,
template limits).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serverutil import (
    ENGINE_MODES,
    MAX_MODEL_LEN,
    Server,
    start_redis,
    start_server,
    stop_redis,
    stop_server,
)

# Tests of modules this harness does not own, pinned to one engine mode (a module's own
# `pytestmark = pytest.mark.engine_modes(...)` would do the same): "file" or "file::test".
PINNED: dict[str, tuple[str, ...]] = {
    # the engine core in its own process: its pid, its crash, its metrics
    "test_engine_process.py": ("process",),
    # starts `serve("--engine-in-process")` itself
    "test_engine_process.py::test_engine_in_process_still_serves": ("in-process",),
}


def engine_modes_of(metafunc: pytest.Metafunc) -> tuple[str, ...]:
    """The engine modes a test runs in: its `engine_modes` marker (closest: the test's, then its
    class's, then its module's), else PINNED, else both."""
    marker = metafunc.definition.get_closest_marker("engine_modes")
    if marker is not None:
        modes = tuple(marker.args)
    else:
        file = Path(str(metafunc.definition.path)).name
        modes = PINNED.get(f"{file}::{metafunc.function.__name__}", PINNED.get(file, ENGINE_MODES))
    if not modes or any(m not in ENGINE_MODES for m in modes):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: engine_modes {modes!r}, not some of {ENGINE_MODES}")
    return modes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that starts a server through `serve` / `server` / `engine_mode` (directly or
    through a fixture of its module) runs once per engine mode; the mode is in its id."""
    if "engine_mode" in metafunc.fixturenames:
        metafunc.parametrize("engine_mode", engine_modes_of(metafunc), indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine_mode(request: pytest.FixtureRequest) -> str:
    """ "process" (the engine core in its own process, `kvtier serve`'s default) or "in-process"
    (--engine-in-process): set per test by pytest_generate_tests."""
    return request.param


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with the byte-level tokenizer and chat template."""
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    d = tmp_path_factory.mktemp("server_model")
    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=MAX_MODEL_LEN,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    return d


@pytest.fixture(scope="module")
def serve(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, engine_mode: str):
    """serve(*flags) -> Server in `engine_mode`; every server started is stopped at the end of
    the module."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("serve_logs")

    def _serve(*flags: str) -> Server:
        server = start_server(server_model_dir, log_dir, *flags, engine_mode=engine_mode)
        started.append(server)
        return server

    yield _serve
    for server in started:
        stop_server(server)


@pytest.fixture(scope="module")
def server(serve) -> Iterator[Server]:
    s = serve("--max-body-bytes", "64KiB")
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port (skips if Debian's redis-server is absent)."""
    pytest.importorskip("redis")
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop_redis(proc)


@pytest.fixture(scope="module")
def llm(server_model_dir: Path):
    """The offline engine over the servers' checkpoint and pool: what a server must match."""
    from serverutil import BLOCK_SIZE, NUM_DEVICE_BLOCKS

    from kvtier import LLM

    with LLM(str(server_model_dir), dtype="float32", num_device_blocks=NUM_DEVICE_BLOCKS, block_size=BLOCK_SIZE) as llm:
        yield llm
