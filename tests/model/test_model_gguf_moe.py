"""Mixtral and Qwen3-MoE as llama.cpp GGUF files give transformers' tokens, experts on their blocks.

Each file is a random tiny transformers model (router and norms perturbed, so that routing and
norms matter) written as llama.cpp's converter writes it (`llama_cpp_convert.convert`): Mixtral
as architecture `llama` with `llama.expert_count`, q/k rows permuted, each layer's experts
stacked per weight (`ffn_gate_exps` [E, I, H], ...), or, as older files have them, one tensor per
expert (`ffn_gate.E`); Qwen3-MoE as `qwen3moe` with `expert_feed_forward_length`, q/k norms and a
dense first layer (no router tensor: Qwen3-MoE's `mlp_only_layers`).

An F32 file gives transformers' greedy tokens exactly, dequantized at load and on the native
path. A quantized file keeps its experts in their blocks (gate and up as one part where they
share a type, two where not), gives the dequantized model's logits bit for bit on the reference
path (each routed expert dequantized, then multiplied), runs the CPU's forward (each expert's
rows through `gguf_linear`), within float32 rounding of the reference with float32 products and,
with the default products, as close to the dequantized model as vLLM judges; the CUDA forward runs
the reference for them. Experts whose types
differ (possible in per-expert files only) are dequantized at load, with a log line naming them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from minivllm.attention.selector import get_attention_backend
from minivllm.llm import LLM
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.loader import load_model
from minivllm.model.quantization.gguf.blocks import Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from minivllm.model.quantization.gguf.config import hf_config
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams
from tests.engine.test_bf16_cpu import check_logprobs_close
from tests.model.test_model_families import SHAPE, greedy, prompts_and_oracle
from tests.utils.llama_cpp_convert import convert, qtypes_by_layer, use_own_cache
from tests.utils.paged import paged_logits

# family -> (llama.cpp architecture, transformers' config and model classes, overrides of SHAPE)
FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "mixtral": (
        "llama", "MixtralConfig", "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen3moe": (
        "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
             norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True,
             num_hidden_layers=3),
    ),
}  # fmt: skip
CASES = ["mixtral", "mixtral-per-expert", "qwen3moe"]
# Quantized models: every row whole K-quant blocks, and weights of a trained model's size.
BIG = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64,
    initializer_range=0.06,
)  # fmt: skip
# By tensor kind, layer i taking entry i % 2: layer 0's gate and up share a type (one part),
# layer 1's do not (two parts); Qwen3-MoE's dense layer 0 takes the ffn_* types.
TYPES = {
    "attn_q": (Q4_K, Q8_0),
    "attn_k": (Q4_K, Q8_0),
    "attn_v": (Q6_K, Q5_1),
    "attn_output": (Q8_0, Q5_K),
    "ffn_gate": (Q4_0,),
    "ffn_up": (Q4_0,),
    "ffn_down": (Q8_0,),
    "ffn_gate_exps": (Q4_0, Q4_K),
    "ffn_up_exps": (Q4_0, Q8_0),
    "ffn_down_exps": (Q6_K, Q5_0),
    "token_embd": (Q8_0,),
    "output": (Q6_K,),
}


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_own_cache(tmp_path, monkeypatch)


def moe_file(tmp: Path, case: str, qtype_of: Any = None, **extra: Any) -> tuple[Any, Path]:
    """The case's random tiny model (in transformers) and its GGUF file."""
    family = case.removesuffix("-per-expert")
    arch, config_name, model_name, overrides = FAMILIES[family]
    keys = SHAPE | overrides | extra
    if family == "mixtral":
        keys.pop("moe_intermediate_size", None)
    config = getattr(transformers, config_name)(**keys)
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():  # random init leaves norms at 1 and the router at 0
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp / "hf", safe_serialization=True)
    per_expert = case.endswith("per-expert")
    path = convert(config, tmp / "hf", tmp / f"{case}.gguf", arch, qtype_of, per_expert)
    return hf, path


