"""Process groups and collectives for tensor and pipeline parallelism on `torch.distributed`.

- `parallel_state.py`  `TensorParallelGroup`, the handle the parallel layers talk through (no
                       collective at all at one rank)
- `pipeline.py`        `PipelineParallelGroup`: a rank's stage, the layers each stage holds, and
                       the point-to-point sends between stages
- `process_group.py`   starting, joining and leaving the process groups

The parallel layers are in minivllm/model/layers/linear.py; the executors that start and drive the
ranks in minivllm/executor/, and a rank's loop in minivllm/worker/worker_proc.py. The docs' page
"Distributed execution" (docs/distributed.md) draws who holds what.
"""
