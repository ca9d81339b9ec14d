"""A .gguf model runs its own blocks: loaded as stored, equal to the dequantized model where the
math is the same, and refused by name where it cannot run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minivllm.attention.selector import get_attention_backend
from minivllm.model.errors import ModelLoadError, UnsupportedQuantizationError
from minivllm.model.loader import load_model
from minivllm.model.quantization.gguf.linear import gguf_parts
from minivllm.model.quantization.gguf.reader import GGUFReadError, config_from_reader, open_gguf
from minivllm.model.resolver import resolve_model
from tests.utils.gguf_utils import TINY_FIELDS, random_blocks, tiny_llama_gguf, write_gguf
from tests.utils.paged import paged_logits

CPU = torch.device("cpu")
PROMPT = [5, 17, 250, 3, 99, 100, 1, 319, 42, 42, 7, 8, 13, 21]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def load(path: Path, quantization: str, backend: str = "reference", **kw) -> torch.nn.Module:
    return load_model(
        resolve_model(path), get_attention_backend(backend), torch.float32, CPU,
        quantization=quantization, **kw,
    )  # fmt: skip


def test_the_blocks_stay_blocks(tiny_gguf: Path) -> None:
    model = load(tiny_gguf, "gguf")
    layer0 = model.model.layers[0]
    qkv = layer0.self_attn.qkv_proj
    assert [q for q, _ in gguf_parts(qkv)] == [12, 14]  # Q4_K q and k as one part, Q6_K v
    assert [t.shape[0] for _, t in gguf_parts(qkv)] == [256 + 128, 128]
    assert "weight" not in dict(qkv.named_parameters())
    assert [q for q, _ in gguf_parts(layer0.mlp.gate_up_proj)] == [2, 3]
    # the tied LM head multiplies by the embedding's very bytes
    assert model.lm_head.qweight_0.data_ptr() == model.model.embed_tokens.qweight_0.data_ptr()
    state = model.state_dict()
    assert state["model.layers.1.mlp.down_proj.qweight_0"].dtype == torch.uint8
    floats = [p for p in model.parameters() if p.dtype == torch.float32]
    assert all(p.dim() == 1 for p in floats)  # only the norms are float weights


def test_a_file_without_vocab_size_or_tokenizer_has_a_token_an_embedding_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With neither `llama.vocab_size` nor a tokenizer to count, the embedding's rows say the
    vocabulary's size (a file with a tokenizer: tests/model/test_model_families_gguf.py)."""
    monkeypatch.delitem(TINY_FIELDS, "llama.vocab_size")
    path = tiny_llama_gguf(tmp_path / "old.gguf")
    assert config_from_reader(open_gguf(path)).vocab_size == 320


@pytest.mark.parametrize("output_type", [None, 14], ids=["tied", "own-Q6_K-head"])
def test_the_reference_path_equals_the_dequantized_model(tmp_path: Path, output_type) -> None:
    """Dequantize-then-multiply on every call is the same math as dequantizing once at load."""
    path = tiny_llama_gguf(tmp_path / "m.gguf", output_type=output_type)
    native = paged_logits(load(path, "gguf"), PROMPT, chunk_sizes=[9, 5])
    dequantized = paged_logits(load(path, "none"), PROMPT, chunk_sizes=[9, 5])
    torch.testing.assert_close(native, dequantized, rtol=0, atol=0)


def test_an_unsupported_type_is_refused_by_tensor_and_type(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": (random_blocks(8, 320, 256), 8),
        "blk.0.attn_q.weight": (random_blocks(8, 256, 256)[:, :84].copy(), 10),  # Q2_K bytes
    }
    path = write_gguf(tmp_path / "q2k.gguf", TINY_FIELDS, tensors)
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"blk\.0\.attn_q\.weight is stored as Q2_K.*quantization='none'",
    ):
        load(path, "gguf")


