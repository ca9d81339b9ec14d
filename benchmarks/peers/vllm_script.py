"""Run a bench workload through vLLM: executed by the vLLM interpreter, never imported by minivllm.

`python -m benchmarks.throughput_vs_peers --vllm-python PATH` runs `PATH vllm_script.py IN.json OUT.json`
in a process of its own (vLLM is never a dependency of minivllm, and lives in its own virtual
environment). IN.json: the model folder, dtype, engine limits and the requests (prompt token ids
and exact output lengths, EOS ignored, greedy). OUT.json: the timed run's seconds, output tokens,
the generated token ids and the process's peak RSS. This file imports nothing of minivllm, so any
Python with vLLM can run it. vLLM's own engine core runs in a second process, as it does by
default; the peak RSS is this process's only.
"""

import json
import resource
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=0,
    )
    requests = spec["requests"]
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    import vllm

    result = {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "version": vllm.__version__,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's engine core starts processes: the guard is required
    main()
