"""The engine core in its own process (kvtier.server.engine_proc): it is a separate process,
a crash of it reaches the clients as an error and the server exits with status 1 (never a hang),
a model that cannot load stops `kvtier serve` with the reason, and --engine-in-process still
serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, REPO


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _engine_pid(server) -> int:
    kids = [
        k
        for k in _children(server.proc.pid)
        if "kvtier.server.engine_proc" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert len(kids) == 1, kids
    return kids[0]


def test_engine_runs_in_its_own_process(server):
    pid = _engine_pid(server)
    assert pid != server.proc.pid
    out = server.openai().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=8, temperature=0.0)
    assert out.usage.completion_tokens == 8
    server.check_idle_clean()


def test_engine_crash_fails_the_streams_and_the_server_exits(serve):
    s = serve()
    client = s.openai(timeout=60.0)
    pid = _engine_pid(s)
    got: dict = {"chunks": 0}

    def stream() -> None:
        try:
            for _ in client.completions.create(
                model=MODEL_NAME,
                prompt="a long one",
                max_tokens=200,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                got["chunks"] += 1
                if got["chunks"] == 2:
                    os.kill(pid, signal.SIGKILL)  # mid-stream, as the OOM killer would
        except Exception as e:
            got["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the stream hung after the engine died"
    assert got["chunks"] < 200 and "error" in got
    assert s.proc.wait(60) == 1  # the server shut down, with a status a supervisor acts on
    log = s.log()
    assert "engine process died" in log


def test_a_model_that_cannot_load_stops_serve_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode != 0
    assert "engine process could not start" in proc.stderr


def test_engine_in_process_still_serves(serve):
    s = serve("--engine-in-process")
    assert _children(s.proc.pid) == [] or all(
        "engine_proc" not in Path(f"/proc/{k}/cmdline").read_text(errors="replace") for k in _children(s.proc.pid)
    )
    out = s.openai().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0.0)
    assert out.usage.completion_tokens == 4
    r = httpx.get(f"{s.url}/metrics", timeout=10)
    assert "kvtier:kv_cache_usage_perc" in r.text
    s.check_idle_clean()


def test_metrics_come_from_the_engine_process(server):
    server.openai().completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=3, temperature=0.0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "kvtier:kv_cache_usage_perc" in text and "kvtier:prefix_cache_queries_total" in text
    assert "kvtier:time_to_first_token_seconds_count" in text
    server.check_idle_clean()


@pytest.mark.parametrize("flag", ["--cpu-threads-bind=nobind", "--num-threads=1"])
def test_thread_flags(serve, flag):
    s = serve(flag)
    out = s.openai().completions.create(model=MODEL_NAME, prompt="threads", max_tokens=2, temperature=0.0)
    assert out.usage.completion_tokens == 2
    s.check_idle_clean()
