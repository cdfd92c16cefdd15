"""`kvtier bench`: the benchmark harness.

workloads.py  deterministic sessions of token-id requests: shared prefix, multi-turn, agent,
              RAG, independent, mixed, Mooncake trace replay
client.py     streaming HTTP client: per-request TTFT, ITL, E2E, cached tokens (by tier)
metrics.py    /metrics before and after a run, counter deltas, headline figures per tier
server.py     a `kvtier serve` child process on a free loopback port (the --model target)
runner.py     scenarios: run, concurrency sweep, host tier full, slow storage, mixed, isolation
report.py     p50/p95/p99 (all, cold, warm), throughput, Markdown, PNG plots
cli.py        the flags of `kvtier bench`
"""
