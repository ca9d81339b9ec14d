"""The engine: requests in, one scheduled batch per step, `RequestOutput`s out (vLLM v1's
`vllm/v1/engine/`).

`LLMEngine.step()` reads like the paper's loop: schedule (minivllm/core/), execute
(minivllm/executor/), sample (minivllm/sample/), then turn the sampled ids into text, stops and
outputs. This room holds the engine and everything around its step:

- `llm_engine.py`        `LLMEngine`: `add_request`, `abort_request`, `step`
- `arg_utils.py`         `EngineArgs`: every engine option declared once (Python, CLI, benches)
- `input_processor.py`   a prompt and its `SamplingParams` into a `Request` the scheduler can take
- `logprobs_limit.py`    how many logprobs a request may ask for (vLLM's `_validate_logprobs`)
- `output_processor.py`  sampled ids into text deltas, stops and finish reasons
- `detokenizer.py`       incremental text, one delta per step, stop strings held back
- `stop_checker.py`      whether a sequence is finished after its newest token, and why
- `parallel_sampling.py` what a sample does to its request (`n > 1` forks, beam search's hook)
- `beam_search.py`       beam search on copy-on-write blocks (paper §4.4)
- `speculator.py`        speculative decoding's engine side: propose, then verify
- `stats.py`             counters for `LLM.get_stats()` and /metrics
- `step_listener.py`     the step as a message, for observers (trace, stats) that subscribe

The engine behind the server, through one interface (vLLM's `vllm/engine/protocol.py`,
`async_llm.py`, `core.py`, `core_client.py`):

- `protocol.py`          `EngineClient`, the interface the server's handlers drive
- `async_llm_engine.py`  `AsyncLLMEngine`: the `LLMEngine` stepped by a thread of the server's
                         process
- `core.py`              `EngineCoreProc`: the `LLMEngine` in a spawned process, served over a pipe
- `core_client.py`       `EngineCoreClient` (starts the core) and `AsyncMPClient` (its client)

The offline API (minivllm/llm.py) and the server (minivllm/entrypoints/) sit above this room.
"""
