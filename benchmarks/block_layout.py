"""How the decode and chunk attention kernels' speed depends on where a sequence's blocks sit in the pool.

After evictions and prefix-cache resets the free-block queue is no longer in id order, so a new
sequence's block table can be reversed, interleaved with other sequences', or random. This times
one layer's native decode attention (and the chunk kernel over a cached prefix) for each layout,
in the reference model's head shape, least of and median of repeats, interleaved.

    python benchmarks/block_layout.py [--batch 32] [--context 768] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.model import native


def tables_for(layout: str, batch: int, per_seq: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    n = batch * per_seq
    if layout == "contiguous":  # sequence b owns blocks b*per_seq .. (b+1)*per_seq - 1
        ids = torch.arange(n)
    elif layout == "reversed":  # each sequence's blocks in descending order
        ids = torch.arange(n).view(batch, per_seq).flip(1).reshape(-1)
    elif layout == "interleaved":  # sequences took turns allocating: block j of seq b is j*batch + b
        ids = torch.arange(n).view(per_seq, batch).t().reshape(-1)
    elif layout == "random":
        ids = torch.randperm(num_blocks, generator=g)[:n]
    else:
        raise ValueError(layout)
    return ids.view(batch, per_seq).contiguous().long()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--chunk-tokens", type=int, default=64, help="query tokens of the chunk-kernel case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    heads, kv_heads, dim, bs = 12, 4, 64, 16
    lib = native.paged_attention_lib()
    chunk_lib = native.chunk_attention_lib()
    if lib is None:
        raise SystemExit("native decode kernel unavailable")
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, kv_heads, args.num_blocks, bs, dim, generator=g).to(torch.bfloat16)
    per_seq = -(-args.context // bs)
    q = torch.randn(args.batch, heads, dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    nq = args.chunk_tokens
    cq = torch.randn(nq, heads, dim, generator=g).to(torch.bfloat16)
    cout = torch.empty_like(cq)
    start = args.context - nq
    layouts = ["contiguous", "reversed", "interleaved", "random"]
    tables = {name: tables_for(name, args.batch, per_seq, args.num_blocks, g) for name in layouts}

    def decode(t: torch.Tensor) -> None:
        rc = lib.kvt_decode_attention(
            q.data_ptr(), native.FLOAT_KIND[torch.bfloat16], out.data_ptr(), pool.data_ptr(),
            native.KV_STORAGE[torch.bfloat16], None, native.SCALE_BLOCK, t.data_ptr(), per_seq,
            lens.data_ptr(), args.batch, heads, kv_heads, args.num_blocks, bs, dim, dim**-0.5,
        )  # fmt: skip
        assert rc == 0, rc

    def chunk(t: torch.Tensor) -> None:  # the first sequence's table
        row = t.reshape(-1)[:per_seq].contiguous()
        rc = chunk_lib.kvt_chunk_attention(
            cq.data_ptr(), cout.data_ptr(), pool.data_ptr(), row.data_ptr(), per_seq, start, nq,
            heads, kv_heads, args.num_blocks, bs, dim, dim**-0.5, 0,
        )  # fmt: skip
        assert rc == 0, rc

    kinds = {"decode": decode} | ({"chunk": chunk} if chunk_lib is not None else {})
    times: dict[str, dict[str, list[float]]] = {k: {name: [] for name in layouts} for k in kinds}
    for _ in range(args.repeats):
        for kind, fn in kinds.items():
            for name in layouts:
                t0 = time.perf_counter()
                fn(tables[name])
                times[kind][name].append((time.perf_counter() - t0) * 1e3)
    result = {
        kind: {name: {"min_ms": min(v), "median_ms": statistics.median(v)} for name, v in per.items()}
        for kind, per in times.items()
    }
    print(f"batch {args.batch}, context {args.context}, pool {args.num_blocks} blocks, repeats {args.repeats}")
    for kind, per in result.items():
        print(kind + ": " + ", ".join(f"{n} {r['median_ms']:.2f} ms (min {r['min_ms']:.2f})" for n, r in per.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
