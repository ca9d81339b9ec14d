"""On the CPU fast path every weight is held once (`prepack_linear`, minivllm/cpu/op_forwards.py).

A linear (or an untied LM head) whose weight oneDNN runs holds it packed in oneDNN's blocked
layout *in place of* the plain one, not beside it. So the model's memory is the checkpoint's,
counted over every tensor it references (parameters, buffers and any tensor attribute a platform
might hang on a module), each storage once, up to the padding of oneDNN's blocks; and what reads
the plain weight still gets it exactly: `forward_native` and `state_dict()`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from minivllm.attention.selector import get_attention_backend
from minivllm.model.custom_op import dispatch_custom_ops
from minivllm.model.layers.linear import LinearBase
from minivllm.model.loader import load_model
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.resolver import resolve_model
from minivllm.platforms.cpu import CpuPlatform
from tests.utils.engine_utils import save_tiny_llama

ONEDNN = torch.backends.mkldnn.is_available()
BLOCK = 64  # no oneDNN weight layout blocks a dimension by more than this


def load(path: Path, backend: str) -> LlamaForCausalLM:
    """The float32 model on the CPU fast path ("cpu": every custom op on its CPU forward) or the
    plain-PyTorch one ("reference")."""
    src = resolve_model(path)
    return load_model(src, get_attention_backend(backend), torch.float32, torch.device("cpu"))


def storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's memory starts and how many bytes it holds (an MKLDNN tensor has no
    storage to ask: oneDNN's own allocation)."""
    if t.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def held_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model references, each storage counted once."""
    held: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values()]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None:
                key, nbytes = storage_key_and_bytes(t)
                held[key] = nbytes
    return sum(held.values())


def padding_bound(model: nn.Module) -> int:
    """The most bytes oneDNN's blocks can add: each packed [N, K] padded to whole blocks."""
    pad = 0
    for p in model.parameters():
        if p.is_mkldnn:
            n, k = p.shape
            pad += (-(-n // BLOCK) * -(-k // BLOCK) * BLOCK * BLOCK - n * k) * p.element_size()
    return pad


def checkpoint_state(path: Path, tied: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under minivllm's names: q/k/v and gate/up fused as the loader
    fuses them, the tied head the embedding's table."""
    ckpt = load_file(path / "model.safetensors")
    state = {}
    for name, tensor in ckpt.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            parts = [name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            name, tensor = name.replace("q_proj", "qkv_proj"), torch.cat([ckpt[p] for p in parts])
        elif ".gate_proj." in name:
            parts = [name, name.replace("gate_proj", "up_proj")]
            name, tensor = (
                name.replace("gate_proj", "gate_up_proj"),
                torch.cat([ckpt[p] for p in parts]),
            )
        state[name] = tensor
    if tied:
        state["lm_head.weight"] = ckpt["model.embed_tokens.weight"]
    return state


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weights_once")
    return save_tiny_llama(out, num_hidden_layers=1, tie_word_embeddings=request.param)


def test_each_weight_is_held_once(tiny: Path) -> None:
    fast, plain = load(tiny, "cpu"), load(tiny, "reference")
    linears = [m for m in fast.modules() if isinstance(m, LinearBase)]
    tied = fast.config.tie_word_embeddings
    for op in linears:
        # The tied head is the embedding's table, whose lookup reads plain rows.
        packed = ONEDNN and not (op is fast.lm_head and tied)
        assert op.weight.is_mkldnn is packed, op
    assert (fast.lm_head.weight is fast.model.embed_tokens.weight) is tied
    plain_bytes = held_bytes(plain)
    assert plain_bytes <= held_bytes(fast) <= plain_bytes + padding_bound(fast)
    # What the reports count (minivllm/worker/worker_proc.py `rank_report`) is the same.
    assert sum(p.numel() * p.element_size() for p in fast.parameters()) == sum(
        p.numel() * p.element_size() for p in plain.parameters()
    )


def test_forward_native_and_the_state_dict_read_the_plain_weight(tiny: Path) -> None:
    fast = load(tiny, "cpu")
    expected = checkpoint_state(tiny, fast.config.tie_word_embeddings)
    state = fast.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert not tensor.is_mkldnn and torch.equal(tensor, expected[name]), name
    for name, op in fast.named_modules():
        if isinstance(op, LinearBase):
            weight = expected[f"{name}.weight"]  # [out, in]
            x = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                native = op.forward_native(x)
                got = op(x)  # oneDNN on the packed weight, or the CPU's plain-weight GEMMs
            assert getattr(op, "bias", None) is None  # the tiny Llama has no biases
            assert torch.equal(native, F.linear(x, weight)), name
            torch.testing.assert_close(got, native, rtol=1e-5, atol=1e-5)


def test_dispatching_again_keeps_the_one_packed_weight(tiny: Path) -> None:
    """Back to `forward_native` and to the CPU once more: nothing is packed twice or unpacked."""
    fast = load(tiny, "cpu")
    before = [p for p in fast.parameters()]
    held = held_bytes(fast)
    platform = CpuPlatform()
    dispatch_custom_ops(fast, platform, "none")
    dispatch_custom_ops(fast, platform, "all")
    assert all(a is b for a, b in zip(before, fast.parameters(), strict=True))
    assert held_bytes(fast) == held
