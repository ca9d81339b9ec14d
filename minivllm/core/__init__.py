"""Core bookkeeping (vLLM v1's `vllm/v1/core`): the block pool, the KV cache manager and the
scheduler, with the request state they read (`minivllm/sequence.py`).

Imports only the leaves (configs, sampling parameters) and itself; no torch, no tensors: which token
of which request sits in which physical block, and which requests run in a step, is plain Python a
reader follows without the model. The engine turns it into tensors.

    kv_cache_utils.py    KVCacheBlock, the free queue, BlockHash, the stats and snapshot types
    block_pool.py        BlockPool: get / touch / free / evict / cache of blocks
    kv_cache_manager.py  KVCacheManager: block tables, copy-on-write, one prefix lookup per
                         admission, commit / rollback of a step's prefix-cache names
    scheduler.py         token-budget scheduling: decodes first, chunked prefill, preemption
"""
