"""Offline evaluations of what the KV cache costs in accuracy (`kvtier eval-kv`)."""
