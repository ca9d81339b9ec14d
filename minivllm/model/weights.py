"""Reading a checkpoint's tensors into a model, slice by slice.

HuggingFace Llama checkpoints store q/k/v and gate/up as separate tensors; minivllm's layers
fuse them, and under tensor parallelism each rank holds only a slice of each (paper §4.6). So the
loader never builds a state dict: it opens the safetensors files lazily (`safe_open(...)`, one
`get_slice` per tensor), checks every name and shape against the config, and hands each tensor to
the weight loader of the layer that holds it (minivllm/model/parallel_layers.py), which reads
just this rank's rows or columns. No rank ever holds the whole model, not even while loading.
See "Distributed execution" (docs/distributed.md) and the architecture page
(docs/architecture.md).

Tier: model. It imports leaves and core.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from minivllm.model.config import LlamaConfig
from minivllm.model.errors import CorruptCheckpointError, ModelNotFoundError
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.parallel_layers import Sliceable

# A checkpoint tensor stored separately -> (the fused parameter it feeds, which part of it).
# vLLM calls this `stacked_params_mapping`; the fused layer's weight loader puts
# each part (and, with tensor parallelism, only this rank's rows of it) in its place.
STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


# Where a checkpoint stores those projections fused already (Phi-3), each tensor is cut into its
# parts, in row order, and each part goes to the fused layer's loader as the separate one would.
PACKED_PARAMS: dict[str, tuple[str | int, ...]] = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "mlp.gate_up_proj": (0, 1),
}


def checkpoint_shapes(config: LlamaConfig, packed: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a HuggingFace checkpoint of `config` must hold, with its full shape; with
    `packed`, q/k/v and gate/up as one fused tensor each (`PACKED_PARAMS`)."""
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    qkv_bias = config.attention_bias or config.qkv_bias
    linears = {
        "self_attn.q_proj": (q, h, qkv_bias),
        "self_attn.k_proj": (kv, h, qkv_bias),
        "self_attn.v_proj": (kv, h, qkv_bias),
        "self_attn.o_proj": (h, q, config.attention_bias),
        "mlp.gate_proj": (i, h, config.mlp_bias),
        "mlp.up_proj": (i, h, config.mlp_bias),
        "mlp.down_proj": (h, i, config.mlp_bias),
    }
    if packed:
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            del linears[part]
        del linears["mlp.gate_proj"], linears["mlp.up_proj"]
        linears["self_attn.qkv_proj"] = (q + 2 * kv, h, qkv_bias)
        linears["mlp.gate_up_proj"] = (2 * i, h, config.mlp_bias)
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["self_attn.q_norm", "self_attn.k_norm"] if config.qk_norm else []
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, (rows, cols, bias) in linears.items():
            shapes[f"{p}{name}.weight"] = (rows, cols)
            if bias:
                shapes[f"{p}{name}.bias"] = (rows,)
        for norm in norms:
            shapes[f"{p}{norm}.weight"] = (d if norm.endswith(("q_norm", "k_norm")) else h,)
    return shapes


