"""Process groups and collectives for tensor parallelism on `torch.distributed` (paper §4.6).

- `parallel_state.py`  `TensorParallelGroup`, the handle the parallel layers talk through (no
                       collective at all at one rank)
- `process_group.py`   starting, joining and leaving the process groups

The parallel layers are in minivllm/model/layers/linear.py; the executors that start and drive the
ranks in minivllm/executor/, and a rank's loop in minivllm/worker/worker_proc.py. The docs' page
"Distributed execution" (docs/distributed.md) draws who holds what.
"""
