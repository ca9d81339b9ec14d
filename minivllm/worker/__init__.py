"""Workers and model runners: one device's share of the engine (vLLM v1's `vllm/v1/worker/`).

- `worker.py`             load the model onto a device and size its KV cache (`build_runner`)
- `model_runner.py`       a `SchedulerOutput` into one flat batch and its `AttentionMetadata`, run
                          the model, sample; owns the KV cache tensors
- `hybrid_model_runner.py` the runner of a model whose layers share the cache in groups (Gemma 2/3)
- `cpu_decode_loop.py`    a CPU decode step's layers as one compiled call, built and run by the
                          runner the way vLLM's runner captures and replays CUDA graphs
- `worker_proc.py`        one rank of a tensor-parallel group: build its shard, run what it is sent

The executors (minivllm/executor/) start and drive them.
"""
