"""Tensor, pipeline and data parallelism over a network between two nodes, on paper (issue 47).

Why pipeline stages, not tensor-parallel shards, are what spans hosts (docs/distributed.md): a
decode step's traffic and time when a model is split over two nodes joined by a 1-25 Gbit/s link,
for Llama-2-7B and Llama-2-70B, each node one H200 (the simulated executor's roofline,
minivllm/experiments/simulated_executor.py). The arithmetic, per step of B tokens at 16-bit:

- **tensor parallelism, 2 ranks (one a node):** every layer's attention and MLP outputs and the
  vocabulary-parallel embedding are all-reduced: `2·layers + 1` all-reduces of `B·hidden·2` bytes.
  A ring all-reduce over 2 ranks is a reduce-scatter and an all-gather, each one message of half
  the tensor: each rank sends `B·hidden·2` bytes per all-reduce, in two latencies. Each node reads
  half the weights.
- **pipeline parallelism, 2 stages:** one message between the stages: the hidden state and the
  residual, `B·2·hidden·2` bytes, one latency; the sampled token ids come back (vLLM's layout: the
  last stage samples), a few bytes. Each stage reads half the weights, but one batch passes the
  two stages one after the other, so a step of one batch takes both halves; with two batches in
  flight (vLLM's `max_concurrent_batches`) both stages work at once and the throughput is that of
  the slower stage.
- **data parallelism, 2 replicas:** nothing per token crosses the network (requests in, text out);
  each node holds the whole model, so it needs one that fits a node.

Compute is the roofline of memory: a decode step reads the node's weights once, `bytes / HBM
bandwidth` (the KV cache's reads and the FLOPs are left out: at batch 32 and short contexts they
are small against the weights). The network is `latency + bytes / bandwidth` per message with the
latency `LINK_LATENCY_S` for every link speed (an assumption: a TCP round trip between hosts in
one rack). Nothing here is measured; it is the model the distributed page's table prints.

    python -m minivllm.experiments.parallel_network
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.experiments.simulated_executor import GPUS, GPUSpec

LINK_LATENCY_S = 30e-6  # one message's latency between two hosts (assumed, not measured)
LINKS_GBIT = (1, 10, 25)
BATCHES = (1, 32)
DTYPE_BYTES = 2  # fp16 / bf16 activations and weights


@dataclass(frozen=True)
class DenseModel:
    """The parts of a dense decoder that set its traffic: layers, hidden width, weight bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_params: float
    source: str

    @property
    def weight_bytes(self) -> float:
        return self.num_params * DTYPE_BYTES


MODELS = (
    DenseModel("Llama-2-7B", 32, 4096, 6.74e9, "meta-llama/Llama-2-7b-hf config.json"),
    DenseModel("Llama-2-70B", 80, 8192, 68.98e9, "meta-llama/Llama-2-70b-hf config.json"),
)
LAYOUTS = ("TP 2", "PP 2", "DP 2")


def bytes_per_token(model: DenseModel, layout: str, dtype_bytes: int = DTYPE_BYTES) -> int:
    """Bytes one node sends the other for one token of one decode step."""
    if layout == "TP 2":
        return (2 * model.num_layers + 1) * model.hidden_size * dtype_bytes
    if layout == "PP 2":
        return 2 * model.hidden_size * dtype_bytes  # hidden state + residual
    return 0


def messages_per_step(model: DenseModel, layout: str) -> int:
    """Messages in sequence on the step's critical path (each pays the link's latency)."""
    if layout == "TP 2":
        return 2 * (2 * model.num_layers + 1)  # reduce-scatter + all-gather per all-reduce
    if layout == "PP 2":
        return 1
    return 0


def fits_one_node(model: DenseModel, gpu: GPUSpec) -> bool:
    """Whether the whole model's weights fit one node with room for a KV cache (90 %)."""
    return model.weight_bytes < 0.9 * gpu.memory_bytes


def step_time_s(
    model: DenseModel, layout: str, batch: int, link_gbit: float, gpu: GPUSpec
) -> float:
    """One decode step of `batch` tokens: compute (the weights' read) plus the network."""
    weights_per_node = model.weight_bytes if layout == "DP 2" else model.weight_bytes / 2
    compute = weights_per_node / gpu.hbm_bandwidth
    if layout == "PP 2":  # one batch passes both stages in turn
        compute *= 2
    network = messages_per_step(model, layout) * LINK_LATENCY_S
    network += batch * bytes_per_token(model, layout) / (link_gbit * 1e9 / 8)
    return compute + network


def tokens_per_s(
    model: DenseModel, layout: str, batch: int, link_gbit: float, gpu: GPUSpec
) -> float:
    """Both nodes' decode throughput: tensor parallelism runs one batch over both; two batches in
    flight keep both pipeline stages busy; two replicas run a batch each."""
    batches_at_once = 1 if layout == "TP 2" else 2
    return batches_at_once * batch / step_time_s(model, layout, batch, link_gbit, gpu)


def table(gpu: GPUSpec = GPUS["h200"]) -> str:
    """The distributed page's table, as markdown."""
    head = (
        ["model", "layout", "bytes / token"]
        + [f"step, B={b}, {g} Gbit/s" for b in BATCHES for g in LINKS_GBIT]
        + [f"tokens/s, B=32, {g} Gbit/s" for g in (1, 10)]
    )
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in MODELS:
        for layout in LAYOUTS:
            cells = [model.name, layout, f"{bytes_per_token(model, layout):,}"]
            if layout == "DP 2" and not fits_one_node(model, gpu):
                cells += ["does not fit one node"] + ["-"] * (len(head) - 4)
            else:
                cells += [
                    f"{step_time_s(model, layout, b, g, gpu) * 1e3:.1f} ms"
                    for b in BATCHES
                    for g in LINKS_GBIT
                ]
                cells += [f"{tokens_per_s(model, layout, 32, g, gpu):,.0f}" for g in (1, 10)]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
