"""Hit rate vs device capacity on the conversation trace: device only, device + host,
device + host + disk, through kvtier's own cache code (`kvtier.sim`). Writes a JSON summary
and a PNG plot.

    python benchmarks/sim_capacity.py [--trace ../shared/data/traces/conversation_trace.jsonl] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.sim import ideal_block_hit_rate, load_trace, simulate  # noqa: E402

CAPACITIES = [500, 1000, 2000, 5000, 10000, 20000, 40000]
CONFIGS = {"device only": {}, "device + host (20k blocks)": {"host_blocks": 20000},
           "device + host (20k) + disk (100k)": {"host_blocks": 20000, "disk_blocks": 100000}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_trace = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    ap.add_argument("--trace", default=str(default_trace))
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    reqs = load_trace(args.trace, block_tokens=512)
    report = {"trace": Path(args.trace).name, "requests": len(reqs), "block_tokens": 512,
              "ideal_block_hit_rate": round(ideal_block_hit_rate(reqs), 4), "series": {}}
    for name, kw in CONFIGS.items():
        t = time.perf_counter()
        points = simulate(reqs, CAPACITIES, policy="lru", **kw)["points"]
        report["series"][name] = [{"device_blocks": p["device_blocks"], "block_hit_rate": round(p["block_hit_rate"], 4),
                                   "token_hit_rate": round(p["token_hit_rate"], 4)} for p in points]
        report["series"][name + " seconds"] = round(time.perf_counter() - t, 2)
    out = Path(args.out)
    (out / "sim_conversation_hit_rate.json").write_text(json.dumps(report, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in CONFIGS:
        pts = report["series"][name]
        ax.plot([p["device_blocks"] for p in pts], [p["block_hit_rate"] for p in pts], marker="o", label=name)
    ax.axhline(report["ideal_block_hit_rate"], linestyle="--", color="gray", label="ideal (unlimited)")
    ax.set_xscale("log")
    ax.set_xlabel("device pool (blocks of 512 tokens)")
    ax.set_ylabel("block hit rate")
    ax.set_title(f"Mooncake conversation trace ({len(reqs)} requests), LRU")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sim_conversation_hit_rate.png", dpi=110)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
