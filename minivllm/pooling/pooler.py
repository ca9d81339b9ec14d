"""The pooler: a prompt's hidden states into one vector (vLLM's
`vllm/model_executor/layers/pooler.py`), then each request's finishing touches.

Two halves, on either side of the step message:

- `pool` runs on the model runner, over the hidden states of a whole prompt
  (`PoolingModelRunner` keeps a chunked prompt's rows until its last chunk has run):

      hidden [L, H] --LAST--> hidden[L - 1]        a causal decoder's summary (Qwen3-Embedding)
                    --MEAN--> hidden.mean(0)       sentence-transformers' default (all-MiniLM)
                    --CLS---> hidden[0]            BERT's [CLS] token (bge)

- `finish_embedding` runs in the engine, per request: matryoshka truncation to `dimensions`,
  then L2 normalization (in that order, as sentence-transformers' `truncate_dim` does).
  A classifier's logits (the model's head, `classify`, runs on the runner after CLS pooling)
  are finished by `finish_classification` instead: sigmoid for one label, softmax over several.

Pooling is done in float32 whatever the model's dtype, as vLLM does.
"""

from __future__ import annotations

import torch

from minivllm.pooling.config import PoolerConfig
from minivllm.pooling.pooling_params import PoolingParams


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [L, H] of one prompt (every token, in order) -> float32 [H]."""
    if pooling_type == "LAST":
        return hidden[-1].float()
    if pooling_type == "MEAN":
        return hidden.float().mean(dim=0)
    if pooling_type == "CLS":
        return hidden[0].float()
    raise ValueError(f"unknown pooling_type {pooling_type!r}")


def finish_pooled(
    pooled: torch.Tensor, params: PoolingParams, config: PoolerConfig
) -> torch.Tensor:
    """A request's vector as its task finishes it: an embedding, or a classifier's outputs."""
    if config.task == "classify":
        return finish_classification(pooled, params)
    return finish_embedding(pooled, params, config)


def finish_classification(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """float32 [num_labels] logits -> probabilities (vLLM's `ClassificationOutput.probs`): a
    sigmoid for one label (sentence-transformers' CrossEncoder default), a softmax over several;
    the logits themselves with `activation=False`."""
    if params.activation is False:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def finish_embedding(
    pooled: torch.Tensor, params: PoolingParams, config: PoolerConfig
) -> torch.Tensor:
    """float32 [H] -> float32 [dimensions or H]: truncated, then normalized if asked."""
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled
