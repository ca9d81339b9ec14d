"""Pooling models: a step with no decode, a pooler instead of a sampler (vLLM's
`vllm/pooling_params.py` and `vllm/model_executor/layers/pooler.py`).

An embedding (or a cross-encoder's score) is computed from the hidden states of the prompt alone:
a pooling request is prefill-only. It is scheduled like any prompt, in chunks under the same
token budget, and when its last chunk has run the runner pools the prompt's hidden states into
one vector and the request finishes, its KV blocks freed. Nothing is sampled.

- `pooling_params.py`  `PoolingParams`: what a request asks of the pooler (`dimensions`, `normalize`)
- `config.py`          `PoolerConfig`: the model's pooler (LAST, MEAN, CLS; normalize; matryoshka
                       dimensions), read from sentence-transformers' `modules.json` and
                       `1_Pooling/config.json`, or from `runner` / `convert` / `pooler_config`
- `pooler.py`          the math: hidden states [L, H] -> one vector [H], then per-request finishing
- `outputs.py`         vLLM's `EmbeddingRequestOutput`, `ClassificationRequestOutput` and
                       `ScoringRequestOutput`
- `scoring.py`         pair scores: a cross-encoder's pair prompt, an embedding model's cosine

This room imports torch only in `pooler.py`; the core reads `PoolingParams` without it.
"""
