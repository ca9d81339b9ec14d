"""minivllm's Llama equals transformers' LlamaForCausalLM, logit for logit, on random tiny models.

Each config is saved with `save_pretrained` (safetensors) and read back through minivllm's own
loader, so the loader's name mapping and q/k/v fusion are checked by the same comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from minivllm.attention.selector import get_attention_backend
from minivllm.model.custom_op import CustomOp
from minivllm.model.loader import load_model
from minivllm.model.resolver import resolve_model
from tests.utils.paged import paged_logits

BASE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
# name -> overrides of BASE; together they cover MHA/GQA/MQA, both head dims, tied and untied
# embeddings, several rope_theta values, linear and llama3 rope scaling, biases, TinyLlama's shape.
CONFIGS = {
    "mha-hd32": dict(),
    "gqa2-hd32-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-hd64": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2),
    "mqa-hd64-theta5e5": dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0
    ),
    "gqa2-llama3-rope": dict(
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mha-linear-rope-bias": dict(
        rope_scaling=dict(rope_type="linear", factor=2.0), attention_bias=True, mlp_bias=True
    ),
    # TinyLlama-1.1B scaled down: 32 heads : 4 KV heads (8:1), head_dim 64, vocab 32000.
    "tinyllama-shape": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=1,
        rope_theta=10000.0,
    ),
}


def all_custom_ops_use_cpu_kernels(model: torch.nn.Module) -> bool | None:
    """True if every custom op runs its CPU forward, False if none does, else None."""
    flags = {m.dispatched_to == "cpu" for m in model.modules() if isinstance(m, CustomOp)}
    return flags.pop() if len(flags) == 1 else None


def save_tiny_llama(tmp: Path, overrides: dict, seed: int = 0) -> tuple[HFLlama, Path]:
    torch.manual_seed(seed)
    hf = HFLlama(HFLlamaConfig(**(BASE | overrides))).float().eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so those paths are checked too.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp, safe_serialization=True)
    return hf, tmp


# "reference" is plain PyTorch throughout; "cpu" runs the compiled CPU library: paged decode
# attention, the fused RMSNorm / SiLU-mul / RoPE kernels and the oneDNN-prepacked linears.
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path: Path, name: str, backend: str) -> None:
    hf, path = save_tiny_llama(tmp_path, CONFIGS[name])
    model = load_model(
        resolve_model(path), get_attention_backend(backend), torch.float32, torch.device("cpu")
    )
    assert all_custom_ops_use_cpu_kernels(model) is (backend == "cpu")
    rope = (CONFIGS[name].get("rope_scaling") or {}).get("rope_type")
    assert (model.config.rope_scaling or {}).get("rope_type") == rope  # the scaling was read
    ids = torch.randint(0, hf.config.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = paged_logits(model, ids.tolist())
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4


def test_chunked_prefill_gives_the_same_logits_as_one_pass(tmp_path: Path) -> None:
    """Computing a prompt in chunks over its own cached K/V must change nothing."""
    _, path = save_tiny_llama(tmp_path, CONFIGS["gqa2-hd32-tied"])
    model = load_model(
        resolve_model(path), get_attention_backend("reference"), torch.float32, torch.device("cpu")
    )
    ids = list(range(3, 83))
    whole = paged_logits(model, ids)
    chunked = paged_logits(model, ids, chunk_sizes=[15, 1, 17, 30, 1, 16])
    assert (whole - chunked).abs().max().item() <= 1e-5


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = HFLlama(HFLlamaConfig(**BASE)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(
        resolve_model(tmp_path),
        get_attention_backend("reference"),
        torch.float32,
        torch.device("cpu"),
    )
    ids = list(range(40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    assert (paged_logits(model, ids) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_bfloat16_model_tracks_float32(tmp_path: Path, backend_name: str) -> None:
    """An explicit dtype is honoured, and a low-precision model stays close to float32."""
    _, path = save_tiny_llama(tmp_path, CONFIGS["mha-hd32"])
    backend = get_attention_backend(backend_name)
    src = resolve_model(path)
    m32 = load_model(src, backend, torch.float32, torch.device("cpu"))
    m16 = load_model(src, backend, torch.bfloat16, torch.device("cpu"))
    assert next(m16.parameters()).dtype == torch.bfloat16
    ids = list(range(5, 45))
    a, b = paged_logits(m32, ids), paged_logits(m16, ids)
    assert (a - b).abs().max().item() < 0.1


def test_cpu_fast_path_prepacks_the_lm_head_and_keeps_its_logits(tmp_path: Path) -> None:
    """The CPU backend's (untied) LM head runs on its weight prepacked for oneDNN: the same
    logits as the plain sliced matmul up to summation order."""
    _, path = save_tiny_llama(tmp_path, CONFIGS["tinyllama-shape"])
    src = resolve_model(path)
    fast = load_model(src, get_attention_backend("cpu"), torch.float32, torch.device("cpu"))
    plain = load_model(src, get_attention_backend("reference"), torch.float32, torch.device("cpu"))
    assert fast.lm_head.weight.is_mkldnn and not plain.lm_head.weight.is_mkldnn
    for rows in (1, 7, 64, 130):  # the packing is planned for 64 rows; any count must work
        hidden = torch.randn(rows, fast.config.hidden_size)
        with torch.no_grad():
            a, b = fast.compute_logits(hidden), plain.compute_logits(hidden)
        assert a is not None and b is not None and a.shape == (rows, fast.config.vocab_size)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
