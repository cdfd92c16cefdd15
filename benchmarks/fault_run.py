"""Fault run of `kvtier serve`: the tiers broken on purpose and hostile clients, against greedy
reference outputs. Prints one JSON line per scenario as it finishes (a killed run keeps what it
measured), then a summary line.

    python benchmarks/fault_run.py [--duration-s 12] [--clients 4] [--only redis_kill,disk_full,...]

Every scenario starts real processes on loopback: `kvtier serve` (a small random float32 Llama,
byte-level tokenizer, block size 16) over host, disk and Redis tiers, a real redis-server, and
for `disk_full` a real 8 MiB tmpfs (needs root; the scenario is skipped otherwise). Clients
stream greedy completions of a fixed prompt set and compare each text with the output of a
device-only server without tiers (the reference): a difference is a wrong output.

Scenarios
    baseline        no faults (TTFT p95 to compare with)
    redis_kill      redis-server killed (-9) a third of the way in, restarted empty at two thirds
    disk_full       disk tier on an 8 MiB tmpfs with --disk-cache-bytes 64MiB
    corrupt         every disk frame and Redis value corrupted between two server runs
    kill9           the server killed (-9) under load, restarted on the same disk and Redis
    bad_input       a hostile client beside the normal ones: lone surrogates, 100,000-deep
                    nesting, huge numbers, wrong types, 20,000 prompts in one request, 3 MB text

Per scenario: requests, wrong outputs, 5xx, stream errors, crashes (server exits other than
the planned kill), normal clients' TTFT p50/p95, hostile requests and their status codes, the
tier error counters from /metrics, and the integrity check at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvtier.bench.server import SERVED_MODEL_NAME, free_port, start, start_redis_server  # noqa: E402
from kvtier.server.sse import aiter_events  # noqa: E402

BLOCK = 16
MAX_TOKENS = 12
SCENARIOS = ("baseline", "redis_kill", "disk_full", "corrupt", "kill9", "bad_input")


def build_model(out: Path) -> Path:
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    if not (out / "config.json").exists():
        vocab = build_byte_tokenizer(out)
        build_random_llama(
            out,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=256,
            vocab_size=vocab,
            max_position_embeddings=4096,
            dtype="float32",
            bos_token_id=256,
            eos_token_id=257,
        )
    return out


def prompts(num_prefixes: int, prefix_chars: int, per_prefix: int) -> list[str]:
    rng = random.Random(0)
    words = ["cache", "tier", "block", "prefix", "tenant", "restore", "evict", "token", "host", "disk"]
    out = []
    for p in range(num_prefixes):
        prefix = f"System prompt {p}: " + " ".join(rng.choice(words) for _ in range(prefix_chars // 6))
        out += [prefix[:prefix_chars] + f" Question {q}?" for q in range(per_prefix)]
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ------------------------------------------------------------------ processes
class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc, _ = start_redis_server(self.dir, port=self.port)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def corrupt_all(self) -> int:
        import redis

        client = redis.Redis(port=self.port)
        n = 0
        for name in client.scan_iter(match="kvtier:*"):
            if client.type(name) == b"string":
                value = client.get(name)
                if value and len(value) > 200:
                    client.setrange(name, len(value) // 2, b"\xff" * 16)
                    n += 1
        return n


def serve_help() -> str:
    return subprocess.run([sys.executable, "-m", "kvtier", "serve", "--help"], capture_output=True, text=True).stdout


# ------------------------------------------------------------------ clients
class Tally:
    def __init__(self) -> None:
        self.requests = 0
        self.wrong = 0
        self.http_5xx = 0
        self.http_4xx = 0
        self.stream_errors = 0
        self.connection_errors = 0
        self.ttft_s: list[float] = []
        self.wrong_examples: list[dict] = []

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "wrong_outputs": self.wrong,
            "http_5xx": self.http_5xx,
            "http_4xx": self.http_4xx,
            "stream_errors": self.stream_errors,
            "connection_errors": self.connection_errors,
            "ttft_p50_s": percentile(self.ttft_s, 0.5),
            "ttft_p95_s": percentile(self.ttft_s, 0.95),
            "wrong_examples": self.wrong_examples[:3],
        }


async def one_request(
    client, url: str, prompt: str, tally: Tally, reference: dict[str, str] | None, headers: dict[str, str]
) -> str | None:
    import httpx

    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    text, first = "", None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code >= 500:
                tally.http_5xx += 1
                return None
            if r.status_code != 200:
                tally.http_4xx += 1
                return None
            done = False
            async for chunk in aiter_events(r):
                if chunk is None:
                    done = True
                    break
                if "error" in chunk:
                    tally.stream_errors += 1
                    return None
                piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
            if not done:
                tally.stream_errors += 1
                return None
    except (httpx.TransportError, httpx.HTTPError):
        tally.connection_errors += 1
        return None
    tally.requests += 1
    if first is not None:
        tally.ttft_s.append(first)
    if reference is not None and reference.get(prompt) != text:
        tally.wrong += 1
        tally.wrong_examples.append({"prompt": prompt[-40:], "got": text, "want": reference.get(prompt)})
    return text


async def client_loop(
    url_of,
    prompt_set: list[str],
    clients: int,
    duration_s: float,
    tally: Tally,
    reference: dict[str, str] | None,
    headers: dict[str, str],
    seed: int = 0,
) -> None:
    """`clients` workers, each sending prompts in its own random order until the time is up;
    `url_of()` is read per request (a restarted server has a new port)."""
    import httpx

    deadline = time.monotonic() + duration_s

    async def worker(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as client:
            while time.monotonic() < deadline:
                url = url_of()
                if url is None:
                    await asyncio.sleep(0.05)
                    continue
                await one_request(client, url, rng.choice(prompt_set), tally, reference, headers)

    await asyncio.gather(*(worker(i) for i in range(clients)))


async def reference_outputs(url: str, prompt_set: list[str]) -> dict[str, str]:
    import httpx

    tally = Tally()
    out: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for p in prompt_set:
            text = await one_request(client, url, p, tally, None, {})
            if text is None:
                raise RuntimeError(f"reference server failed: {tally.as_dict()}")
            out[p] = text
    return out


# ------------------------------------------------------------------ hostile bodies
def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of requests a server must answer with a 4xx."""
    m = SERVED_MODEL_NAME
    deep = "[" * 100_000 + "]" * 100_000
    return [
        ("lone_surrogate", "/v1/completions", b'{"model":"%s","prompt":"\\ud800abc","max_tokens":2}' % m.encode()),
        (
            "lone_surrogate_stream",
            "/v1/completions",
            b'{"model":"%s","prompt":"\\udfffx","max_tokens":2,"stream":true}' % m.encode(),
        ),
        (
            "lone_surrogate_chat",
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}' % m.encode(),
        ),
        ("deep_nesting", "/v1/completions", (f'{{"model":"{m}","prompt":{deep}}}').encode()),
        ("huge_float", "/v1/completions", b'{"model":"%s","prompt":"a","max_tokens":1e400}' % m.encode()),
        (
            "huge_int",
            "/v1/completions",
            ('{{"model":"{}","prompt":"a","max_tokens":{}}}'.format(m, "9" * 5000)).encode(),
        ),
        ("nan", "/v1/completions", b'{"model":"%s","prompt":"a","temperature":NaN}' % m.encode()),
        ("wrong_types", "/v1/completions", b'{"model":7,"prompt":{"a":1},"max_tokens":"x","stream":"yes"}'),
        (
            "control_chars",
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"\\u0000","content":"\\u0001\\u001f"}]}' % m.encode(),
        ),
        (
            "many_prompts",
            "/v1/completions",
            json.dumps({"model": m, "prompt": [[5, 6, 7]] * 20000, "max_tokens": 1}).encode(),
        ),
        (
            "huge_text",
            "/v1/completions",
            json.dumps({"model": m, "prompt": "word " * 600_000, "max_tokens": 1}).encode(),
        ),
    ]


