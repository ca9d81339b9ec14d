"""Core bookkeeping (vLLM v1's `vllm/v1/core`): the block pool, the KV cache manager and the
scheduler, with the request state they read (`minivllm/core/sequence.py`).

No torch and no tensors: which token of which request sits in which physical block, and which
requests run in a step, is plain Python a reader follows without the model. The worker turns it
into tensors.

    sequence.py               a request's state: its sequences, token ids, progress, status
    outputs.py                what a request gives back (`RequestOutput`, `CompletionOutput`)
    kv_cache_utils.py         KVCacheBlock, the free queue, BlockHash, the stats and snapshot types
    block_pool.py             BlockPool: get / touch / free / evict / cache of blocks
    kv_cache_manager.py       KVCacheManager: block tables, copy-on-write, one prefix lookup per
                              admission, commit / rollback of a step's prefix-cache names
    sliding_window_manager.py the manager of layers that attend over a window
    encoder_only_manager.py   an encoder-only model's: slots, no blocks (its attention has no cache)
    kv_cache_groups.py        layers that share the cache in groups (full and windowed)
    kv_cache_coordinator.py   one manager per group, driven as one
    scheduler.py              token-budget scheduling: decodes first, chunked prefill, preemption
"""
