"""Experiments that plug into the engine through its interfaces, never imported by it.

Tier: api and extras. `reservation.py`: the paper's Orca baselines (§6.2) as KV cache managers,
chosen with `kv_allocation` (minivllm/config.py names their classes).
"""