def safetensors_files(path: Path) -> list[Path]:
    """A folder's *.safetensors files: one file, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has config.json but no *.safetensors weights")
    return files


@contextmanager
def open_checkpoint(path: Path) -> Iterator[dict[str, Sliceable]]:
    """Every tensor of a folder's safetensors files as a lazy slice (`safe_open(...).get_slice`):
    nothing is read until a weight loader indexes it, and then only the rows or columns it asks
    for. This is what lets each rank of a tensor-parallel group read only its shard."""
    from safetensors import SafetensorError, safe_open

    with ExitStack() as stack:
        slices: dict[str, Sliceable] = {}
        for f in safetensors_files(path):
            if not f.is_file():
                raise CorruptCheckpointError(f"the shard index names {f.name}, which is missing")
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
                slices.update({name: handle.get_slice(name) for name in handle.keys()})  # noqa: SIM118
            except (SafetensorError, OSError, ValueError) as exc:
                raise CorruptCheckpointError(
                    f"cannot read {f} (truncated or corrupt?): {exc}"
                ) from exc
        yield slices


def _shape(tensor: Sliceable) -> tuple[int, ...]:
    return tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())  # type: ignore[attr-defined]


def target_of(name: str) -> tuple[str, tuple[str | int, ...]]:
    """The parameter a checkpoint tensor feeds, and which part of it (the loader's shard_id)."""
    for part, (fused, shard_id) in STACKED_PARAMS.items():
        if f".{part}." in name:
            return name.replace(part, fused), (shard_id,)
    return name, ()


def check_checkpoint(
    config: LlamaConfig, shapes: Mapping[str, tuple[int, ...]], packed: bool = False
) -> dict[str, tuple[int, ...]]:
    """The tensors the model needs, after checking that the checkpoint (name -> shape) holds
    exactly those, each of the shape the config implies."""
    expected = checkpoint_shapes(config, packed)
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    given = {k for k in shapes if "rotary_emb.inv_freq" not in k and k not in ignored}
    missing = sorted(expected.keys() - given)
    if missing:
        raise CorruptCheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(given - expected.keys())
    if unexpected:
        raise CorruptCheckpointError(f"checkpoint has unexpected tensors, e.g. {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CorruptCheckpointError(
                f"tensor {name} has shape {tuple(shapes[name])}, config implies {shape}"
            )
    return expected


class RowRange:
    """Rows [start, stop) of a checkpoint tensor, as a tensor of its own: indexing it reads only
    the rows asked for, from the (lazy) tensor it is cut from. One part of a fused tensor."""

    def __init__(self, tensor: Sliceable, start: int, stop: int) -> None:
        self.tensor, self.start, self.stop = tensor, start, stop

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        first, last, step = rows.indices(self.stop - self.start)  # a slice of this part's rows
        assert step == 1, "weight loaders read contiguous rows"
        return self.tensor[(slice(self.start + first, self.start + last), *rest)]


def packed_parts(name: str, config: LlamaConfig) -> list[tuple[str, str | int, int, int]] | None:
    """For a fused checkpoint tensor (`PACKED_PARAMS`): (parameter, shard id, first row, end row)
    of each part; None for any other tensor."""
    for fused, shard_ids in PACKED_PARAMS.items():
        if f".{fused}." in name:
            d = config.head_dim
            sizes = (
                [config.num_attention_heads * d] + [config.num_key_value_heads * d] * 2
                if fused == "self_attn.qkv_proj"
                else [config.intermediate_size] * 2
            )
            starts = [sum(sizes[:n]) for n in range(len(sizes))]
            return [(name, s, a, a + n) for s, a, n in zip(shard_ids, starts, sizes)]
    return None


def load_weights(model: LlamaForCausalLM, weights: Mapping[str, Sliceable]) -> None:
    """Check the checkpoint's names and shapes against the config, then hand each tensor (each
    part of a fused one) to the weight loader of the layer that holds it (`parallel_layers.py`),
    which copies this rank's slice. Replicated parameters (the norms) are copied whole."""
    from safetensors import SafetensorError

    packed = model.packed_checkpoint
    shapes = {k: _shape(v) for k, v in weights.items()}
    expected = check_checkpoint(model.config, shapes, packed)
    for name in expected:
        parts = packed_parts(name, model.config) if packed else None
        if parts is None:
            target, shard = target_of(name)
            loads = [(target, weights[name], shard)]
        else:
            loads = [(t, RowRange(weights[name], a, b), (s,)) for t, s, a, b in parts]
        try:
            for target, tensor, shard in loads:
                _load_one(model, target, tensor, shard)
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpointError(
                f"cannot read {name} (truncated or corrupt?): {exc}"
            ) from exc


def _load_one(
    model: LlamaForCausalLM, target: str, tensor: Sliceable, shard: tuple[str | int, ...]
) -> None:
    module_name, _, param_name = target.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, param_name)
    weight_loader = getattr(module, "weight_loader", None)  # None: replicated (the norms)
    if weight_loader is not None:
        weight_loader(param, tensor, *shard)
    else:
        param.data.copy_(tensor[:])


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's weights take in memory, as held: its state dict (parameters and
    persistent buffers: a GGUF layer's blocks), each storage counted once (a tied LM head shares
    the embedding's), and any packed copy a platform keeps beside a weight (`packed_weight`)."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.state_dict(keep_vars=True).values())
    tensors += [m.packed_weight for m in model.modules() if hasattr(m, "packed_weight")]
    for tensor in tensors:
        key = id(tensor) if tensor.is_mkldnn else tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total
