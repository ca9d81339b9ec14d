"""The platform seam (minivllm/platforms/): each device-dependent choice, made in one place.

No model is loaded and nothing is compiled here: these are the rules themselves. That the CPU
platform's choices really run (its kernels on the default path, none on the reference path) is
checked end to end in tests/engine/test_engine_greedy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import minivllm.platforms as platforms
from minivllm.distributed.parallel_state import SINGLE_DEVICE
from minivllm.model.custom_op import (
    CustomOp,
    dispatch_custom_ops,
    platform_forward,
    register_forward,
)
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear
from minivllm.platforms import platform_for
from minivllm.platforms.cpu import CpuPlatform
from minivllm.platforms.cuda import CudaPlatform


def test_each_kind_of_device_has_one_platform_object() -> None:
    assert isinstance(platform_for(torch.device("cpu")), CpuPlatform)
    assert isinstance(platform_for("cuda:1"), CudaPlatform)  # made without touching CUDA
    assert platform_for("cpu") is platform_for(torch.device("cpu"))
    expected = CudaPlatform if torch.cuda.is_available() else CpuPlatform
    assert isinstance(platforms.current_platform, expected)


def test_the_cpu_platform_s_defaults() -> None:
    cpu = CpuPlatform()
    assert cpu.default_attention_backend == "cpu" and cpu.default_dtype() == torch.float32
    assert cpu.kv_cache_budget_bytes(torch.device("cpu"), 0.9, 0.5) == 0.5 * 2**30
    assert cpu.dist_backend == "gloo" and CudaPlatform().dist_backend == "nccl"
    assert CudaPlatform().default_attention_backend == "triton"


@pytest.mark.parametrize(
    ("custom_ops", "backend", "resolved"),
    [
        ("auto", "cpu", "all"),  # the compiled backend: its library's fused ops too
        ("auto", "reference", "none"),  # the specification stays plain PyTorch
        ("auto", "triton", "none"),  # the Triton interpreter of the tests
        ("none", "cpu", "none"),
        ("all", "reference", "all"),  # asked for by name: honoured
    ],
)
def test_custom_ops_auto_is_settled_by_the_platform(
    custom_ops: str, backend: str, resolved: str
) -> None:
    assert CpuPlatform().resolve_custom_ops(custom_ops, backend) == resolved


def test_the_reference_backend_means_no_custom_op_on_any_platform() -> None:
    assert CudaPlatform().resolve_custom_ops("auto", "reference") == "none"
    assert CudaPlatform().resolve_custom_ops("auto", "triton") == "all"


def test_a_bad_custom_ops_value_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"custom_ops must be one of \('auto', 'all', 'none'\)"):
        CpuPlatform().resolve_custom_ops("some", "cpu")


def test_a_backend_the_device_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match='attention_backend "cpu" needs device "cpu"'):
        CudaPlatform().check_attention_backend("cpu")
    CpuPlatform().check_attention_backend("triton")  # the interpreter runs on a CPU


def test_an_op_runs_forward_native_until_a_platform_forward_is_dispatched() -> None:
    """`dispatch_forward` chooses once; a subclass inherits its base's registered forward; an
    op without one for the device stays on its specification."""
    norm = RMSNorm(8, 1e-5)
    assert norm.dispatched_to == "native"
    calls: list[str] = []

    class Doubling(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    @register_forward(Doubling, "test-device")
    def doubling_forward(op: Doubling, x: torch.Tensor) -> torch.Tensor:
        calls.append("platform")
        return x + x

    op = Doubling()
    x = torch.ones(3)
    assert torch.equal(op(x), 2 * x) and calls == []
    assert op.dispatch_forward("test-device") and op.dispatched_to == "test-device"
    assert torch.equal(op(x), 2 * x) and calls == ["platform"]
    assert not op.dispatch_forward(None) and op.dispatched_to == "native"
    assert not op.dispatch_forward("another-device")
    # QKVParallelLinear has no registration of its own: it takes ColumnParallelLinear's.
    CpuPlatform().register_op_forwards()
    assert platform_forward(QKVParallelLinear, "cpu") is platform_forward(
        ColumnParallelLinear, "cpu"
    )
    assert platform_forward(QKVParallelLinear, "cpu") is not None
    qkv = QKVParallelLinear(16, 4, 2, 1, False, SINGLE_DEVICE)
    assert dispatch_custom_ops(qkv, CpuPlatform(), "none") == 0 and qkv.dispatched_to == "native"


def test_the_platform_chooses_how_a_random_row_is_sampled() -> None:
    """A CPU draws one uniform per row (B x V exponentials would cost more than the LM head); a
    GPU races exponentials, which needs no host sync. The sampler asks, it does not branch."""
    from minivllm.platforms.cpu import CpuPlatform
    from minivllm.platforms.cuda import CudaPlatform

    assert CpuPlatform.sampling_method == "multinomial"
    assert CudaPlatform.sampling_method == "exponential"
    source = (
        Path(__file__).resolve().parents[2] / "minivllm" / "sample" / "sampler.py"
    ).read_text()
    assert ".is_cuda" not in source and "device.type" not in source


def test_bfloat16_asked_for_on_a_cpu_without_bf16_instructions_is_said_to_be_emulated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """float32 stays the CPU's default; a user's bfloat16 on a CPU with neither AVX512-BF16 nor
    AMX (an AVX2 machine) is taken, with one line saying it is emulated and slower there."""
    import logging

    from minivllm.model.resolver import resolve_dtype

    cpu = torch.device("cpu")
    for has_bf16 in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda has=has_bf16: has)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda has=has_bf16: has)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minivllm"):
            assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
            assert resolve_dtype("auto", cpu) == torch.float32
        notes = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
        assert len(notes) == (0 if has_bf16 else 1), notes
        if notes:
            assert "emulated" in notes[0] and "float32" in notes[0]
