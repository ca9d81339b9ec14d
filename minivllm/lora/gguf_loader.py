"""Read a llama.cpp GGUF LoRA file into host tensors, for a GGUF base model (llama.cpp's adapters).

llama.cpp's `convert_lora_to_gguf.py` writes a PEFT adapter as one GGUF file, and its loader
(src/llama-adapter.cpp, `llama_adapter_lora_init`) reads it back. The file holds:

    general.type          "adapter"
    general.architecture  the base's llama.cpp architecture ("llama", "qwen2", ...)
    adapter.type          "lora"
    adapter.lora.alpha    float32 alpha (0: the delta is not scaled)
    blk.N.<kind>.weight.lora_a   [r, in]    (GGML's ne = [in, r])
    blk.N.<kind>.weight.lora_b   [out, r]   (GGML's ne = [r, out])

where `blk.N.<kind>.weight` is the base tensor the pair adapts (`blk.0.attn_q.weight`). The
converter passes each (A, B) pair through the base converter's own tensor changes, as a lazy
product B·A: a change of the output rows moves B's rows. So for the llama architecture B's rows of
attn_q and attn_k are permuted for interleaved RoPE exactly as the base's q/k rows are, and they
come back the same way (`to_hf_layout`, the base loader's own unpermute). llama.cpp scales the
delta by `alpha / r`, or 1 when alpha is 0 (`llama_adapter_lora_weight::get_scale`); rsLoRA's
alpha / √r has no field of its own (a converter can fold √r into alpha).

What comes out is the `LoRAModel` a PEFT folder gives (peft_loader.py), under transformers'
module names, so the manager, the slots and the punica ops do not know which file it came from.
Checked before anything changes, each with an error naming the key, tensor or shape: the file is
an adapter of type lora, of the base's architecture, on a GGUF base; every tensor is a lora_a /
lora_b of a linear the model can adapt, in pairs, of one rank no wider than max_lora_rank, and
of the linear's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minivllm.lora.errors import LoRAFileError, LoRAShapeError, UnsupportedLoRAError
from minivllm.lora.peft_loader import LoRALayerWeights, LoRAModel
from minivllm.lora.request import LoRARequest
from minivllm.model.config import LlamaConfig
from minivllm.model.quantization.gguf.config import GGUF_ARCHITECTURES
from minivllm.model.quantization.gguf.reader import (
    GGUFReadError,
    hf_name,
    open_gguf,
    to_hf_layout,
)

GGUF_MAGIC = b"GGUF"
SUFFIXES = (".lora_a", ".lora_b")


def is_gguf_file(path: str) -> bool:
    """A GGUF file (by its name, or by its magic whatever its name) rather than a PEFT folder."""
    file = Path(path).expanduser()
    if file.is_dir():
        return False
    if file.suffix == ".gguf":
        return True  # a missing or truncated one is then refused as a GGUF file
    if not file.is_file():
        return False
    with file.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _check_header(reader: Any, where: str, config: LlamaConfig, base_arch: str) -> float:
    """The adapter's metadata against the base; returns its alpha."""
    kind = _field(reader, "general.type")
    if kind != "adapter":
        raise LoRAFileError(
            f"{where}: general.type is {kind!r}, not 'adapter' (a model file, not a LoRA adapter)"
        )
    adapter_type = _field(reader, "adapter.type")
    if adapter_type != "lora":
        raise UnsupportedLoRAError(
            f"{where}: adapter.type is {adapter_type!r}; only 'lora' adapters are supported"
        )
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise UnsupportedLoRAError(
            f"{where}: adapter.alora.invocation_tokens is set (an activated LoRA, applied only "
            "after its invocation tokens), which is not supported"
        )
    arch = _field(reader, "general.architecture")
    if arch != base_arch:
        raise LoRAShapeError(
            f"{where}: general.architecture is {arch!r}, but the base model is {base_arch!r} "
            f"({config.architecture}): an adapter of another model"
        )
    alpha = _field(reader, "adapter.lora.alpha")
    if alpha is None:
        raise LoRAFileError(f"{where}: adapter.lora.alpha is missing")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise LoRAFileError(f"{where}: adapter.lora.alpha must be a number >= 0, got {alpha!r}")
    return float(alpha)


