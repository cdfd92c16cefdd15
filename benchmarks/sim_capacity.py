"""Hit rate vs device capacity on the conversation trace: device only, device + host,
device + host + disk (write-through, and write-back), through kvtier's own cache code
(`kvtier.sim`: BlockPool + PrefixIndex, the engine's TierHierarchy and CostModel). Writes a JSON
summary and a PNG plot, and prints the JSON.

    python benchmarks/sim_capacity.py [--trace ../shared/data/traces/conversation_trace.jsonl] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.sim import SimConfig, ideal_block_hit_rate, ideal_token_hit_rate, load_trace, simulate

CAPACITIES = [500, 1000, 2000, 5000, 10000, 20000, 40000]
CONFIGS = {
    "device only": {},
    "device + host (20k blocks)": {"host_blocks": 20000},
    "device + host (20k) + disk (100k)": {"host_blocks": 20000, "disk_blocks": 100000},
    "device + host (20k) + disk (100k), write_back": {
        "host_blocks": 20000,
        "disk_blocks": 100000,
        "write_policy": "write_back",
    },
}
KEEP = (
    "device_blocks",
    "block_hit_rate",
    "token_hit_rate",
    "device_block_hit_rate",
    "host_block_hit_rate",
    "disk_block_hit_rate",
    "restored_blocks",
    "recomputed_stored_blocks",
    "host_evictions",
    "disk_evictions",
    "host_bytes_read",
    "host_bytes_written",
    "disk_bytes_read",
    "disk_bytes_written",
    "restore_s",
    "prefill_saved_s",
    "prefill_total_s",
    "sim_seconds",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_trace = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    ap.add_argument("--trace", default=str(default_trace))
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    t = time.perf_counter()
    reqs = load_trace(args.trace, block_tokens=512)
    load_s = time.perf_counter() - t
    base = SimConfig(block_tokens=512)
    report = {
        "trace": Path(args.trace).name,
        "requests": len(reqs),
        "block_tokens": 512,
        "block_bytes": base.kv_block_bytes,
        "load_seconds": round(load_s, 2),
        "ideal_block_hit_rate": round(ideal_block_hit_rate(reqs), 4),
        "ideal_token_hit_rate": round(ideal_token_hit_rate(reqs), 4),
        "restore_policy": base.restore_policy,
        "speeds": None,
        "series": {},
    }
    for name, kw in CONFIGS.items():
        res = simulate(reqs, CAPACITIES, base, **kw)
        report["speeds"] = res["speeds"]
        report["series"][name] = [
            {k: round(p[k], 4) if isinstance(p[k], float) else p[k] for k in KEEP if k in p} for p in res["points"]
        ]
    out = Path(args.out)
    (out / "sim_conversation_hit_rate.json").write_text(json.dumps(report, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in CONFIGS:
        pts = report["series"][name]
        ax.plot(
            [p["device_blocks"] for p in pts],
            [p["block_hit_rate"] for p in pts],
            marker="o",
            label=name,
            linestyle="--" if "write_back" in name else "-",
        )
    ax.axhline(report["ideal_block_hit_rate"], linestyle=":", color="gray", label="ideal (unlimited)")
    ax.set_xscale("log")
    ax.set_xlabel("device pool (blocks of 512 tokens)")
    ax.set_ylabel("block hit rate")
    ax.set_title(f"Mooncake conversation trace ({len(reqs)} requests), LRU", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sim_conversation_hit_rate.png", dpi=110)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
