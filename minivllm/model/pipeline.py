"""Which parts of a model exist on a pipeline stage, decided from outside the model file.

vLLM's `PPMissingLayer` (vllm/model_executor/models/utils.py): every family builds its whole
module tree, as it would on one device (on `meta`, so it costs nothing), and `keep_stage` then
puts a `PPMissingLayer`, which holds no weight, in place of each part another stage holds:

    stage 0 of 2:   embed_tokens, layers[0:k],                        (norm, lm_head missing)
    stage 1 of 2:   (embed_tokens missing), layers[k:n], norm, lm_head

before the loader allocates anything, so a rank allocates and reads only its own weights. The
model's forward runs `layers[start_layer:end_layer]`, takes the previous stage's hidden state
instead of embedding where it is given one, and hands its own on instead of normalising where
the norm is missing; that is all a model file knows of pipelines.

A missing decoder layer keeps the attention window of the layer it stands for: the KV cache
manager on the driver (stage 0) plans the block tables of every layer, and a model that mixes
windowed and global layers (Gemma 2/3) groups them by their windows (core/kv_cache_groups.py).
"""

from __future__ import annotations

from typing import cast

from torch import nn

from minivllm.distributed.pipeline import stage_range
from minivllm.model.models.llama import LlamaForCausalLM


class PPMissingLayer(nn.Identity):
    """A part of the model that another pipeline stage holds: no weight, never called."""

    def __init__(self, sliding_window: int | None = None, has_window: bool = False) -> None:
        super().__init__()
        if has_window:  # a decoder layer's: what the KV cache manager reads (None: global)
            self.sliding_window = sliding_window


def is_missing(module: nn.Module) -> bool:
    return isinstance(module, PPMissingLayer)


def _stand_in(layer: nn.Module) -> PPMissingLayer:
    windows = [
        cast("int | None", m.sliding_window)
        for m in layer.modules()
        if hasattr(m, "sliding_window")
    ]
    return PPMissingLayer(windows[0] if windows else None, has_window=bool(windows))


def keep_stage(model: LlamaForCausalLM, sizes: list[int], pp_rank: int) -> None:
    """Replace what stage `pp_rank` does not hold (of `sizes[s]` decoder layers per stage s) by
    `PPMissingLayer`s, in place, and narrow the forward to the stage's layers."""
    body = model.model
    start, end = stage_range(sizes, pp_rank)
    body.start_layer, body.end_layer = start, end
    for i, layer in enumerate(body.layers):
        if not start <= i < end:
            body.layers[i] = _stand_in(layer)
    first, last = pp_rank == 0, pp_rank == len(sizes) - 1
    if not first:
        body.embed_tokens = PPMissingLayer()  # type: ignore[assignment]
        model.lm_head.tied = False  # its own copy of the table, if it shared the embedding's
    if not last:
        body.norm = PPMissingLayer()  # type: ignore[assignment]
        model.lm_head = PPMissingLayer()  # type: ignore[assignment]


def stage_target(model: nn.Module, name: str) -> str | None:  # model: a LlamaForCausalLM
    """The parameter a checkpoint tensor feeds on this stage: `name`, or None where another stage
    holds it; a tied embedding table feeds the LM head of a last stage that has no embedding."""
    if name == "model.embed_tokens.weight" and is_missing(
        model.get_submodule("model.embed_tokens")
    ):
        tied = getattr(model.config, "tie_word_embeddings", False)
        return "lm_head.weight" if tied and not is_missing(model.get_submodule("lm_head")) else None
    module: nn.Module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None)  # type: ignore[assignment]
        if module is None:
            return name  # not a module path this checks: the loader's own checks apply
        if is_missing(module):
            return None
    return name
