"""kvtier's KV events are vLLM 0.32's wire format: vLLM's own structs (vllm.distributed.kv_events,
in the vLLM environment) decode what kvtier encodes into the same values, and kvtier decodes what
vLLM encodes. Keeps the format right by test: the mid-2026 switch from positional to map-encoded
events broke consumers that had only been right once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllmutil import REPO, VLLM_PY, requires_vllm

from kvtier.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

pytestmark = requires_vllm

_CHECK = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ours = [bytes.fromhex(h) for h in json.loads(open(sys.argv[1]).read())]
decoded = [msgspec.to_builtins(msgspec.msgpack.decode(p, type=KVEventBatch)) for p in ours]
batch = KVEventBatch(
    ts=12.5,
    events=[
        BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[5, 6, 7, 8],
                    block_size=2, lora_id=None, medium="CPU", lora_name=None,
                    extra_keys=[("abc",), None], locality="LOCAL"),
        BlockRemoved(block_hashes=[3], medium="GPU"),
        AllBlocksCleared(),
    ],
    data_parallel_rank=1,
)
print(json.dumps({"decoded": decoded, "theirs": msgspec.msgpack.encode(batch).hex()}))
"""


def _ours() -> list[KVEventBatch]:
    return [
        KVEventBatch(
            1.25,
            [
                BlockStored([7, 2**63 + 5], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None),
                BlockStored([9], 2**63 + 5, [9, 9, 9, 9], 4, None, "STORAGE", None, [("d1g3st",)], locality="REMOTE"),
                BlockRemoved([7], "CPU", locality="LOCAL"),
                AllBlocksCleared(),
            ],
            0,
        ),
        KVEventBatch(2.5, [], 0),
    ]


def test_vllm_decodes_kvtier_events_and_kvtier_decodes_vllms(tmp_path: Path) -> None:
    assert VLLM_PY is not None
    ours = _ours()
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps([msgspec.msgpack.encode(b).hex() for b in ours]))
    env = {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([VLLM_PY, "-c", _CHECK, str(payloads)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # vLLM's structs read kvtier's bytes as the same values (maps tagged "type", defaults left out)
    assert out["decoded"] == json.loads(json.dumps([msgspec.to_builtins(b) for b in ours]))
    assert out["decoded"][0][1][0]["type"] == "BlockStored"
    # and kvtier's read vLLM's
    theirs = msgspec.msgpack.decode(bytes.fromhex(out["theirs"]), type=KVEventBatch)
    stored, removed, cleared = theirs.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [1, 2**64 - 1]
    assert stored.extra_keys == [("abc",), None] and stored.locality == "LOCAL"
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared) and theirs.data_parallel_rank == 1
    # byte for byte: kvtier encodes vLLM's batch exactly as vLLM does
    assert msgspec.msgpack.encode(theirs) == bytes.fromhex(out["theirs"])
