"""`kvtier cache purge`: a tenant's stored KV deleted below the engines (vLLM's too)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "cache", help="stored KV below the engines: purge a tenant (also vLLM's with the kvtier connector)"
    )
    csub = c.add_subparsers(dest="cache_command", required=True)
    cp = csub.add_parser(
        "purge",
        help="delete a tenant's (cache_salt's) KV from disk and Redis, destroy its data "
        "key, and tell running processes to drop their copies",
        description="Deletes every block stored for one tenant (vLLM's cache_salt; kvtier's "
        "tenant) from the disk tier and Redis, for every model configuration found there, "
        "destroys its data key (--kv-key-dir / --kv-master-key-file), and posts a purge "
        "request beside the disk tier (or key directory) and in Redis. Running vLLM workers "
        "with the kvtier connector poll it (purge_check_interval_s, default 1 s) and drop their "
        "host-memory copies and in-flight stores of the tenant.",
    )
    who = cp.add_mutually_exclusive_group(required=True)
    who.add_argument("--salt", help="the tenant: the cache_salt its requests carry")
    who.add_argument("--no-salt", action="store_true", help="the requests that carry no cache_salt")
    cp.add_argument("--disk-cache-dir", default=None)
    cp.add_argument("--remote-cache-url", default=None)
    cp.add_argument("--kv-key-dir", default=None)
    cp.add_argument("--kv-master-key-file", default=None)
    cp.set_defaults(func=run, subparser=None)


def run(args: argparse.Namespace) -> int:
    from kvtier.tiers.purge import purge_stored

    if not (args.disk_cache_dir or args.remote_cache_url or args.kv_key_dir):
        raise ValueError("give the stores to purge: --disk-cache-dir, --remote-cache-url and/or --kv-key-dir")
    out = purge_stored(
        None if args.no_salt else args.salt,
        disk_cache_dir=args.disk_cache_dir,
        remote_cache_url=args.remote_cache_url,
        key_dir=args.kv_key_dir,
        master_key_file=args.kv_master_key_file,
    )
    print(json.dumps(out, indent=1, default=str))
    pending = [fp for fp, c in out["fingerprints"].items() if c.get("pending")]
    return 1 if pending else 0
