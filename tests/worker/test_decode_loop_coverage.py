"""The C++ decode loop runs only what it declares it covers (`not_covered`,
minivllm/worker/cpu_decode_loop.py), and a layer feature it does not cover can never change the answer:
each kind of undeclared feature is planted on a tiny random Llama that the loop covers, the check
names the module and the feature, the runner's rule then takes the Python loop, and the decode
step equals the Python loop's with the feature, which differs from the step without it.

What the C++ loop computes where it does run is held to the Python loop bit for bit by
tests/worker/test_kernels_cpu_decode_loop.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.selector import get_attention_backend
from minivllm.cpu.ops import skinny_gemm_fast
from minivllm.llm import LLM
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.loader import load_model
from minivllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cpu_decode_coverage import not_covered
from minivllm.worker.cpu_decode_loop import CpuDecodeLoop
from tests.model.test_model_llama import CONFIGS, save_tiny_llama
from tests.worker.test_kernels_cpu_decode_loop import load, prefilled, step_meta

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() or skinny_gemm_fast()),
    reason="the C++ loop runs float32 linears prepacked for oneDNN or on the AVX-512 skinny GEMM",
)

PROMPT_LENS = [5, 16, 17, 40]


# ---------------------------------------------------------------------------------- features
class HalvedMlpLayer(LlamaDecoderLayer):
    """A family's layer that scales its MLP's output."""

    def forward(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        hidden, residual = super().forward(*args)  # type: ignore[arg-type]
        return hidden * 0.5, residual


class ShiftedAttention(LlamaAttention):
    """An attention whose output is shifted: Qwen3's q/k norms stand for any such change."""

    def forward(self, *args: object) -> torch.Tensor:  # type: ignore[override]
        return super().forward(*args) + 0.25  # type: ignore[arg-type]


