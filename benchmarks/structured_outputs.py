"""The cost of structured outputs: a constrained batch's step against an unconstrained one's.

Same model, same prompts, same batch size, same number of decode steps: once free (ignore_eos,
so every request runs all steps), once with every request under a JSON schema that cannot end
within the run (an array of at least 100 short strings), so that both runs do the same steps. The difference per
step is what the grammar costs: filling each row's bitmask on the host (xgrammar's matcher) and
masking the rows, plus advancing each matcher by its sampled token. Also: compile times (first
compile and a cache hit) and the validity rate of bounded schemas, sampled.

Run: python benchmarks/structured_outputs.py [--batch 8] [--steps 48] [--samples 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from minivllm import LLM, SamplingParams, StructuredOutputsParams

# At least 100 items: no request can end before the last step, so both runs do the same steps.
UNBOUNDED = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 100}
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 100},
        "v": {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/p"}]},
    },
    "required": ["name", "tags", "n", "v"],
    "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
}


def step_times(llm: LLM, params: SamplingParams, batch: int, tag: str) -> list[float]:
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", f"Item {i}: write a JSON list of names.", params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step is the prefill: decode steps only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="unset: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--samples", type=int, default=24, help="sampled outputs for the validity rate")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=1024, num_gpu_blocks_override=512, max_num_seqs=32)
    free = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    so = StructuredOutputsParams(json=UNBOUNDED)
    constrained = SamplingParams(temperature=0, max_tokens=args.steps + 1, structured_outputs=so)
    step_times(llm, free, args.batch, "warm")
    t_free = step_times(llm, free, args.batch, "free")
    t_con = step_times(llm, constrained, args.batch, "con")
    a, b = statistics.median(t_free), statistics.median(t_con)
    print(
        f"per decode step, batch {args.batch}, {len(t_con)} steps (median): unconstrained "
        f"{a * 1e3:.2f} ms, constrained {b * 1e3:.2f} ms: +{(b - a) * 1e3:.2f} ms "
        f"(+{(b - a) / a:.1%}), {(b - a) / args.batch * 1e3:.3f} ms per constrained row"
    )
    manager = llm.llm_engine.structured_output_manager
    start = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=UNBOUNDED))
    hit = time.perf_counter() - start
    manager.compile(StructuredOutputsParams(json=BOUNDED))
    print(
        f"compile: tokenizer info {manager.backend_init_s or 0:.3f} s once per engine; "
        f"grammars {', '.join(f'{t * 1e3:.1f}' for t in manager.compile_times_s)} ms; "
        f"a cache hit {hit * 1e6:.0f} us"
    )
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=BOUNDED),
        )
        for s in range(args.samples)
    ]  # fmt: skip
    outs = llm.generate(["Describe a person as JSON."] * args.samples, params, use_tqdm=False)
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), BOUNDED)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    rate = valid / args.samples
    print(f"validity: {valid}/{args.samples} sampled outputs parse and validate ({rate:.0%})")


if __name__ == "__main__":
    main()
