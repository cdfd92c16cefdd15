"""LoRA adapters for the tests, made with PEFT itself (the reference), and PEFT's greedy tokens.

`make_adapter` wraps a tiny checkpoint's transformers model with `get_peft_model`, gives lora_A
and lora_B random non-zero values (PEFT starts B at zero: the adapter would change nothing) and
saves it with `save_pretrained`; `peft_greedy` runs transformers + PEFT on a fresh copy of the
base model (PEFT injects its layers into the model it wraps)."""

from __future__ import annotations

import functools
from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    targets: list[str] | None = None,
    r: int = 8,
    alpha: float = 16,
    seed: int = 0,
    std: float = 0.05,
    **config: object,
) -> Path:
    """A PEFT LoRA adapter of `model_dir` in `out_dir` (float32), random A and B from `seed`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0, **config)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


@functools.cache
def peft_model(model_dir: str, adapter_dir: str | None):
    """transformers (float32) + the adapter (None: the base model alone), in eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: str | Path, adapter_dir: str | Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of transformers + PEFT, the whole sequence recomputed each step (no cache)."""
    import torch

    model = peft_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
