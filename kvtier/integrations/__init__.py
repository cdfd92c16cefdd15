"""kvtier inside other engines (kvtier.integrations.vllm: a vLLM V1 KV connector)."""
