"""Structured outputs: every output under a grammar is valid, whatever shares its batch.

A random tiny Llama is the point here: it "wants" nothing in particular, so a valid output can
only come from the mask. Unconstrained neighbours must be untouched (token for token), parallel
samples and preempted sequences stay valid, a failed step leaves no matcher behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sample.logits_processors import bitmask_to_bool
from minivllm.structured_output.backend import sync_grammar
from minivllm.structured_output.params import StructuredOutputError
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 5},
                        "maxItems": 3,
                    },
                },
                "required": ["name", "tags"],
            }
        },
        "required": ["user"],
    },
    "enum-and-bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 3, "maximum": 7},
            "x": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["color", "n", "x"],
    },
    "anyof-ref": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "boolean"}]},
            "pts": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
        },
        "required": ["v", "pts"],
    },
}
FREE = ["the quick brown fox", "once upon a time"]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-structured"))


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), num_gpu_blocks_override=256, max_num_seqs=16)


def constrained(seed: int | None, n: int = 1, **kind: Any) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def assert_valid_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_in_a_batch_mixed_with_free_requests(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(FREE, free, use_tqdm=False)
    seeds = [None, 1, 2, 3]
    prompts = FREE + ["json please"] * len(seeds)
    params = [free, free] + [constrained(s, json=schema) for s in seeds]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs[2:]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert_valid_json(c.text, schema)
    # The mask touched only the constrained rows: free neighbours are token-exact.
    for a, b in zip(alone, outs[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_no_blocks_held(llm)


def test_choice_and_regex_always_match(llm: LLM) -> None:
    choices = ["yes", "no", "maybe not"]
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    params = [constrained(s, choice=choices) for s in (None, 1, 2, 3, 4)]
    params += [constrained(s, regex=pattern) for s in (None, 1, 2, 3, 4)]
    outs = llm.generate(["pick one"] * len(params), params, use_tqdm=False)
    for o in outs[:5]:
        assert o.outputs[0].text in choices
    for o in outs[5:]:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text


def test_grammar_and_json_object(llm: LLM) -> None:
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(
        ["sum", "obj"],
        [constrained(5, grammar=ebnf), constrained(6, json_object=True)],
        use_tqdm=False,
    )
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", outs[0].outputs[0].text)
    c = outs[1].outputs[0]
    if c.finish_reason == "stop":  # a free-form object may outgrow max_tokens
        assert isinstance(json.loads(c.text), dict)


def test_parallel_samples_are_each_valid(llm: LLM) -> None:
    schema = SCHEMAS["enum-and-bounds"]
    out = llm.generate(["n samples"], constrained(7, n=4, json=schema), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert_valid_json(c.text, schema)
    assert len({c.text for c in out.outputs}) > 1  # independent samples, not one copied


def test_preemption_keeps_every_sample_valid(tiny_model: Path) -> None:
    # Few blocks for many long sequences: the newest are preempted and recomputed.
    llm = LLM(str(tiny_model), num_gpu_blocks_override=24, max_num_seqs=8, block_size=16)
    schema = SCHEMAS["nested"]
    params = [constrained(s, json=schema) for s in range(8)]
    outs = llm.generate(["preempt me " * 4] * 8, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    for o in outs:
        assert_valid_json(o.outputs[0].text, schema)
    assert_no_blocks_held(llm)


def test_max_tokens_mid_structure_finishes_with_length(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=3,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]),
    )
    c = llm.generate(["short"], params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3


def test_a_failed_step_mid_structure_leaves_no_matcher_behind(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_gpu_blocks_override=64, max_num_seqs=4)
    engine = llm.llm_engine
    params = constrained(11, json=SCHEMAS["anyof-ref"])
    calls = {"n": 0}

    def hook(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 6:  # a decode step, a few tokens into the object
            raise RuntimeError("injected fault")

    handle = engine.model.model.layers[0].register_forward_hook(hook)
    req = engine.add_request("victim", "fault", params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    handle.remove()
    assert outputs[-1].outputs[0].finish_reason == "error"
    assert 0 < len(req.seqs[0].output_token_ids) < MAX_TOKENS  # it failed mid-structure
    assert all(seq.grammar is None for seq in req.seqs)
    assert_no_blocks_held(llm)
    # The same request now gives exactly what a fresh engine gives.
    again = llm.generate(["fault"], params, use_tqdm=False)[0].outputs[0]
    fresh = LLM(str(tiny_model), num_gpu_blocks_override=64, max_num_seqs=4)
    expected = fresh.generate(["fault"], params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == expected.token_ids
    assert_valid_json(again.text, SCHEMAS["anyof-ref"])


def test_a_matcher_ahead_of_its_tokens_is_replayed(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output_manager
    so = StructuredOutputsParams(choice=["abc", "abd"])
    grammar = manager.new_grammar(so)
    ids = llm.get_tokenizer().encode("abc", add_special_tokens=False)
    sync_grammar(grammar, ids)
    assert grammar.num_processed_tokens == len(ids)
    sync_grammar(grammar, ids[:1])  # behind what it saw: rebuilt from the start
    assert grammar.num_processed_tokens == 1


@pytest.mark.parametrize(
    ("kind", "param"),
    [
        ({"json": '{"type": "object", "properties": '}, "json"),
        ({"json": {"type": "no-such-type"}}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ],
)
def test_an_invalid_constraint_is_a_typed_error_naming_it(
    llm: LLM, kind: dict[str, Any], param: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
    with pytest.raises(StructuredOutputError) as info:
        llm.llm_engine.add_request("bad", "x", params)
    assert info.value.param == param and str(info.value).startswith(f"invalid {param}:")
    assert not llm.llm_engine.requests


def test_compiled_once_per_constraint(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output_manager
    before = len(manager.compile_times_s)
    so = StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "boolean"}}})
    llm.generate(["a", "b", "c"], constrained(1, n=2, json=so.json), use_tqdm=False)
    assert len(manager.compile_times_s) == before + 1


def test_bitmask_unpacks_like_xgrammar_applies_it() -> None:
    import xgrammar as xgr

    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    ours = logits.masked_fill(~bitmask_to_bool(bitmask, vocab), float("-inf"))
    assert torch.equal(ours, expected)


def test_the_grammar_wins_over_min_tokens(llm: LLM) -> None:
    # min_tokens masks EOS, the finished grammar allows only EOS: the row keeps the grammar's
    # choice (never a row with no token at all), and the complete structure ends the output.
    params = SamplingParams(
        temperature=0,
        min_tokens=6,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=["yes"]),
    )
    c = llm.generate(["q"], params, use_tqdm=False)[0].outputs[0]
    assert c.text == "yes" and c.finish_reason == "stop"


def test_a_batch_without_constraints_skips_the_grammar_processor() -> None:
    from minivllm.sample.logits_processors import apply_grammar_bitmask
    from minivllm.sample.sampler import SamplingMetadata, SamplingRow

    rows = [SamplingRow(SamplingParams(), [1, 2], [3])] * 3
    meta = SamplingMetadata.from_rows(rows, 64, "cpu")
    logits = torch.randn(3, 64)
    assert meta.grammar_bitmask is None
    assert apply_grammar_bitmask(logits, meta) is logits  # not even a copy
