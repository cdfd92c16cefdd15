"""Structured outputs in the offline API (llguidance): every output of a constrained request
parses and satisfies its constraint, with n > 1, greedy and sampled, beside unconstrained
requests in the same steps; bad constraints are a ValueError before anything runs."""

from __future__ import annotations

import json
import re

import pytest
from engineutil import clean

from kvtier import LLM, SamplingParams
from kvtier.structured import StructuredOutputsParams

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(byte_model_dir):
    with LLM(str(byte_model_dir), dtype="float32", num_device_blocks=128, block_size=4) as llm:
        yield llm


def test_json_schema_greedy_and_sampled(llm):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(
        ["Answer in JSON:", "Another one:", "free text, no constraint"],
        [
            SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec),
            SamplingParams(max_tokens=60, n=4, temperature=1.0, seed=7, structured_outputs=spec),
            SamplingParams(max_tokens=8, temperature=0.0),
        ],
    )
    for out in outs[:2]:
        for c in out.outputs:
            value = json.loads(c.text)
            assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
            assert value["color"] in ("red", "green", "blue")
            assert c.finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) == 8
    clean(llm)


@pytest.mark.parametrize(
    "spec,check",
    [
        (StructuredOutputsParams(regex="[ab]{3}-[0-9]"), lambda t: re.fullmatch("[ab]{3}-[0-9]", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutputsParams(grammar='start: "x" ("y" | "zz")'), lambda t: t in ("xy", "xzz")),
    ],
)
def test_regex_choice_grammar(llm, spec, check):
    outs = llm.generate("pick:", SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=3, structured_outputs=spec))
    for c in outs[0].outputs:
        assert check(c.text), c.text
    clean(llm)


def test_disable_additional_properties_closes_objects():
    from kvtier.structured import _closed

    assert _closed({"type": "object", "properties": {"a": {"type": "object"}}}) == {
        "type": "object",
        "additionalProperties": False,
        "properties": {"a": {"type": "object", "additionalProperties": False}},
    }


def test_json_object_starts_an_object(llm):
    out = llm.generate(
        "obj:",
        SamplingParams(
            max_tokens=12,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
    )[0]
    assert out.outputs[0].text.startswith("{")
    clean(llm)


def test_bad_constraints_refused(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs={"grammar": "start: undefined_rule"}))
    clean(llm)