def _read_pairs(reader: Any, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """base tensor name -> {".lora_a": A, ".lora_b": B}, float32 in torch's order."""
    from gguf.quants import dequantize

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        suffix = next((s for s in SUFFIXES if t.name.endswith(s)), None)
        if suffix is None:  # mergekit's norms, a full tensor: not a low-rank delta
            raise UnsupportedLoRAError(
                f"{where}: tensor {t.name} is not a .lora_a or .lora_b weight (only LoRA A/B "
                "pairs of linears are supported)"
            )
        try:
            array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (ValueError, OSError, NotImplementedError) as exc:
            raise LoRAFileError(
                f"{where}: cannot read tensor {t.name} (truncated?): {exc}"
            ) from exc
        pairs.setdefault(t.name.removesuffix(suffix), {})[suffix] = torch.from_numpy(array)
    if not pairs:
        raise LoRAFileError(f"{where}: the file holds no LoRA weights")
    return pairs


def load_gguf_adapter(
    request: LoRARequest,
    targets: Mapping[str, tuple[int, int]],  # transformers module name -> (in, out) of the model
    max_lora_rank: int,
    dtype: torch.dtype,
    config: LlamaConfig,
    base_gguf: Path | None,  # the GGUF file the base model came from; None: another format
) -> LoRAModel:
    """The llama.cpp adapter of `request.lora_path`, checked against the model and its file."""
    path = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {path}"
    if base_gguf is None:
        raise UnsupportedLoRAError(
            f"{where}: a GGUF LoRA adapter needs a GGUF base model (its tensor names and q/k "
            "layout are llama.cpp's); give this base a PEFT folder instead"
        )
    try:
        reader, base = open_gguf(path), open_gguf(base_gguf)
    except GGUFReadError as exc:
        raise LoRAFileError(f"{where}: {exc}") from exc
    base_arch = _field(base, "general.architecture")
    if GGUF_ARCHITECTURES.get(base_arch) is None:
        raise UnsupportedLoRAError(f"{where}: the base's architecture {base_arch!r} is unknown")
    alpha = _check_header(reader, where, config, base_arch)
    layers: dict[str, LoRALayerWeights] = {}
    ranks: set[int] = set()
    for name, pair in sorted(_read_pairs(reader, where).items()):
        weight = hf_name(name, config.architecture)  # model.layers.N.self_attn.q_proj.weight
        module = "" if weight is None else weight.removesuffix(".weight")
        if weight is None or module not in targets:
            raise UnsupportedLoRAError(
                f"{where}: {name} is not a linear of this model that LoRA can adapt "
                "(attn_q/k/v/output, ffn_gate/up/down of its blocks)"
            )
        for suffix in SUFFIXES:
            if suffix not in pair:
                raise LoRAFileError(f"{where}: {name}{suffix} is missing")
        a, b = pair[".lora_a"], pair[".lora_b"]
        size_in, size_out = targets[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, size_in) or (
            tuple(b.shape) != (size_out, rank)
        ):  # fmt: skip
            raise LoRAShapeError(
                f"{where}: {name} has lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}, but "
                f"this model needs (r, {size_in}) and ({size_out}, r) (an adapter of another "
                "base model, or A and B transposed?)"
            )
        ranks.add(rank)
        b = to_hf_layout(weight, b, config)  # llama's q/k rows, back in transformers' order
        layers[module] = LoRALayerWeights(a.to(dtype), b.contiguous().to(dtype))
    if len(ranks) > 1:
        raise UnsupportedLoRAError(f"{where}: the linears have ranks {sorted(ranks)} (one r)")
    (rank,) = ranks
    if rank > max_lora_rank:
        raise UnsupportedLoRAError(
            f"{where}: rank r={rank} is above max_lora_rank={max_lora_rank}; raise max_lora_rank"
        )
    scale = alpha / rank if alpha else 1.0  # llama.cpp's get_scale
    return LoRAModel(request.lora_int_id, rank, scale, layers)
