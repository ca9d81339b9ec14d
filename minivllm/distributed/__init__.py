"""Tensor parallelism on `torch.distributed`: one model split over several devices (paper §4.6).

- `parallel_state.py`  the process group of a step's collectives and `TensorParallelGroup`, the
                       handle the parallel layers use (no collective at all at one rank)
- `executor.py`        the driver's side: one runner in-process (N = 1), or N ranks that each run
                       the same `SchedulerOutput` (`MultiprocExecutor`, `torchrun`)
- `worker.py`          a rank's side: build the shard of the model, then run the steps it is sent

The parallel layers themselves are in `minivllm/model/parallel_layers.py`. The docs' page
"Distributed execution" (docs/distributed.md) draws who holds what; see also the architecture page
(docs/architecture.md). This package's `__init__` imports nothing, so that importing one of its
modules never drags in the others.
"""
