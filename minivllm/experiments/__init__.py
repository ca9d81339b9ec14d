"""Experiments that plug into the engine from outside, through the interfaces it already has.

The paper's baselines and its simulated GPU are here, not in the core: the reservation policies
(Orca, §6.2) are KV cache managers the engine is given, and the simulated-time executor is an
executor it is given (`LLMEngine(config, executor=...)`). Nothing in the engine, the scheduler or
the block files reads a parameter that only an experiment needs.

`reservation.py`: the paper's Orca baselines (§6.2) as KV cache managers, chosen with
`kv_allocation` (minivllm/config/__init__.py names their classes); `simulated_executor.py`: no model, a
roofline clock; `parallel_network.py`: tensor, pipeline and data parallelism's traffic and step
time over a link between two nodes, on paper (docs/distributed.md's table). These modules import the engine and the core; nothing below imports them.
"""