class LoRA(nn.Module):
    """A low-rank adapter: x Aᵀ Bᵀ, the delta LoRA adds to a linear's output."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, generator=gen) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(F.linear(x, self.lora_a), self.lora_b)


class LinearWithLoRA(nn.Module):
    """vLLM's shape of a LoRA layer (`BaseLayerWithLoRA`): the linear wrapped, in its place."""

    def __init__(self, base_layer: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora = LoRA(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora(x)


class ResidualLayerNorm(nn.Module):
    """Another norm with RMSNorm's interface (LayerNorm, as some families use)."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)
        return out if residual is None else (out, residual)


class ScaledLlama(LlamaForCausalLM):
    """A model class of its own: a subclass may change what its body returns."""

    def forward(self, *args: object) -> torch.Tensor:  # type: ignore[override]
        return super().forward(*args) * 2.0  # type: ignore[arg-type]


def qkv_sizes(model: LlamaForCausalLM, i: int) -> tuple[int, int]:
    attn = model.model.layers[i].self_attn
    return model.config.hidden_size, attn.q_size + 2 * attn.kv_size


def wrap_qkv_in_lora(model: LlamaForCausalLM) -> None:
    attn = model.model.layers[0].self_attn
    attn.qkv_proj = LinearWithLoRA(attn.qkv_proj, *qkv_sizes(model, 0))


def lora_beside_qkv(model: LlamaForCausalLM) -> None:
    """The adapter as a child of the linear, its output added by the op's forward."""
    op = model.model.layers[0].self_attn.qkv_proj
    op.lora = LoRA(*qkv_sizes(model, 0))
    cpu_forward = op._forward_method
    op._forward_method = lambda x: cpu_forward(x) + op.lora(x)


def bias_on_o_proj(model: LlamaForCausalLM) -> None:
    op = model.model.layers[1].self_attn.o_proj
    op.bias = nn.Parameter(torch.full((model.config.hidden_size,), 0.5))


def plain_bias_on_down_proj(model: LlamaForCausalLM) -> None:
    """A tensor set as a plain attribute, not registered: the CPU forward still adds `op.bias`."""
    model.model.layers[1].mlp.down_proj.bias = torch.full((model.config.hidden_size,), 0.5)


def forward_on_the_instance(model: LlamaForCausalLM) -> None:
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: LlamaMLP.forward(mlp, x) * 0.5  # type: ignore[method-assign]


def subclass_layer(model: LlamaForCausalLM) -> None:
    model.model.layers[1].__class__ = HalvedMlpLayer


def subclass_attention(model: LlamaForCausalLM) -> None:
    model.model.layers[0].self_attn.__class__ = ShiftedAttention


def another_norm(model: LlamaForCausalLM) -> None:
    layer = model.model.layers[0]
    layer.post_attention_layernorm = ResidualLayerNorm(layer.post_attention_layernorm)


def subclass_model(model: LlamaForCausalLM) -> None:
    model.__class__ = ScaledLlama


def halve_one_layer_s_scale(model: LlamaForCausalLM) -> None:
    model.model.layers[1].self_attn.scale *= 0.5


# Each feature, and how the check's reason starts: every one changes the step's answer.
FEATURES: dict[str, tuple[Callable[[LlamaForCausalLM], None], str]] = {
    "layer-subclass": (subclass_layer, "model.layers.1 is HalvedMlpLayer, not LlamaDecoderLayer"),
    "attention-subclass": (
        subclass_attention,
        "model.layers.0.self_attn is ShiftedAttention, not LlamaAttention",
    ),
    "lora-wrapper": (
        wrap_qkv_in_lora,
        "model.layers.0.self_attn.qkv_proj is LinearWithLoRA, not QKVParallelLinear",
    ),
    "lora-beside-the-linear": (
        lora_beside_qkv,
        "model.layers.0.self_attn.qkv_proj runs lora_beside_qkv.<locals>.<lambda>",
    ),
    "bias": (bias_on_o_proj, "model.layers.1.self_attn.o_proj.bias is a tensor"),
    "plain-tensor-bias": (plain_bias_on_down_proj, "model.layers.1.mlp.down_proj.bias is a tensor"),
    "instance-forward": (forward_on_the_instance, "model.layers.1.mlp.forward is replaced"),
    "another-norm": (
        another_norm,
        "model.layers.0.post_attention_layernorm is ResidualLayerNorm, not RMSNorm",
    ),
    "model-subclass": (subclass_model, "the model is ScaledLlama"),
    "one-layer-s-scale": (halve_one_layer_s_scale, "model.layers.1.self_attn.scale differs"),
}


# ---------------------------------------------------------------------------------- the step
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = save_tiny_llama(tmp_path_factory.mktemp("llama"), CONFIGS["gqa2-hd32-tied"])
    return path


def runner_step(
    model: LlamaForCausalLM,
    loop: CpuDecodeLoop | None,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv: torch.Tensor,
    meta: object,
) -> torch.Tensor:
    """What the model runner computes for a step (`ModelRunner.run_model`)."""
    with torch.inference_mode():
        if loop is not None and loop.applies(tokens.shape[0], meta):  # type: ignore[arg-type]
            return loop(tokens, positions, kv, meta)  # type: ignore[arg-type]
        return model(tokens, positions, kv, meta)  # type: ignore[arg-type]


@pytest.mark.parametrize("feature", FEATURES)
def test_a_decode_step_with_an_undeclared_feature_equals_the_python_loop_s(
    checkpoint: Path, feature: str
) -> None:
    plant, reason = FEATURES[feature]
    model = load(checkpoint)
    backend = model.model.layers[0].self_attn.backend
    kv, tables = prefilled(model, PROMPT_LENS)
    meta = step_meta(model, [1] * len(PROMPT_LENS), [n + 1 for n in PROMPT_LENS], tables)
    tokens = torch.tensor([11, 12, 13, 14])
    positions = torch.tensor(PROMPT_LENS)
    # Without the feature the model is covered, and the step runs the C++ loop.
    assert not_covered(model, backend) is None
    loop = CpuDecodeLoop.build(model, backend)
    assert loop is not None and loop.applies(len(PROMPT_LENS), meta)
    without = runner_step(model, loop, tokens, positions, kv.clone(), meta)

    plant(model)
    found = not_covered(model, backend)
    assert found is not None and found.startswith(reason), found
    loop = CpuDecodeLoop.build(model, backend)
    assert loop is None
    got = runner_step(model, loop, tokens, positions, kv.clone(), meta)
    with torch.inference_mode():
        expected = model(tokens, positions, kv.clone(), meta)  # the Python loop, feature and all
        assert torch.equal(got, expected)
        assert not torch.equal(expected, without)  # the feature changes the answer
        logits = model.compute_logits(got)
        assert logits is not None
        assert torch.equal(logits.argmax(-1), model.compute_logits(expected).argmax(-1))


# ------------------------------------------------------------------------- features that add only
def adapter_child(model: LlamaForCausalLM) -> None:
    model.model.layers[0].self_attn.qkv_proj.lora = LoRA(*qkv_sizes(model, 0))


def adapter_parameters(model: LlamaForCausalLM) -> None:
    op = model.model.layers[1].mlp.gate_up_proj
    op.lora_a = nn.Parameter(torch.zeros(4, model.config.hidden_size))


def native_activation(model: LlamaForCausalLM) -> None:
    model.model.layers[0].mlp.act_fn.dispatch_forward(None)  # its forward_native, not the kernel


def window(model: LlamaForCausalLM) -> None:
    model.model.layers[1].self_attn.sliding_window = 8


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (
            adapter_child,
            "model.layers.0.self_attn.qkv_proj.lora (LoRA) is a module the C++ loop does not know",
        ),
        (adapter_parameters, "model.layers.1.mlp.gate_up_proj.lora_a is a tensor"),
        (native_activation, "model.layers.0.mlp.act_fn runs SiluAndMul.forward_native"),
        (window, "model.layers.1.self_attn has a sliding window"),
    ],
    ids=["adapter-child", "adapter-parameters", "native-activation", "sliding-window"],
)
def test_what_the_declaration_does_not_list_falls_back_even_before_it_changes_the_answer(
    checkpoint: Path, plant: Callable[[LlamaForCausalLM], None], reason: str
) -> None:
    """A LoRA adapter attached, not yet applied; an op on another forward: each is refused by
    name, since the next change to its forward would not be seen by the C++ loop."""
    model = load(checkpoint)
    backend = model.model.layers[0].self_attn.backend
    plant(model)
    found = not_covered(model, backend)
    assert found is not None and found.startswith(reason), found
    assert CpuDecodeLoop.build(model, backend) is None


