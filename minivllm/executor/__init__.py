"""Executors: who runs the model for the engine (vLLM v1's `vllm/v1/executor/`).

- `abstract.py`           `Executor`, the interface the engine calls each step, the one-process
                          `UniProcExecutor`, and `make_executor`, which picks by the parallel sizes
- `tensor_parallel.py`    the executors of tensor parallelism: spawned ranks, or ranks `torchrun`
                          started
- `driver.py`             rank 0 of a tensor-parallel group: send each step to every rank, run its
                          own share, collect
- `multiproc_executor.py` the engine starts its own workers: N-1 spawned processes on this machine,
                          or its node's share of them, the other nodes running `serve --headless`
- `ray_distributed_executor.py` ranks 1..N-1 as Ray actors, placed over a Ray cluster's nodes
                          (`distributed_executor_backend="ray"`; the optional extra minivllm[ray])

The ranks themselves are workers (minivllm/worker/worker_proc.py); their process groups and
collectives are in minivllm/distributed/.
"""
