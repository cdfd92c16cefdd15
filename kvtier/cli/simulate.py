"""`kvtier simulate`: a Mooncake-format trace replayed through the prefix cache and tiers (no model)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvtier.cli.args import fraction, positive_float, positive_int, size
from kvtier.sim.config import TierSpeeds
from kvtier.tiers.hierarchy import WRITE_POLICIES

_SPEEDS = TierSpeeds()
"""The simulator's default speeds: `kvtier simulate`'s flags start from them."""
_ROUTINGS = ("round_robin", "prefix", "kv_aware", "oracle")
"""kvtier.sim.fleet.ROUTINGS (not imported here: the parser is built for every subcommand)."""


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _routings(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in _ROUTINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"routing policies are {', '.join(_ROUTINGS)} (comma-separated), got {text!r}")
    return list(dict.fromkeys(names))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    m = sub.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the prefix cache (no model)",
        description="Replays a trace (JSONL: timestamp, input_length, output_length, hash_ids) "
        "through kvtier's own BlockPool + PrefixIndex at one or more device capacities and "
        "reports block and token hit rates, optionally with the engine's host/disk tier "
        "hierarchy below (its write policy, promotion and demotion) and its restore-or-recompute "
        "cost model at given speeds: hits per tier, bytes moved, prefill time saved. With "
        "--instances N: a fleet of N such instances behind each --routing policy (optionally "
        "sharing one remote tier), printed beside the fleet ceiling (one instance N times as large).",
    )
    m.add_argument("trace", help="JSONL trace file")
    m.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per hash id (default 512)")
    m.add_argument(
        "--device-blocks",
        "--sweep",
        dest="device_blocks",
        action="append",
        metavar="N1,N2,...",
        help="device pool capacities in blocks (comma-separated, repeatable; --sweep is a synonym)",
    )
    m.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="device eviction policy (default lru)")
    host = m.add_mutually_exclusive_group()
    host.add_argument("--host-blocks", type=positive_int, default=None, help="host tier capacity in blocks")
    host.add_argument(
        "--host-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="host tier capacity in bytes (e.g. 64GiB), as the engine's --host-cache-bytes",
    )
    disk = m.add_mutually_exclusive_group()
    disk.add_argument("--disk-blocks", type=positive_int, default=None, help="disk tier capacity in blocks")
    disk.add_argument(
        "--disk-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="disk tier capacity in bytes; an entry is a block plus a 100-byte header",
    )
    remote = m.add_mutually_exclusive_group()
    remote.add_argument(
        "--shared-remote-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="remote tier (Redis) capacity in blocks, one tier shared by every instance",
    )
    remote.add_argument(
        "--shared-remote-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="remote tier capacity in bytes; an entry is a block plus a 100-byte header",
    )
    m.add_argument(
        "--disk-alloc-bytes",
        type=positive_int,
        default=4096,
        metavar="N",
        help="the disk file system's allocation unit: an entry costs whole units, as the disk tier counts it (default 4096)",
    )
    m.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through",
        help="when blocks go down to the tiers, as the engine's --cache-write-policy (default write_through)",
    )
    m.add_argument(
        "--selective-min-hits",
        type=positive_int,
        default=2,
        help="with --write-policy selective: device hits before a block is written down (default 2)",
    )
    m.add_argument(
        "--restore-policy",
        choices=("cost", "always"),
        default="cost",
        help="cost: restore what the cost model says beats recomputing; always: every stored block",
    )
    m.add_argument(
        "--block-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="KV bytes per block (default 12KiB x --block-tokens, the reference model)",
    )
    speed = m.add_argument_group(
        "speeds for the cost model (defaults: measured on the reference model, docs/benchmarks.md)"
    )
    for tier, what in (
        ("host", "from host, read + copy into the pool"),
        ("disk", "from disk"),
        ("remote", "from the shared remote tier"),
    ):
        gbps = getattr(_SPEEDS, f"{tier}_bytes_per_s") / 1e9
        latency_ms = getattr(_SPEEDS, f"{tier}_latency_s") * 1e3
        speed.add_argument(
            f"--{tier}-gbps",
            type=positive_float,
            default=gbps,
            metavar="GB/S",
            help=f"restore throughput {what} (default {gbps:g})",
        )
        speed.add_argument(
            f"--{tier}-latency-ms",
            type=float,
            default=latency_ms,
            metavar="MS",
            help=f"per restore touching the {tier} tier (default {latency_ms:g})",
        )
    speed.add_argument(
        "--prefill-s-per-token",
        type=positive_float,
        default=_SPEEDS.prefill_s_per_token,
        metavar="SECONDS",
        help=f"prefill cost per new token (default {_SPEEDS.prefill_s_per_token:g})",
    )
    speed.add_argument(
        "--prefill-s-per-token-pair",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="attention cost per (new, context) token pair: t = a*n + b*n*(c + n/2) (default 0)",
    )
    fleet = m.add_argument_group("fleet (kvtier.sim.fleet: routers, load model and ceiling in its docstring)")
    fleet.add_argument(
        "--instances",
        type=positive_int,
        default=1,
        metavar="N",
        help="instances, each with --device-blocks and its own host/disk tiers (default 1: one instance)",
    )
    fleet.add_argument(
        "--routing",
        type=_routings,
        default=list(_ROUTINGS),
        metavar="P1,P2,...",
        help=f"routing policies to compare, comma-separated: {', '.join(_ROUTINGS)} (default all)",
    )
    fleet.add_argument(
        "--decode-s-per-token",
        type=_non_negative_float,
        default=0.02,
        metavar="SECONDS",
        help="load model: decode seconds per output token of a request (default 0.02)",
    )
    fleet.add_argument(
        "--cache-threshold",
        type=fraction,
        default=0.3,
        help="prefix router: route by match when matched / input tokens > this (default 0.3, vllm-router's)",
    )
    fleet.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=64,
        metavar="N",
        help="prefix router: least loaded when max - min in flight > N ... (default 64)",
    )
    fleet.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        metavar="X",
        help="... and max > X x min (default 1.5)",
    )
    fleet.add_argument(
        "--host-weight",
        type=fraction,
        default=0.8,
        metavar="W",
        help="kv_aware router: a host-tier block saves W of a device block's prefill (default 0.8, "
        "vllm-router's --kv-penalty-host)",
    )
    fleet.add_argument(
        "--overlap-weight",
        type=_non_negative_float,
        default=1.0,
        metavar="W",
        help="kv_aware and oracle routers: cost = W x prefill blocks + decode blocks in flight (default 1)",
    )
    fleet.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="load model: arrivals X times faster than the trace's timestamps (a benchmark's rate scale)",
    )
    fleet.add_argument(
        "--output-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="load model: every request generates N tokens (a benchmark's max_tokens) instead of "
        "the trace's output_length",
    )
    m.add_argument("--limit", type=positive_int, default=None, help="replay only the first N records")
    m.add_argument("--plot", default=None, metavar="FILE.png", help="write a hit-rate-vs-capacity plot")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(func=run, subparser=None)


def run(args: argparse.Namespace) -> int:
    from kvtier.sim import SimConfig, TierSpeeds, load_trace, simulate

    caps: list[int] = []
    for group in args.device_blocks or []:
        for part in group.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                value = int(part)
            except ValueError:
                raise ValueError(f"--device-blocks: invalid integer {part!r}") from None
            if value < 1:
                raise ValueError(f"--device-blocks: must be >= 1, got {value}")
            caps.append(value)
    if not caps:
        raise ValueError("give at least one capacity: --device-blocks N1,N2,...")
    speeds = TierSpeeds(
        **{f"{t}_bytes_per_s": getattr(args, f"{t}_gbps") * 1e9 for t in ("host", "disk", "remote")},
        **{f"{t}_latency_s": getattr(args, f"{t}_latency_ms") * 1e-3 for t in ("host", "disk", "remote")},
        prefill_s_per_token=args.prefill_s_per_token,
        prefill_s_per_token_pair=args.prefill_s_per_token_pair,
    )
    config = SimConfig(
        block_tokens=args.block_tokens,
        block_bytes=args.block_bytes,
        policy=args.policy,
        host_blocks=args.host_blocks,
        host_bytes=args.host_bytes,
        disk_blocks=args.disk_blocks,
        disk_bytes=args.disk_bytes,
        disk_alloc_bytes=args.disk_alloc_bytes,
        remote_blocks=args.shared_remote_blocks,
        remote_bytes=args.shared_remote_bytes,
        write_policy=args.write_policy,
        selective_min_hits=args.selective_min_hits,
        restore_policy=args.restore_policy,
        speeds=speeds,
    )
    if args.instances > 1:
        if args.plot:
            raise ValueError("--plot draws a single instance's sweep: not with --instances > 1")
        from kvtier.sim.fleet import RouterConfig

        router = RouterConfig(
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            host_weight=args.host_weight,
            overlap_weight=args.overlap_weight,
            decode_s_per_token=args.decode_s_per_token,
        )
        reqs = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
        if args.output_tokens is not None or args.speedup != 1.0:
            out = args.output_tokens
            reqs = [
                replace(r, timestamp=r.timestamp / args.speedup, output_length=r.output_length if out is None else out)
                for r in reqs
            ]
        return _run_fleet(args, reqs, caps, config, router)
    reqs = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
    res = simulate(reqs, caps, config)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("kvtier: --plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        else:
            pts = sorted(res["points"], key=lambda p: p["device_blocks"])
            xs = [p["device_blocks"] for p in pts]
            fig, ax = plt.subplots(figsize=(7, 4.5))
            ax.plot(xs, [p["block_hit_rate"] for p in pts], "o-", label="block hit rate")
            ax.plot(xs, [p["token_hit_rate"] for p in pts], "s--", label="token hit rate")
            if res["host_blocks"] or res["disk_blocks"]:
                ax.plot(xs, [p["device_block_hit_rate"] for p in pts], "^:", label="device-only block hit rate")
            ax.axhline(res["ideal_block_hit_rate"], color="gray", ls=":", label="ideal (unlimited)")
            ax.set_xlabel("device blocks")
            ax.set_ylabel("hit rate")
            ax.set_ylim(0, 1)
            ax.set_title(f"{args.trace} ({args.policy})", fontsize=9)
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot)
            plt.close(fig)
            print(f"kvtier: wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
        return 0
    remote = "remote_blocks" in res
    tiers = bool(res["host_blocks"] or res["disk_blocks"] or remote)
    _print_head(res)
    head = f"{'device_blocks':>13} {'block_hit':>9} {'token_hit':>9}"
    if tiers:
        head += f" {'dev_blk':>8} {'host_blk':>8} {'disk_blk':>8}"
        if remote:
            head += f" {'rem_blk':>8}"
        head += f" {'recomp':>7} {'read_GiB':>9} {'write_GiB':>9} {'restore_s':>10}"
    head += f" {'saved_s':>10} {'oversized':>9} {'sim_s':>6}"
    print(head)
    for p in res["points"]:
        line = f"{p['device_blocks']:>13} {p['block_hit_rate']:>9.4f} {p['token_hit_rate']:>9.4f}"
        if tiers:
            read, write = _tier_bytes(p)
            line += (
                f" {p['device_block_hit_rate']:>8.4f} {p['host_block_hit_rate']:>8.4f} {p['disk_block_hit_rate']:>8.4f}"
            )
            if remote:
                line += f" {p['remote_block_hit_rate']:>8.4f}"
            line += f" {p['recomputed_stored_blocks']:>7} {read:>9.1f} {write:>9.1f} {p['restore_s']:>10.1f}"
        line += f" {p['prefill_saved_s']:>10.1f} {p['oversized_requests']:>9} {p['sim_seconds']:>6.2f}"
        print(line)
    return 0


def _tier_bytes(p: dict) -> tuple[float, float]:
    """GiB read from and written to the tiers below the device."""
    names = [n for n in ("host", "disk", "remote") if f"{n}_bytes_read" in p]
    read = sum(p[f"{n}_bytes_read"] for n in names) / 2**30
    write = sum(p[f"{n}_bytes_written"] for n in names) / 2**30
    return read, write


def _print_head(res: dict) -> None:
    print(
        f"{res['num_requests']} requests, {res['total_blocks']} blocks, {res['total_tokens']} tokens; "
        f"policy {res['policy']}; ideal block hit rate {res['ideal_block_hit_rate']:.4f}, "
        f"token {res['ideal_token_hit_rate']:.4f}"
    )
    remote = res.get("remote_blocks")
    if res["host_blocks"] or res["disk_blocks"] or remote:
        line = f"host blocks {res['host_blocks']}, disk blocks {res['disk_blocks']}"
        if remote:
            line += f", {'shared ' if res.get('instances', 1) > 1 else ''}remote blocks {remote}"
        print(f"{line}; {res['write_policy']}, restore {res['restore_policy']}")


def _run_fleet(args: argparse.Namespace, reqs: list, caps: list[int], config: object, router: object) -> int:
    from kvtier.sim.fleet import simulate_fleet

    n = args.instances
    res = simulate_fleet(reqs, caps, n, args.routing, config, router)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(res))
        return 0
    _print_head(res)
    remote = "remote_blocks" in res
    tiers = bool(res["host_blocks"] or res["disk_blocks"] or remote)
    print(
        f"{n} instances; per instance: device, host and disk as given; ceiling: one instance with "
        f"{n}x the device pool, host and disk{' (the same shared remote tier)' if remote else ''}"
    )
    head = f"{'routing':<12} {'block_hit':>9} {'token_hit':>9}"
    if tiers:
        head += f" {'dev_tok':>8} {'host_tok':>8} {'disk_tok':>8}"
        if remote:
            head += f" {'rem_tok':>8} {'cross_tok':>9}"
    head += f" {'saved_s':>10} {'load_imb':>8} {'share_imb':>9} {'peak':>5}  per-instance token hit (request share)"
    for pt in res["points"]:
        print(f"device blocks per instance: {pt['device_blocks']} (ceiling: {pt['device_blocks'] * n})")
        print(head)
        for p in [pt["ceiling"], *pt["policies"].values()]:
            line = f"{p['routing']:<12} {p['block_hit_rate']:>9.4f} {p['token_hit_rate']:>9.4f}"
            if tiers:
                line += (
                    f" {p['device_token_hit_rate']:>8.4f} {p['host_token_hit_rate']:>8.4f}"
                    f" {p['disk_token_hit_rate']:>8.4f}"
                )
                if remote:
                    line += f" {p['remote_token_hit_rate']:>8.4f} {p['cross_instance_token_hit_rate']:>9.4f}"
            line += f" {p['prefill_saved_s']:>10.1f}"
            if "per_instance" in p:
                per = " ".join(f"{q['token_hit_rate']:.3f}({q['request_share']:.2f})" for q in p["per_instance"])
                line += (
                    f" {p['load_imbalance']:>8.3f} {p['request_share_imbalance']:>9.3f} {p['peak_in_flight']:>5}  {per}"
                )
            else:
                line += f" {'-':>8} {'-':>9} {'-':>5}  (one pool)"
            print(line)
    return 0
