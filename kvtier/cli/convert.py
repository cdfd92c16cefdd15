"""`kvtier convert`: a GGUF file written out as a Hugging Face safetensors directory."""

from __future__ import annotations

import argparse

from kvtier.cli.engine_args import _dtype


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cv = sub.add_parser(
        "convert",
        help="write a GGUF file as a Hugging Face safetensors directory",
        description="Dequantizes a .gguf checkpoint and writes config.json, "
        "model.safetensors, tokenizer.json and tokenizer_config.json (transformers 5 "
        "cannot save a GGUF-loaded model; vLLM's CPU build reads only safetensors).",
    )
    cv.add_argument("gguf", metavar="MODEL.gguf")
    cv.add_argument("out_dir", metavar="OUT_DIR")
    cv.add_argument(
        "--dtype",
        type=_dtype,
        default="float32",
        help="the weights' dtype in the directory (default float32: exact for every GGUF type)",
    )
    cv.set_defaults(func=run, subparser=None)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.model.gguf import is_gguf, open_checkpoint

    if not is_gguf(args.gguf):
        raise ValueError(f"{args.gguf} is not a .gguf file")
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    out = open_checkpoint(args.gguf).save_pretrained(args.out_dir, dtype)
    print(f"wrote {out}")
    return 0
