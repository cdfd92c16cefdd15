"""Build the benchmark reference checkpoint: Llama architecture, random bf16 weights,
hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000 (~125 M params).

    python benchmarks/build_reference_model.py --out /tmp/kvtier-ref
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.model.builder import REFERENCE_MODEL, build_random_llama

DEFAULT_DIR = "/tmp/kvtier-ref"


def ensure_reference_model(out: str | Path = DEFAULT_DIR) -> Path:
    out = Path(out)
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        build_random_llama(out, seed=0, **REFERENCE_MODEL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=DEFAULT_DIR)
    args = ap.parse_args()
    path = ensure_reference_model(args.out)
    print(json.dumps({"model_dir": str(path), **REFERENCE_MODEL}))


if __name__ == "__main__":
    main()
