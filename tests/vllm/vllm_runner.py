"""Runs vLLM (in the vLLM virtual environment) for the connector tests and benchmarks.

    python vllm_runner.py spec.json out.json

spec: {"model": dir, "dtype": "float32", "kv_cache_bytes": int, "connector": {extra config} | null,
       "max_num_seqs": 8, "max_model_len": 1024, "block_size": 128,
       "phases": [{"prompts": [[ids...], ...], "max_tokens": 8, "salts": [..] | null,
                   "before": {"kill_pid": int} | {"corrupt_dir": dir} |
                             {"wait_files": {"dir": dir, "count": n, "timeout_s": s}} |
                             {"count_files": {"dir": dir, "count": n, "timeout_s": s}} |
                             {"purge": {"salt": .., "disk_cache_dir": .., "wait_s": s}} |
                             {"reset_prefix_cache": true} | null}, ...]}
out:  {"phases": [{"outputs": [[ids...]], "cached": [n...], "seconds": s, "ttft": [...],
                   "metrics": {kvtier metrics after the phase}, "files": n (count_files)}],
       "metrics": {...}}

Every phase's prompts are submitted together (one generate call); greedy decoding.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _connector_config(extra: dict):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def _count_files(directory: str) -> int:
    return sum(name.endswith(".kv") for _, _, files in os.walk(directory) for name in files)


def _wait_files(dir: str, count: int, timeout_s: float = 120.0) -> None:
    """Until `dir` holds `count` finished entries (*.kv; writes in flight are *.tmp). Raises after
    `timeout_s`, so a lost write fails the run instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while (found := _count_files(dir)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dir}: {found} of {count} entries after {timeout_s} s")
        time.sleep(0.05)


def _count_files_until(dir: str, count: int, timeout_s: float = 60.0) -> int:
    """The entries in `dir` once there are `count` (or after `timeout_s`: however many there are,
    for the test to assert on)."""
    deadline = time.monotonic() + timeout_s
    while (found := _count_files(dir)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _kvtier_metrics(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if "kvtier" in metric.name:
            out[metric.name] = getattr(metric, "value", None)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replay_events(port: int) -> list[dict]:
    """Every batch the publisher buffered, from seq 0 (a DEALER on its replay socket), decoded
    with vLLM's own structs: one dict per event (its fields, "type" its class)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    events = []
    while dealer.poll(10_000):
        _, _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        for ev in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
            events.append({"type": type(ev).__name__, **msgspec.to_builtins(ev)})
    dealer.close(linger=0)
    ctx.term()
    return events


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    import kvtier

    print(f"kvtier imported from {os.path.dirname(os.path.abspath(kvtier.__file__))}", flush=True)
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size", 128),
        seed=0,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        enforce_eager=spec.get("enforce_eager", True),
        disable_log_stats=False,
    )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = _connector_config(spec["connector"])
    replay_port = None
    if spec.get("kv_events"):  # vLLM's KV events, kvtier's tiers among them: read back by replay
        from vllm.config import KVEventsConfig

        replay_port = _free_port()
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{_free_port()}",
            replay_endpoint=f"tcp://*:{replay_port}",
        )
    llm = LLM(**kwargs)
    out = {"phases": []}
    for phase in spec["phases"]:
        before = phase.get("before") or {}
        if "wait_files" in before:  # the connector writes to disk asynchronously: wait for its files
            _wait_files(**before["wait_files"])
        num_files = _count_files_until(**before["count_files"]) if "count_files" in before else None
        if "kill_pid" in before:
            os.kill(int(before["kill_pid"]), 9)
            time.sleep(0.2)
        if "sigstop_pid" in before:
            os.kill(int(before["sigstop_pid"]), 19)
        if "corrupt_dir" in before:
            for root, _, files in os.walk(before["corrupt_dir"]):
                for name in files:
                    if name.endswith(".kv"):
                        path = os.path.join(root, name)
                        data = bytearray(open(path, "rb").read())
                        data[len(data) // 2] ^= 0xFF
                        open(path, "wb").write(bytes(data))
        if "purge" in before:  # what `kvtier cache purge` does, from this process (the engine keeps running)
            from kvtier.tiers.purge import purge_stored

            args = dict(before["purge"])
            wait_s = float(args.pop("wait_s", 1.0))
            out.setdefault("purges", []).append(purge_stored(args.pop("salt"), **args))
            time.sleep(wait_s)  # the workers and the scheduler poll purge requests (purge_check_interval_s)
        if before.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        params = SamplingParams(
            max_tokens=phase.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
        )
        salts = phase.get("salts") or [None] * len(phase["prompts"])
        prompts = []
        for ids, salt in zip(phase["prompts"], salts):
            p = {"prompt_token_ids": ids}
            if salt is not None:
                p["cache_salt"] = salt
            prompts.append(p)
        per_request = phase.get("one_at_a_time", False)
        t0 = time.perf_counter()
        results = []
        if per_request:
            for p in prompts:
                results += llm.generate([p], params, use_tqdm=False)
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ttft = []
        for r in results:
            m = getattr(r, "metrics", None)
            ttft.append(getattr(m, "first_token_latency", None) if m is not None else None)
        out["phases"].append(
            {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [r.num_cached_tokens for r in results],
                "seconds": seconds,
                "ttft": ttft,
                "files": num_files,
            }
        )
        if phase.get("metrics"):
            out["phases"][-1]["metrics"] = _kvtier_metrics(llm)
    if replay_port is not None:
        time.sleep(1.0)  # the last step's batch reaches the publisher thread
        out["kv_events"] = _replay_events(replay_port)
    out["metrics"] = {}
    try:
        out["metrics"] = _kvtier_metrics(llm)
    except Exception as e:
        out["metrics_error"] = repr(e)
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
