"""Reading a checkpoint's tensors into a model, slice by slice.

HuggingFace Llama checkpoints store q/k/v and gate/up as separate tensors; minivllm's layers
fuse them, and under tensor parallelism each rank holds only a slice of each (paper §4.6). So the
loader never builds a state dict: it opens the safetensors files lazily (`safe_open(...)`, one
`get_slice` per tensor), checks every name and shape against the config, and hands each tensor to
the weight loader of the layer that holds it (minivllm/model/layers/linear.py), which reads
just this rank's rows or columns. No rank ever holds the whole model, not even while loading.
See "Distributed execution" (docs/distributed.md) and the architecture page
(docs/architecture.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from minivllm.model.config import LlamaConfig
from minivllm.model.errors import CorruptCheckpointError, ModelNotFoundError
from minivllm.model.layers.linear import Sliceable
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.packed_weights import unpack_checkpoint
from minivllm.model.pipeline import stage_target

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


def checkpoint_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HuggingFace Llama checkpoint must hold for `config`, with its full shape."""
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        linears = {
            "self_attn.q_proj": (q, h, config.attention_bias or config.qkv_bias),
            "self_attn.k_proj": (kv, h, config.attention_bias or config.qkv_bias),
            "self_attn.v_proj": (kv, h, config.attention_bias or config.qkv_bias),
            "self_attn.o_proj": (h, q, config.attention_bias),
            "mlp.gate_proj": (i, h, config.mlp_bias),
            "mlp.up_proj": (i, h, config.mlp_bias),
            "mlp.down_proj": (h, i, config.mlp_bias),
        }
        for name, (rows, cols, bias) in linears.items():
            shapes[f"{p}{name}.weight"] = (rows, cols)
            if bias:
                shapes[f"{p}{name}.bias"] = (rows,)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
        if config.qk_norm:  # Qwen3: one weight over a head's dimensions, for q and one for k
            shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (d,)
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
    config: LlamaConfig, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The tensors the model needs, after checking that the checkpoint (name -> shape) holds
    exactly those, each of the shape the config implies."""
    expected = checkpoint_shapes(config)
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


def load_weights(model: LlamaForCausalLM, weights: Mapping[str, Sliceable]) -> None:
    """Check the checkpoint's names and shapes against the config, then hand each tensor to the
    weight loader of the layer that holds it (`parallel_layers.py`), which copies this rank's
    slice. Replicated parameters (the norms) are copied whole. A family with experts loads its
    own, and so does a causal LM served as a classifier (models/adapters.py)."""
    if hasattr(model, "load_weights"):
        return model.load_weights(weights)  # type: ignore[operator]
    load_llama_weights(model, weights)


def load_llama_weights(model: LlamaForCausalLM, weights: Mapping[str, Sliceable]) -> None:
    """`load_weights` for a Llama-layout checkpoint (every family but those that load their own)."""
    from safetensors import SafetensorError

    if "embed_tokens.weight" in weights:  # a bare decoder's (`Qwen3Model`): no "model." prefix
        weights = {f"model.{name}": tensor for name, tensor in weights.items()}
    if model.packed_checkpoint:  # q/k/v and gate/up stored fused (Phi-3): seen as the parts
        weights = unpack_checkpoint(weights, model.config)
    expected = check_checkpoint(model.config, {k: _shape(v) for k, v in weights.items()})
    for name in expected:
        fused, shard = target_of(name)
        target = stage_target(model, fused)
        if target is None:  # another pipeline stage holds it
            continue
        module_name, _, param_name = target.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, param_name)
        weight_loader = getattr(module, "weight_loader", None)  # None: replicated (the norms)
        try:
            if weight_loader is not None:
                weight_loader(param, weights[name], *shard)
            else:
                param.data.copy_(weights[name][:])
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpointError(
                f"cannot read {name} (truncated or corrupt?): {exc}"
            ) from exc


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