async def hostile_loop(url: str, duration_s: float, out: dict[str, dict[int, int]]) -> None:
    import httpx

    deadline = time.monotonic() + duration_s
    bodies = hostile_bodies()
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < deadline:
            for name, path, body in bodies:
                if time.monotonic() >= deadline:
                    break
                try:
                    r = await client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
                    code = r.status_code
                except httpx.HTTPError:
                    code = 0
                counts = out.setdefault(name, {})
                counts[code] = counts.get(code, 0) + 1


# ------------------------------------------------------------------ metrics
def tier_counters(url: str, headers: dict[str, str]) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("kvtier:tier_errors", "kvtier:tier_errors_total"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = f"{s.labels.get('tier')}:{s.labels.get('kind')}"
                    out[key] = out.get(key, 0) + s.value
    return out


def integrity(url: str, headers: dict[str, str]) -> bool:
    import httpx

    try:
        r = httpx.post(f"{url}/admin/check_integrity", headers=headers, timeout=120)
        return r.status_code == 200 and r.json().get("ok") is True
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------ scenarios
class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path, model: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.model = str(model)
        self.help = serve_help()
        self.admin_key = "fault-run-admin-key-0123456789"
        self.admin_flags: list[str] = []
        self.headers: dict[str, str] = {}
        if "--admin-key-file" in self.help:
            key_file = workdir / "admin.key"
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.admin_key)
            self.admin_flags = ["--admin-key-file", str(key_file)]
            self.headers = {"Authorization": f"Bearer {self.admin_key}"}
        self.prompts = prompts(6, 400, 4)
        self.reference: dict[str, str] = {}

    def flags(self, *extra: str) -> list[str]:
        f = [
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--num-device-blocks",
            "96",
            "--max-num-seqs",
            "8",
            *extra,
        ]
        return f + self.admin_flags

    def start(self, name: str, *extra: str):
        return start(self.model, self.flags(*extra), self.workdir / "logs" / f"{name}-{time.time():.0f}.log")

    def make_reference(self) -> None:
        with start(
            self.model,
            ["--dtype", "float32", "--block-size", str(BLOCK), "--num-device-blocks", "512"] + self.admin_flags,
            self.workdir / "logs" / "reference.log",
        ) as server:
            self.reference = asyncio.run(reference_outputs(server.url, self.prompts))

    def clients(
        self,
        url_of,
        duration_s: float,
        tally: Tally,
        prompt_set: list[str] | None = None,
        reference: dict[str, str] | None = None,
    ) -> None:
        asyncio.run(
            client_loop(
                url_of,
                prompt_set or self.prompts,
                self.args.clients,
                duration_s,
                tally,
                self.reference if reference is None else reference,
                self.headers,
            )
        )

    def finish(self, name: str, server, tally: Tally, crashed: bool, **extra) -> dict:
        alive = server.proc.poll() is None
        result = {
            "scenario": name,
            **tally.as_dict(),
            "server_crashed": crashed or not alive,
            "tier_errors": tier_counters(server.url, self.headers) if alive else {},
            "integrity_ok": integrity(server.url, self.headers) if alive else False,
            **extra,
        }
        log = server.log_tail(200_000)
        result["tracebacks_in_log"] = log.count("Traceback")
        result["warnings_in_log"] = sum(1 for line in log.splitlines() if "WARNING" in line or "warning" in line)
        return result

    # -- the scenarios
    def baseline(self) -> dict:
        redis = Redis(self.workdir)
        redis.start()
        try:
            with self.start(
                "baseline",
                "--host-cache-bytes",
                "4MiB",
                "--disk-cache-dir",
                str(self.workdir / "disk-baseline"),
                "--remote-cache-url",
                redis.url,
            ) as server:
                tally = Tally()
                self.clients(lambda: server.url, self.args.duration_s, tally)
                return self.finish("baseline", server, tally, False)
        finally:
            redis.kill()

    def redis_kill(self) -> dict:
        redis = Redis(self.workdir)
        redis.start()
        try:
            with self.start("redis_kill", "--host-cache-bytes", "2MiB", "--remote-cache-url", redis.url) as server:
                tally = Tally()
                d = self.args.duration_s

                async def chaos() -> None:
                    await asyncio.sleep(d / 3)
                    redis.kill()
                    await asyncio.sleep(d / 3)
                    redis.start()

                async def both() -> None:
                    await asyncio.gather(
                        client_loop(
                            lambda: server.url, self.prompts, self.args.clients, d, tally, self.reference, self.headers
                        ),
                        chaos(),
                    )

                asyncio.run(both())
                # after the restart the tier must come back: a second pass stores into Redis again
                tally2 = Tally()
                self.clients(lambda: server.url, d / 2, tally2)
                import redis as redis_py

                stored_after = sum(1 for _ in redis_py.Redis(port=redis.port).scan_iter(match="kvtier:*"))
                res = self.finish("redis_kill", server, tally, False)
                res["after_restart"] = tally2.as_dict()
                res["redis_keys_after_restart"] = stored_after
                return res
        finally:
            redis.kill()

    def disk_full(self) -> dict:
        if os.getuid() != 0:
            return {"scenario": "disk_full", "skipped": "needs root to mount a tmpfs"}
        mnt = self.workdir / "tmpfs"
        mnt.mkdir(exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]).returncode != 0:
            return {"scenario": "disk_full", "skipped": "mount -t tmpfs failed"}
        try:
            # many distinct long prefixes: about 7x what 8 MiB holds
            many = prompts(40, 1200, 1)
            with start(
                self.model,
                ["--dtype", "float32", "--block-size", str(BLOCK), "--num-device-blocks", "512"],
                self.workdir / "logs" / "disk-full-ref.log",
            ) as ref_server:
                reference = asyncio.run(reference_outputs(ref_server.url, many))
            with self.start("disk_full", "--disk-cache-dir", str(mnt), "--disk-cache-bytes", "64MiB") as server:
                tally = Tally()
                self.clients(lambda: server.url, self.args.duration_s * 1.5, tally, many, reference)
                usage = shutil.disk_usage(mnt)
                frames = sum(1 for _ in mnt.rglob("*.kv"))
                res = self.finish("disk_full", server, tally, False)
                res.update(tmpfs_used_bytes=usage.used, frames_on_disk=frames)
                return res
        finally:
            subprocess.run(["umount", "-l", str(mnt)])

    def corrupt(self) -> dict:
        redis = Redis(self.workdir)
        redis.start()
        disk = self.workdir / "disk-corrupt"
        try:
            flags = ("--disk-cache-dir", str(disk), "--remote-cache-url", redis.url)
            with self.start("corrupt-1", *flags) as server:
                self.clients(lambda: server.url, self.args.duration_s / 2, Tally())
            frames = list(disk.rglob("*.kv"))
            for path in frames:
                data = bytearray(path.read_bytes())
                data[len(data) // 2 : len(data) // 2 + 16] = b"\xff" * 16
                path.write_bytes(bytes(data))
            n_redis = redis.corrupt_all()
            with self.start("corrupt-2", *flags) as server:
                tally = Tally()
                self.clients(lambda: server.url, self.args.duration_s, tally)
                res = self.finish("corrupt", server, tally, False)
                res.update(corrupted_disk_frames=len(frames), corrupted_redis_values=n_redis)
                return res
        finally:
            redis.kill()

    def kill9(self) -> dict:
        redis = Redis(self.workdir)
        redis.start()
        disk = self.workdir / "disk-kill9"
        flags = ("--host-cache-bytes", "2MiB", "--disk-cache-dir", str(disk), "--remote-cache-url", redis.url)
        current = {"server": self.start("kill9-1", *flags)}
        try:
            tally = Tally()
            d = self.args.duration_s
            restart_s: list[float] = []

            async def chaos() -> None:
                await asyncio.sleep(d / 3)
                current["server"].proc.kill()
                current["server"].proc.wait()
                dead = current["server"]
                current["server"] = None
                t0 = time.monotonic()
                current["server"] = await asyncio.to_thread(self.start, "kill9-2", *flags)
                restart_s.append(time.monotonic() - t0)
                del dead

            def url_of():
                s = current["server"]
                return None if s is None else s.url

            async def both() -> None:
                await asyncio.gather(
                    client_loop(url_of, self.prompts, self.args.clients, d, tally, self.reference, self.headers),
                    chaos(),
                )

            asyncio.run(both())
            res = self.finish("kill9", current["server"], tally, False)
            res["restart_to_healthy_s"] = restart_s[0] if restart_s else None
            res["note"] = "connection_errors are the requests in flight when the server was killed"
            return res
        finally:
            if current["server"] is not None:
                current["server"].stop()
            redis.kill()

    def bad_input(self) -> dict:
        with self.start("bad_input", "--host-cache-bytes", "4MiB") as server:
            tally = Tally()
            hostile: dict[str, dict[int, int]] = {}
            d = self.args.duration_s

            async def both() -> None:
                await asyncio.gather(
                    client_loop(
                        lambda: server.url, self.prompts, self.args.clients, d, tally, self.reference, self.headers
                    ),
                    hostile_loop(server.url, d, hostile),
                )

            asyncio.run(both())
            res = self.finish("bad_input", server, tally, False)
            res["hostile"] = {name: {str(k): v for k, v in codes.items()} for name, codes in hostile.items()}
            res["hostile_5xx"] = sum(v for codes in hostile.values() for k, v in codes.items() if k >= 500 or k == 0)
            return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=12.0, help="client time per scenario")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs Debian's redis-server on PATH")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-fault-"))
    try:
        run = Run(args, workdir, build_model(workdir / "model"))
        run.make_reference()
        load = os.getloadavg()
        results = []
        for name in names:
            t0 = time.monotonic()
            res = getattr(run, name)()
            res["wall_s"] = round(time.monotonic() - t0, 1)
            res["loadavg_1m"] = round(os.getloadavg()[0], 2)
            results.append(res)
            line = json.dumps(res)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
        total = {
            k: sum(r.get(k, 0) or 0 for r in results)
            for k in ("requests", "wrong_outputs", "http_5xx", "hostile_5xx", "stream_errors")
        }
        total["crashes"] = sum(bool(r.get("server_crashed")) for r in results)
        total["integrity_failures"] = sum(r.get("integrity_ok") is False for r in results)
        print(json.dumps({"summary": total, "loadavg_at_start": load, "cpus": os.cpu_count()}), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
