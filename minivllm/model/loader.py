"""Loading a model that is on disk: its config, its weights onto the device, its tokenizer.

vLLM's model loader in miniature. Finding the model (the bundled GGUF, a folder, a .gguf file, a
hub id), its generation defaults and its dtype is `resolver.py`'s, before the engine starts; which
class runs it is the registry's (`registry.py`). Weights are read with `safetensors` or the `gguf`
reader — never with pickle, so a checkpoint cannot run code — and mapped onto minivllm's parameter
names, fusing q/k/v and gate/up as the model expects. The model is built on `meta`, allocated without
initialisation, and `weights.py` hands each checkpoint tensor, as a lazy safetensors slice, to
its layer's weight loader, which copies the part this rank holds: a rank of a tensor-parallel
group reads only its own slices and never holds the whole model (paper §4.6; the docs'
architecture page, docs/architecture.md). The errors are in `errors.py`.

Every failure is a `ModelLoadError` subclass whose message says what was looked for and what to do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.custom_op import dispatch_custom_ops
from minivllm.model.errors import (
    CorruptCheckpointError,
    ModelLoadError,
    TokenizerNotFoundError,
    UnsupportedArchitectureError,
)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.registry import config_from_hf_dict, model_class
from minivllm.model.pipeline import keep_stage
from minivllm.model.source import ModelSource
from minivllm.model.tokenizer_class import generic_tokenizer_class
from minivllm.model.weights import load_weights, open_checkpoint
from minivllm.platforms import platform_for


def load_config(source: ModelSource) -> LlamaConfig:
    """The model's config (with the source's `hf_overrides` applied), after the registry has
    said its architecture runs."""
    try:
        cfg = json.loads((source.path / "config.json").read_text())
        if source.hf_overrides is not None:
            cfg = source.hf_overrides.apply(cfg)
        config = config_from_hf_dict(cfg)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{source.name}: {exc}") from exc
    except (json.JSONDecodeError, KeyError) as exc:
        raise CorruptCheckpointError(
            f"{source.path / 'config.json'} is not a valid config: {exc!r}"
        ) from exc
    return config


def build_model(
    config: LlamaConfig,
    load: Callable[[LlamaForCausalLM], None],
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallelGroup = SINGLE_DEVICE,
    custom_ops: str = "auto",
    stage: tuple[list[int], int] | None = None,
) -> LlamaForCausalLM:
    """Create rank `tp.rank`'s shard on `meta`, allocate it on `device` (nothing is initialised:
    every value comes from the checkpoint) and `load` the checkpoint's tensors into it. With
    `stage` (layers per pipeline stage, this rank's stage) only that stage's parts are kept
    before anything is allocated (model/pipeline.py). Then the
    device's platform chooses each custom op's forward: its own kernels under `custom_ops="all"`,
    plain PyTorch under "none"; "auto" is settled by `Platform.resolve_custom_ops` ("none" with
    the reference attention backend)."""
    model_cls = model_class(config)
    with torch.device("meta"):
        model = model_cls(config, backend, max_positions, tp).to(dtype)
    if stage is not None:
        keep_stage(model, *stage)
    # `to_empty`, with `torch.empty` for its `empty_like`: on meta tensors `empty_like` runs
    # torch's Python reference ops, whose first use imports sympy, a start-up cost. Parameters
    # only: the one buffer (the RoPE table) is rebuilt below.
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))
    if config.tie_word_embeddings and getattr(model.lm_head, "tied", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # (both on this stage)
    load(model)
    # The RoPE table is a non-persistent buffer, never loaded: build it for real (in float32).
    # (An encoder with absolute positions, BERT, has none.)
    if hasattr(model.model, "rotary_emb"):
        model.model.rotary_emb = RotaryEmbedding(
            config, max_positions or config.max_position_embeddings
        ).to(device)
    platform = platform_for(device)
    dispatch_custom_ops(model, platform, platform.resolve_custom_ops(custom_ops, backend.name))
    return model.eval()


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallelGroup = SINGLE_DEVICE,
    custom_ops: str = "auto",
    quantization: str = "none",
    stage: tuple[list[int], int] | None = None,
) -> LlamaForCausalLM:
    """The model, or with `tp` one rank's shard of it (with `stage`, of one pipeline stage's
    parts), read slice by slice from safetensors; or, with `quantization="gguf"`, from the GGUF
    file itself, its blocks kept as stored."""
    config = load_config(source)
    build = functools.partial(
        build_model,
        backend=backend,
        dtype=dtype,
        device=device,
        max_positions=max_positions,
        tp=tp,
        custom_ops=custom_ops,
        stage=stage,
    )
    if quantization == "gguf":
        from minivllm.model.quantization.gguf.loader import load_gguf_weights, read_tensors

        if source.gguf_file is None:
            raise ModelLoadError(f"quantization='gguf' needs a .gguf model; {source.name} is not")
        if tp.world_size > 1 or stage is not None:
            raise ModelLoadError(
                "a GGUF model's blocks run on one device; for tensor_parallel_size > 1 or "
                "pipeline_parallel_size > 1 pass quantization='none' (--quantization none) to "
                "dequantize it at load"
            )
        tensors, quant = read_tensors(source.gguf_file, config)
        return build(config, lambda model: load_gguf_weights(model, tensors, quant))
    if source.gguf_file is not None:
        from minivllm.model.quantization.gguf.reader import dequantized_weights

        dequantized_weights(source.path, source.gguf_file)
    with open_checkpoint(source.path) as weights:
        return build(config, lambda model: load_weights(model, weights))


# ---------------------------------------------------------------------------------- tokenizer
# Files transformers' AutoTokenizer builds a tokenizer from; `save_pretrained` of a model alone
# writes none of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_HINT = (
    "pass another tokenizer with tokenizer=FOLDER_OR_HUB_ID (--tokenizer), or "
    "skip_tokenizer_init=True (--skip-tokenizer-init) to send and receive token ids only"
)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    """The model's transformers tokenizer (or `tokenizer`'s: a folder or a hub id), as
    `AutoTokenizer` would build it."""
    name = tokenizer or str(source.path)
    folder = Path(name).expanduser()
    # Checked before transformers is asked: for a folder without tokenizer files it answers with
    # a message about converting slow tokenizers, which does not tell the user what to do.
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        whose = "the tokenizer folder" if tokenizer else "the model folder"
        raise TokenizerNotFoundError(
            f"{whose} {name!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            + _TOKENIZER_HINT
        )
    try:
        generic = generic_tokenizer_class(folder) if folder.is_dir() else None
        if generic is not None:
            return generic.from_pretrained(name)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer from {name!r}: {exc}; {_TOKENIZER_HINT}"
        ) from exc