def experts(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("case", CASES)
def test_a_moe_gguf_file_gives_transformers_greedy_tokens(
    tmp_path: Path, own_cache: None, case: str, quantization: str
) -> None:
    hf, path = moe_file(tmp_path, case)
    prompts, max_tokens, expected = prompts_and_oracle(hf, count=3)
    llm = LLM(
        model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01,
        quantization=quantization, max_model_len=256,
    )  # fmt: skip
    model = llm.llm_engine.runner.model
    assert type(model).__name__ == FAMILIES[case.removesuffix("-per-expert")][2]
    assert len(experts(model)) == 2  # qwen3moe: 3 layers, the first dense
    assert greedy(llm, prompts, max_tokens) == expected


def load(path: Path, quantization: str, backend: str = "reference") -> torch.nn.Module:
    return load_model(
        resolve_model(path), get_attention_backend(backend), torch.float32, torch.device("cpu"),
        quantization=quantization,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_quantized_moe_file_runs_its_experts_on_their_blocks(
    tmp_path: Path, own_cache: None, case: str
) -> None:
    _, path = moe_file(tmp_path, case, qtypes_by_layer(TYPES), **BIG)
    native, plain = load(path, "gguf"), load(path, "none")
    for layer, mlp in enumerate(native.model.layers):
        if isinstance(op := getattr(mlp.mlp, "experts", None), FusedMoE):
            parts = ((Q4_0,), (Q6_K,)) if layer % 2 == 0 else ((Q4_K, Q8_0), (Q5_0,))  # TYPES
            assert (op.w13_qtypes, op.w2_qtypes) == parts
            assert op.w13_qweight_0.dtype == op.w2_qweight_0.dtype == torch.uint8
    assert not [n for n, _ in native.named_parameters() if "experts" in n]
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got, expected = (paged_logits(m, ids, [17, 1, 22]) for m in (native, plain))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same math, dequantized later
    prompts = [{"prompt_token_ids": ids[:n]} for n in (5, 14, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(
            model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01,
            quantization=quantization, max_model_len=256,
        )  # fmt: skip
        model = llm.llm_engine.runner.model
        assert {op.dispatched_to for op in experts(model)} == {"cpu"}
        outs[quantization] = [
            (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or []))
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    check_logprobs_close(outs["gguf"], outs["none"], "gguf blocks", "dequantized")


def test_the_cpu_forward_of_quantized_experts_is_the_reference_s(
    tmp_path: Path, own_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With float32 products, each expert's rows through gguf_linear give the reference's
    result (dequantize the expert, then multiply) to float32 rounding: parts, routing and the
    weighted sum included."""
    import minivllm.cpu.moe as cpu_moe

    monkeypatch.setattr(cpu_moe, "gguf_dot", lambda qtype: "float32")
    _, path = moe_file(tmp_path, "mixtral", qtypes_by_layer(TYPES), **BIG)
    gen = torch.Generator().manual_seed(4)
    for op in experts(load(path, "gguf")):
        hidden = torch.randn(37, 256, generator=gen)  # [T, H]
        router_logits = torch.randn(37, op.num_experts, generator=gen)  # [T, E]
        expected = op.forward_native(hidden, router_logits)
        assert op.dispatch_forward("cpu") and op.packed_experts is None
        got = op(hidden, router_logits)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


def test_the_cuda_forward_of_quantized_experts_is_the_reference(
    tmp_path: Path, own_cache: None
) -> None:
    """No Triton kernel multiplies expert blocks: the CUDA platform's forward of the op runs the
    reference for them (here on CPU tensors, as the Triton tests run in the interpreter)."""
    pytest.importorskip("minivllm.model.layers.triton_fused_moe", exc_type=ImportError)
    _, path = moe_file(tmp_path, "mixtral", qtypes_by_layer(TYPES), **BIG)
    gen = torch.Generator().manual_seed(5)
    for op in experts(load(path, "gguf")):
        hidden, router_logits = torch.randn(9, 256, generator=gen), torch.randn(9, 4, generator=gen)
        expected = op.forward_native(hidden, router_logits)
        assert op.dispatch_forward("cuda")
        torch.testing.assert_close(op(hidden, router_logits), expected, rtol=0, atol=0)


def test_experts_of_several_types_are_dequantized_at_load_and_named(
    tmp_path: Path, own_cache: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A per-expert file may give one expert's gate another type: that layer's experts are
    dequantized at load (logged with the layer's name), the others keep their blocks."""
    mixed = qtypes_by_layer(TYPES)

    def qtype_of(name: str) -> int:
        return Q8_0 if name == "blk.0.ffn_gate.2.weight" else mixed(name)

    _, path = moe_file(tmp_path, "mixtral-per-expert", qtype_of, **BIG)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        native = load(path, "gguf")
    assert "model.layers.0.mlp.experts: the experts are dequantized at load" in caplog.text
    assert "Q8_0" in caplog.text
    first, second = experts(native)
    assert first.quant_method is None and first.w13_weight.dtype == torch.float32
    assert second.quant_method is not None
    ids = list(range(3, 40))
    torch.testing.assert_close(
        paged_logits(native, ids), paged_logits(load(path, "none"), ids), rtol=0, atol=0
    )


def test_qwen3moe_metadata_reads_as_llama_cpp_does() -> None:
    """Experts `expert_feed_forward_length` wide (else feed_forward_length / experts used), the
    top-k weights always renormalised, and a layer without a router a dense one."""
    keys = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96,
            "attention.head_count": 4, "expert_count": 8, "expert_used_count": 2,
            "vocab_size": 256}  # fmt: skip
    fields = {"general.architecture": "qwen3moe"} | {f"qwen3moe.{k}": v for k, v in keys.items()}
    routers = {"blk.1.ffn_gate_inp.weight", "blk.2.ffn_gate_inp.weight"}
    cfg = hf_config(fields, routers)
    assert (cfg["moe_intermediate_size"], cfg["intermediate_size"]) == (48, 96)
    assert cfg["norm_topk_prob"] and cfg["mlp_only_layers"] == [0]
    assert (
        hf_config(fields | {"qwen3moe.expert_feed_forward_length": 32}, routers)[
            "moe_intermediate_size"
        ]
        == 32
    )