def test_a_truncated_file_is_a_clear_error(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises((GGUFReadError, ModelLoadError), match="cannot read"):
        load(cut, "gguf")


def test_quantization_gguf_needs_a_gguf_model_and_one_device(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    from minivllm.engine.arg_utils import EngineArgs

    folder = load(tiny_gguf, "none")  # noqa: F841  (writes the dequantized folder)
    source = resolve_model(tiny_gguf)
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model"):
        EngineArgs(
            model=str(source.path), quantization="gguf", skip_tokenizer_init=True
        ).create_engine_config()
    with pytest.raises(ValueError, match="quantization must be unset or one of"):
        EngineArgs(model=str(tiny_gguf), quantization="awq").create_engine_config()
    config = EngineArgs(model=str(tiny_gguf), skip_tokenizer_init=True).create_engine_config()
    assert config.resolved.quantization == "gguf"


def test_the_triton_forwards_give_the_reference_s_logits(tiny_gguf: Path) -> None:
    """The CUDA platform's forwards (the Triton GEMM on the blocks, here in Triton's interpreter
    on CPU tensors) within fp32 accumulation-order error of the reference."""
    pytest.importorskip("triton")
    import minivllm.model.quantization.gguf.cuda_forwards  # noqa: F401  (registers them)
    from minivllm.model.custom_op import CustomOp

    model = load(tiny_gguf, "gguf")
    expected = paged_logits(model, PROMPT[:6])
    linears = [m for m in model.modules() if isinstance(m, CustomOp) and hasattr(m, "qtypes")]
    assert len(linears) == 2 * 4 + 1 and all(op.dispatch_forward("cuda") for op in linears)
    got = paged_logits(model, PROMPT[:6])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.cpu_isa  # again at each lower instruction-set level (make test)
def test_the_cpu_kernels_are_close_to_the_dequantized_model_as_vllm_judges(tiny_gguf: Path) -> None:
    """The default CPU path (gguf_linear on the blocks: 8-bit activations for the K-quants where
    the CPU has 8-bit dots, and for every type on AVX2; bf16 or float32 products otherwise)
    against quantization="none": greedy, each token within the other's top-5 logprobs until the
    first divergence (vLLM's check_logprobs_close), at every instruction-set level.

    It holds because the model is made as a trained one is sized (`tiny_llama_gguf`): zero-mean
    weights of standard deviation 1 / sqrt(fan-in) and a small embedding. Random blocks as they
    come (all-positive Q4_K weights, up to tens of times too large) made a chaotic model, whose
    linears' outputs were small differences of large sums: 8-bit activations moved them by up to
    14 %, and its tokens diverged outside each other's top 5."""
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (3, 8, 14)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(
            str(tiny_gguf), quantization=quantization, skip_tokenizer_init=True,
            num_gpu_blocks_override=32,
        )  # fmt: skip
        outs[quantization] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(outs["gguf"], outs["none"]):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert y in a.logprobs[i] and x in b.logprobs[i], (i, a.token_ids, b.token_ids)
                break


@pytest.fixture
def gguf_dot_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """MINIVLLM_CPU_GGUF_DOT set to the test's parameter, read afresh (`gguf_dot` caches it)."""
    from minivllm.cpu import ops as cpu_ops
    from minivllm.cpu.op_forwards import gguf_dot

    if request.param == "int8" and not cpu_ops.gguf_has_int8_dot():
        pytest.skip("this build (or CPU) has no 8-bit dots")
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_DOT", request.param)
    gguf_dot.cache_clear()
    yield request.param
    gguf_dot.cache_clear()


@pytest.mark.parametrize("gguf_dot_env", ["auto", "int8"], indirect=True)
def test_decode_steps_run_the_blocks_in_the_cpp_loop_as_in_the_python_one(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, gguf_dot_env: str
) -> None:
    """The C++ decode loop (minivllm/worker/cpu_decode_loop.py) takes a GGUF model's block parts, mixed
    types included, each with its type's products (auto: 8-bit dots for `INT8_BY_DEFAULT`'s types
    where the CPU has them, on AMX tiles from 16 rows where it has those, the others' bf16 or
    float32; or int8 for every type), and gives the Python loop's logprobs bit for bit."""
    from minivllm.cpu import ops as cpu_ops
    from minivllm.cpu.op_forwards import INT8_BY_DEFAULT
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams
    from minivllm.worker.cpu_decode_loop import DOT_CODES, DOT_INT8_AMX, CpuDecodeLoop

    calls = []
    inner = CpuDecodeLoop.__call__

    def counted(self: CpuDecodeLoop, *args: object) -> torch.Tensor:
        calls.append(1)
        return inner(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CpuDecodeLoop, "__call__", counted)
    llm = LLM(str(tiny_gguf), skip_tokenizer_init=True, num_gpu_blocks_override=32)
    loop = llm.llm_engine.runner.decode_loop
    assert isinstance(loop, CpuDecodeLoop) and max(loop.parts) > 1  # a layer of several types
    # the AMX tiles count as int8: the same outputs, from GGUF_AMX_MIN_ROWS rows
    dots = {
        (t in INT8_BY_DEFAULT, DOT_CODES["int8"] if d == DOT_INT8_AMX else d)
        for t, d in zip(loop.qtypes, loop.dots)
        if t >= 0
    }
    if cpu_ops.gguf_has_int8_dot():  # INT8_BY_DEFAULT's types take 8-bit dots; the others their own
        other = "bf16" if cpu_ops.gguf_has_bf16_dot() else "float32"
        other = "int8" if gguf_dot_env == "int8" else other
        assert dots == {(True, DOT_CODES["int8"]), (False, DOT_CODES[other])}
        # from 16 rows (the 16 prompts' decode steps) the int8 types with AMX tiles take them
        amx = {t for t, d in zip(loop.qtypes, loop.dots) if d == DOT_INT8_AMX}
        int8 = {t for t in loop.qtypes if t in INT8_BY_DEFAULT or gguf_dot_env == "int8"}
        on_amx = cpu_ops.gguf_amx_applies(cpu_ops.GGUF_AMX_MIN_ROWS, 12)
        assert amx == (int8 & cpu_ops.GGUF_AMX_TYPES if on_amx else set())
    # 16 prompts: decode steps of GGUF_AMX_MIN_ROWS rows, the fewest the AMX tiles take
    prompts = [{"prompt_token_ids": (PROMPT * 2)[i : i + 3 + i % 12]} for i in range(16)]
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == 4  # one prefill step, then 4 decode steps
    llm.llm_engine.runner.decode_loop = None
    python = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in fused] == [o.token_ids for o in python]
    for a, b in zip(fused, python):
        assert [{t: p.logprob for t, p in d.items()} for d in a.logprobs] == [
            {t: p.logprob for t, p in d.items()} for d in b.logprobs
        ]


def test_a_float16_model_of_blocks_keeps_the_python_decode_loop_and_generates(
    tiny_gguf: Path,
) -> None:
    """vLLM's tests serve with --dtype half: the blocks multiply float16 activations in Python,
    since the C++ decode loop takes float32 or bfloat16 only (it used to refuse every step)."""
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(str(tiny_gguf), skip_tokenizer_init=True, num_gpu_blocks_override=32, dtype="float16")
    assert llm.llm_engine.runner.decode_loop is None
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT[:5]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
