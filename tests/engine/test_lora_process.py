"""LoRA across the engine-process boundary: a LoRARequest travels in AddRequest (msgpack, decoded
and validated again), and an engine in its own process (kvtier.engine.process) serves adapters
with the tokens of the in-process engine and of transformers + PEFT; its errors (LoRA not enabled,
an adapter that does not fit) come back as the engine's ValueError."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from lorautil import make_adapter, peft_greedy

from kvtier import LoRARequest, SamplingParams
from kvtier.engine.process import ProcessEngineClient
from kvtier.engine.protocol import AddBatch, AddRequest, decode_to_engine, encode

pytest.importorskip("peft", reason="PEFT is the reference (pip install 'kvtier[test]')")
pytest.importorskip("zmq")

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 120.0


def test_a_lora_request_survives_the_wire():
    lora = LoRARequest("sql", 3, "/adapters/sql", base_model_name="m")
    batch = AddBatch(7, [AddRequest("r1", [1, 2, 3], SP, lora_request=lora), AddRequest("r2", [4], SP)])
    back = decode_to_engine(encode(batch))
    assert isinstance(back, AddBatch)
    assert back.requests[0].lora_request == lora and back.requests[1].lora_request is None
    # a LoRARequest that does not validate does not decode either
    raw = msgspec.msgpack.decode(encode(batch))  # ["add", call_id, [request, ...]]
    assert raw[2][0][-1] == ["sql", 3, "/adapters/sql", "m"]
    raw[2][0][-1][1] = 0  # lora_int_id 0
    with pytest.raises(msgspec.ValidationError, match="lora_int_id"):
        decode_to_engine(msgspec.msgpack.encode(raw))


def test_an_engine_process_serves_adapters(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["llama"]
    a = LoRARequest("a", 1, str(make_adapter(model_dir, tmp_path / "a", seed=1)))
    b = LoRARequest("b", 2, str(make_adapter(model_dir, tmp_path / "b", seed=2, targets=["q_proj", "up_proj"])))
    big = LoRARequest("big", 3, str(make_adapter(model_dir, tmp_path / "big", r=32, alpha=32)))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 14, 6)]
    loras = [a, b, None]
    kwargs = dict(dtype="float32", num_device_blocks=64, block_size=4, enable_lora=True, max_loras=2)

    async def main() -> tuple[list, list[str]]:
        client = ProcessEngineClient(str(model_dir), kwargs)
        await asyncio.to_thread(client.start_process)
        client.start()
        errors: list[str] = []
        try:
            specs = [AddRequest(f"r{i}", p, SP, lora_request=lo) for i, (p, lo) in enumerate(zip(prompts, loras))]
            streams = await asyncio.wait_for(client.add(specs), TIMEOUT_S)
            outs = []
            for s in streams:
                out = await asyncio.wait_for(s.next(), TIMEOUT_S)
                while not out.finished:
                    out = await asyncio.wait_for(s.next(), TIMEOUT_S)
                outs.append(out)
            try:
                await asyncio.wait_for(client.add([AddRequest("bad", prompts[0], SP, lora_request=big)]), TIMEOUT_S)
            except ValueError as e:
                errors.append(str(e))
            report = await asyncio.wait_for(client.check_integrity(), TIMEOUT_S)
            assert report is not None
        finally:
            await asyncio.to_thread(client.shutdown)
        return outs, errors

    outs, errors = asyncio.run(main())
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        peft_greedy(model_dir, None if lo is None else lo.lora_path, p, SP.max_tokens) for p, lo in zip(prompts, loras)
    ]
    assert [o.lora_request for o in outs] == loras
    assert len(errors) == 1 and "LoRA adapter 'big'" in errors[0] and "max_lora_rank=16" in errors[0]
