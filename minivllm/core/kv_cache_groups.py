"""Which attention layers share a block table: a model's KV cache groups (vLLM v1's
`KVCacheGroupSpec` and `_get_kv_cache_groups_uniform_page_size`, vllm/v1/core/kv_cache_utils.py).

Layers of one attention kind (global, or a window of W keys) can share a block table: the same
blocks hold what each of them reads. A model that mixes kinds cannot: a global layer reads every
block, a windowed one only the last W keys, whose blocks before it could go back to the pool.
Gemma 2 alternates the two kinds, Gemma 3 has five windowed layers per global one; each kind then
gets block tables of its own, kept by a manager of its own (kv_cache_coordinator.py).

The layout is vLLM's. Every group has the same number of layers, `group_size` (the fewest layers
of any kind; Gemma 3's 5:1 pattern makes five windowed groups as large as the global one), so a
block is the same bytes in every group and all groups draw on one pool: the cache has
`group_size` layer slots, not one per layer, and block b's slot j holds layer `layer_ids[j]` of
whichever group holds b. A kind whose layers do not fill its last group leaves slots unused.

    Gemma 2, 26 layers:  (13 global), (13 windowed)             group_size 13, 2 groups
    Gemma 3, 26 layers:  (4 global), 6 x (up to 4 windowed)     group_size 4,  7 groups
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minivllm.core.kv_cache_utils import ExtraKeys

LayerWindows = tuple[int | None, ...]  # each attention layer's window in order (None: global)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group of layers with the same attention kind, sharing block tables."""

    layer_ids: tuple[int, ...]  # the attention layers of the group; layer_ids[j] uses cache slot j
    sliding_window: int | None  # their window (None: global attention)


def kv_cache_windows(model: object) -> tuple[int | None, LayerWindows]:
    """What the KV cache manager is chosen by, read off the model's attention layers (the modules
    with a `sliding_window` attribute, in order): (the window every layer has, the largest, since
    what it cannot see no layer can; each layer's window where windowed and global layers mix).
    (None, ()) for a model of global layers only, or none (the simulated executor's)."""
    modules = getattr(model, "modules", None)  # an nn.Module's; duck-typed, the core has no torch
    found = [m.sliding_window for m in modules() if hasattr(m, "sliding_window")] if modules else []
    windows = [w for w in found if w is not None]
    if not windows:
        return None, ()
    return (max(windows), ()) if len(windows) == len(found) else (None, tuple(found))


def get_kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """The layers split into groups of one kind and equal size, global groups first (the
    coordinator looks a prefix up in them first: their hit bounds the windowed groups')."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in sorted(enumerate(layer_windows), key=lambda lw: lw[1] is not None):
        kinds.setdefault(window, []).append(layer)
    sizes = [len(layers) for layers in kinds.values()]
    # vLLM's rule: the fewest layers of a kind (the "1" of an n:1 pattern), unless the kinds are
    # nearly even, where padding the smaller kind wastes less than splitting the larger.
    group_size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for window, layers in kinds.items():
        num_groups = -(-len(layers) // group_size)
        # Every num_groups-th layer (vLLM's order, which keeps pipeline stages balanced).
        groups += [
            KVCacheGroupSpec(tuple(layers[i::num_groups]), window) for i in range(num_groups)
        ]
    return groups


def hybrid_kv_cache_groups(model: object, kv_allocation: str) -> list[KVCacheGroupSpec] | None:
    """The groups of a model whose paged cache is split (windowed and global layers mixed); None
    for one table per sequence (every other model, and the reservation baselines, which keep
    every block). CacheConfig names the manager by the same rule (`layer_sliding_windows`)."""
    _, mixed = kv_cache_windows(model)
    return get_kv_cache_groups(mixed) if mixed and kv_allocation == "paged" else None


def num_cache_slots(groups: Sequence[KVCacheGroupSpec]) -> int:
    """The layer slots of the cache: the largest group's layers (`group_size`)."""
    return max(len(group.layer_ids) for group in groups)


def group_extra_keys(group: int, extra_keys: ExtraKeys) -> ExtraKeys:
    """What names a block of `group`: its tokens, and which layers' K/V it holds. Folded into the
    block hash as an extra key (vLLM keys its cache by (hash, group id)), so that one prompt's
    blocks in two groups are two cache entries; group 0 keeps the names a single table gives."""
    return extra_keys if group == 0 else (("kv_cache_group", group), *(extra_keys or ()))
