"""The KV cache dtype names, without torch: the CLI validates flags before it imports torch.
What each one stores: kvtier.model.kv_quant."""

KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "int8_rot",
    "int8_tok",
    "fp8_e4m3_rot",
)
