"""Where a model argument points, as vLLM resolves it, with no network: a local directory, a
.gguf file, or a Hugging Face hub id ("org/name") found in the local Hugging Face cache.

The cache is `download_dir` (vLLM's --download-dir) when given, else HF_HUB_CACHE, else
$HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub: the layout
`huggingface_hub` writes (models--org--name/refs/<revision> holding a commit, and
snapshots/<commit>/ the files). `revision` is a branch or tag name (a ref) or a commit hash;
default main. kvtier never downloads: a hub id that is not cached is a ModelFilesNotFoundError (a
ValueError and a FileNotFoundError) that names it and says how to fetch it. Torch-free (checked
before torch loads).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvtier.model.hf_config import ModelFilesNotFoundError, ModelLoadError

__all__ = ["hf_cache_dir", "resolve_model"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hf_cache_dir(download_dir: str | None = None) -> Path:
    """The Hugging Face hub cache kvtier looks in (see the module docstring)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local path serving `model`: itself when it exists, else the cached snapshot of the hub
    id `model` at `revision`. A snapshot holding no config.json but exactly one .gguf file
    resolves to that file."""
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"--revision {revision}: {model} is a local path, not a hub id; drop --revision")
        return str(path)
    if not _HUB_ID.match(model):
        raise ModelFilesNotFoundError(
            f"model {model!r}: no such file or directory, and not a hub id (org/name); give a "
            "checkpoint directory, a .gguf file or a hub id that is in the Hugging Face cache"
        )
    cache = hf_cache_dir(download_dir)
    repo = cache / ("models--" + model.replace("/", "--"))
    if not repo.is_dir():
        raise ModelFilesNotFoundError(
            f"model {model!r} is not in the Hugging Face cache ({cache}) and kvtier does not "
            f"download: fetch it first (`hf download {model}` or `huggingface-cli download {model}`), "
            "set HF_HOME / --download-dir to the cache that holds it, or give a local path"
        )
    rev = revision or "main"
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif re.fullmatch(r"[0-9a-f]{40}", rev):
        commit = rev
    else:
        refs = sorted(p.name for p in (repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
        raise ModelFilesNotFoundError(
            f"model {model!r}: revision {rev!r} is not in the cache ({repo}; cached refs: "
            f"{', '.join(refs) or 'none'}); fetch it first or give --revision a cached one"
        )
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelFilesNotFoundError(
            f"model {model!r}: the cache names commit {commit} for {rev!r} but holds no snapshot of it"
        )
    if not (snapshot / "config.json").is_file():
        ggufs = sorted(snapshot.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        if ggufs:
            names = ", ".join(p.name for p in ggufs[:6])
            raise ModelLoadError(
                f"model {model!r} holds several GGUF files ({names}); give the path of one: {snapshot}/FILE.gguf"
            )
        raise ModelFilesNotFoundError(
            f"model {model!r}: the cached snapshot {snapshot} has no config.json and no .gguf file"
        )
    return str(snapshot)
