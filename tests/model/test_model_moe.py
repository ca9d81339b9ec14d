"""minivllm's Mixtral and Qwen3-MoE equal transformers', logit for logit, on random tiny models.

Each config is saved with `save_pretrained` (safetensors, the per-expert names of the real
checkpoints) and read back through the model's own `load_weights`, so the expert-name mapping
and the stacking into w13/w2 are checked by the same comparison. The MoE op runs its reference,
its CPU forward and its Triton kernel (in the interpreter) with the reference attention backend,
and the CPU platform's whole fast path runs once per family (every op's CPU kernel).
float32 throughout; the bound (1e-4 on logits of scale ~1) is the Llama tests' own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from minivllm.attention.selector import get_attention_backend
from minivllm.model.custom_op import CustomOp, dispatch_custom_ops
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.mixtral import MixtralConfig, MixtralForCausalLM
from minivllm.model.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from minivllm.model.weights import open_checkpoint
from minivllm.platforms import platform_for
from tests.utils.paged import paged_logits

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
)
FAMILIES: dict[str, tuple[Any, Any, Any, Any, dict[str, Any]]] = {
    "mixtral": (
        transformers.MixtralConfig, transformers.MixtralForCausalLM, MixtralConfig,
        MixtralForCausalLM, dict(intermediate_size=96, num_local_experts=4),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(intermediate_size=128, moe_intermediate_size=48, num_experts=4, head_dim=32,
             norm_topk_prob=True),
    ),
    # A dense first layer (mlp_only_layers) and routing weights left unnormalised.
    "qwen3_moe-dense0-unnormalised": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(intermediate_size=128, moe_intermediate_size=48, num_experts=4, head_dim=16,
             norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True),
    ),
}  # fmt: skip


def save_tiny(tmp: Path, family: str, backend: str = "reference") -> tuple[Any, LlamaForCausalLM]:
    """transformers' model saved to `tmp`, and ours built from the saved config and weights."""
    hf_config_cls, hf_cls, config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(0)
    hf = hf_cls(hf_config_cls(**(COMMON | overrides))).float().eval()
    with torch.no_grad():  # random init leaves norms at 1 and a zero router: perturb both
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp, safe_serialization=True)
    config = config_cls.from_hf_dict(json.loads((tmp / "config.json").read_text()))
    model = model_cls(config, get_attention_backend(backend)).float()
    with open_checkpoint(tmp) as weights:
        model.load_weights(weights)
    return hf, model.eval()


@pytest.mark.parametrize("moe_forward", ["native", "cpu", "cuda"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path: Path, family: str, moe_forward: str) -> None:
    if moe_forward == "cpu":
        import minivllm.cpu.moe  # noqa: F401  registers the forward
    if moe_forward == "cuda":
        pytest.importorskip("minivllm.model.layers.triton_fused_moe", exc_type=ImportError)
    hf, model = save_tiny(tmp_path, family)
    ops = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(ops) == (1 if "dense0" in family else 2)
    if moe_forward != "native":
        assert all(op.dispatch_forward(moe_forward) for op in ops)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = paged_logits(model, ids.tolist())
    diff = (got - expected).abs().max().item()
    print(f"{family} ({moe_forward}): max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_with_every_cpu_kernel(tmp_path: Path, family: str) -> None:
    """The CPU platform's whole fast path, as the loader dispatches it (`custom_ops="all"`, the
    CPU attention backend): QK-norm's rows through the fused RMSNorm, the MoE op on oneDNN."""
    hf, model = save_tiny(tmp_path, family, backend="cpu")
    dispatch_custom_ops(model, platform_for("cpu"), "all")
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {op.dispatched_to for op in ops} == {"cpu"}
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (paged_logits(model, ids.tolist()) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_greedy_tokens_match_transformers_generate(tmp_path: Path, family: str) -> None:
    hf, model = save_tiny(tmp_path, family)
    prompt = [5, 17, 99, 3, 42]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    tokens = list(prompt)
    for _ in range(8):
        tokens.append(int(paged_logits(model, tokens)[-1].argmax()))
    assert tokens[len(prompt) :] == expected