def test_the_runner_logs_why_once_and_generates_what_the_python_loop_does(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An adapter wrapped around a linear after load: the runner, rebuilding its loop, keeps the
    Python loop and says why, once, at debug level."""
    llm = LLM(str(checkpoint), skip_tokenizer_init=True)
    runner = llm.llm_engine.runner
    assert isinstance(runner.decode_loop, CpuDecodeLoop)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (7, 20)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    wrap_qkv_in_lora(runner.model)
    with caplog.at_level(logging.DEBUG, logger="minivllm"):
        runner.build_decode_loop()
    assert runner.decode_loop is None
    said = [r.getMessage() for r in caplog.records if "Python loop" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0.self_attn.qkv_proj is LinearWithLoRA" in said[0]
    assert said[0].startswith("decode steps run the Python loop")
    with_lora = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert with_lora != before  # the adapter changes the tokens: the C++ loop would not have


def test_a_gguf_step_of_the_opt_in_gemm_s_rows_runs_the_python_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From MINIVLLM_CPU_GGUF_GEMM_ROWS rows a GGUF linear's CPU forward dequantizes and runs one
    GEMM, which the C++ loop (always the tiles) does not: such a step keeps the Python loop."""
    from minivllm.worker import cpu_decode_loop as decode_loop
    from tests.utils.gguf_utils import tiny_llama_gguf

    monkeypatch.setattr(decode_loop, "gguf_gemm_rows", lambda: 4)
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    model = load_model(
        resolve_model(path), get_attention_backend("cpu"), torch.float32, torch.device("cpu"),
        quantization="gguf",
    )  # fmt: skip
    loop = CpuDecodeLoop.build(model, model.model.layers[0].self_attn.backend)
    assert loop is not None
    tables = torch.arange(5 * 2, dtype=torch.int32).view(5, 2)
    assert loop.applies(3, step_meta(model, [1] * 3, [9, 20, 31], tables[:3]))
    assert not loop.applies(5, step_meta(model, [1] * 5, [9, 20, 31, 2, 5], tables))
