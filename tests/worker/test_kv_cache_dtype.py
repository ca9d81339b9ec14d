"""kv_cache_dtype (vLLM's option): the KV cache in a dtype narrower than the model's.

What must hold: the option is validated with the allowed values named (fp8 refused by name); the
KV budget counts the cache's bytes, so a bfloat16 cache under float32 weights holds twice the
blocks; and generation over a bfloat16 cache is float32 generation up to bfloat16's rounding of
K and V: close logprobs, and greedy tokens equal or, where they first diverge, each side's token
in the other's top-k (vLLM's `check_logprobs_close`). The kernels' own parity with the reference
is in tests/cpu/test_kernels_cpu_attention_kv_dtype.py and tests/attention/test_attention_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.config import KV_CACHE_DTYPES
from minivllm.core.outputs import RequestOutput
from minivllm.cpu.ops import skinny_gemm_fast
from minivllm.engine.arg_utils import EngineArgs
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cpu_decode_loop import all_linears_packed
from tests.utils.engine_utils import save_tiny_llama

TOP_K = 5
# |logprob(bfloat16 KV) - logprob(float32 KV)| of each greedy token before the first divergence,
# on the tiny model below: measured max 0.168, mean 0.025 (its wide random weights make sharp,
# sensitive attention: bfloat16 keeps 8 bits of mantissa). The trained SmolLM2 is measured on the
# docs' performance page.
LOGPROB_ATOL, LOGPROB_MEAN_ATOL = 0.3, 0.05
# Two backends over the same bfloat16 cache: measured max 0.0025, mean 5e-5 (float32 KV: 5e-5
# max). Their float32 sums differ in order, which now and then moves a K/V value across a
# bfloat16 rounding boundary when the next layer's cache is written: more than float32's 1e-5.
BACKENDS_ATOL = 0.01


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: the CPU kernel's AVX-512 or AVX2 loops, where the library's level has them.
    out = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_llama(
        out, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    lens = [3, 15, 16, 17, 40, 70]  # within, at and past a block's 16 tokens
    return [
        {"prompt_token_ids": torch.randint(100, 40000, (n,), generator=gen).tolist()} for n in lens
    ]


def run(model: Path, **engine: object) -> tuple[LLM, list[RequestOutput]]:
    llm = LLM(str(model), skip_tokenizer_init=True, cpu_kv_cache_space=0.05, **engine)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=TOP_K)
    return llm, llm.generate(prompts(), params, use_tqdm=False)


def generate(model: Path, **engine: object) -> list[RequestOutput]:
    return run(model, **engine)[1]


def check_logprobs_close(
    a: list[RequestOutput], b: list[RequestOutput], atol: float
) -> tuple[int, list[int], float]:
    """vLLM's check (tests/models/utils.py): greedy tokens equal, or where they first diverge,
    each side's token is in the other's top-k; before that, the tokens' logprobs within `atol`.
    Returns (outputs identical, each output's common prefix length, the mean logprob difference)."""
    identical, prefixes, diffs = 0, [], []
    for out_a, out_b in zip(a, b, strict=True):
        ca, cb = out_a.outputs[0], out_b.outputs[0]
        assert ca.logprobs is not None and cb.logprobs is not None
        prefix = 0
        for ta, tb, la, lb in zip(ca.token_ids, cb.token_ids, ca.logprobs, cb.logprobs):
            if ta != tb:
                assert ta in lb and tb in la, (
                    f"request {out_a.request_id}: {ta} vs {tb} at {prefix}"
                )
                break
            assert abs(la[ta].logprob - lb[tb].logprob) <= atol, (prefix, la[ta], lb[tb])
            diffs.append(abs(la[ta].logprob - lb[tb].logprob))
            prefix += 1
        identical += list(ca.token_ids) == list(cb.token_ids)
        prefixes.append(prefix)
    return identical, prefixes, sum(diffs) / len(diffs)


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_is_refused_with_the_supported_values_named(value: str) -> None:
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{value}' is not supported.*one of"):
        EngineArgs(kv_cache_dtype=value).create_engine_config()


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field_and_the_values() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'bfloat16'"):
        EngineArgs(kv_cache_dtype="int4").create_engine_config()
    assert KV_CACHE_DTYPES[0] == "auto"  # the default: the model's dtype, today's behaviour


def test_the_cli_flag_is_generated_with_its_choices() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-cache-dtype", "bfloat16"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_a_bfloat16_cache_holds_twice_the_blocks_in_the_same_budget(tiny_llama: Path) -> None:
    runners = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(
            str(tiny_llama), skip_tokenizer_init=True, cpu_kv_cache_space=0.01, kv_cache_dtype=kv
        )
        runners[kv] = llm.llm_engine.runner
        assert llm.llm_engine.kv_cache_dtype == runners[kv].kv_cache.dtype
    fp32, bf16 = runners["auto"].kv_cache, runners["bfloat16"].kv_cache
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    # The budget divides by half the bytes per block: twice the blocks (floor division: or one more).
    assert bf16.shape[2] // 2 == fp32.shape[2]
    budget = 0.01 * 2**30
    assert fp32.numel() * 4 <= budget and bf16.numel() * 2 <= budget


def test_bfloat16_kv_is_float32_generation_up_to_rounding(tiny_llama: Path) -> None:
    exact = generate(tiny_llama, kv_cache_dtype="auto")
    narrow = generate(tiny_llama, kv_cache_dtype="bfloat16")
    identical, prefixes, mean = check_logprobs_close(exact, narrow, LOGPROB_ATOL)
    assert 0 < mean <= LOGPROB_MEAN_ATOL  # > 0: the cache really is bfloat16
    assert identical >= 2 and sum(prefixes) >= len(prefixes) * 24 // 2, prefixes  # measured: 2, 113


def test_reference_and_cpu_backends_agree_over_a_bfloat16_cache(tiny_llama: Path) -> None:
    """The same rounded cache, read by the reference's gather + SDPA, by the compiled kernel from
    Python, and by the decode steps' one C++ call (cpu_decode_layers): float32 sums in another
    order only."""
    ref = generate(tiny_llama, kv_cache_dtype="bfloat16", attention_backend="reference")
    eager = generate(
        tiny_llama, kv_cache_dtype="bfloat16", attention_backend="cpu", enforce_eager=True
    )
    llm, replay = run(tiny_llama, kv_cache_dtype="bfloat16", attention_backend="cpu")
    # The replay runs a bfloat16 cache: it is captured wherever every linear runs in the C++ loop,
    # prepacked for oneDNN (any row count) or plain on the skinny GEMM's AVX-512 path.
    model = llm.llm_engine.runner.model
    captured = all_linears_packed(model) or skinny_gemm_fast()
    assert (llm.llm_engine.runner.decode_loop is not None) == captured
    identical, prefixes, _ = check_logprobs_close(ref, eager, BACKENDS_ATOL)
    assert identical == len(prefixes), prefixes
    # The decode replay calls the same kernels on the same layouts: bit for bit the Python loop.
    for a, b in zip(eager, replay):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


def test_a_cache_wider_than_the_model_is_refused_before_loading(tiny_llama: Path) -> None:
    args = EngineArgs(model=str(tiny_llama), dtype="bfloat16", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float32' is wider than .*bfloat16"):
        args.create_engine_config()


def test_auto_is_bfloat16_for_a_gguf_file_s_own_blocks_on_a_cpu_only(tiny_llama: Path) -> None:
    """vLLM's and llama.cpp's caches of a GGUF model are 16-bit; minivllm's float32 CPU default
    dtype would give it a float32 cache (resolve_kv_cache_dtype says why "auto" is bfloat16)."""

    def cache_dtype(**kwargs: object) -> str:
        return EngineArgs(device="cpu", **kwargs).create_engine_config().cache.cache_dtype  # type: ignore[arg-type]

    assert cache_dtype() == "bfloat16"  # the bundled Q4_1 file on its blocks
    assert cache_dtype(kv_cache_dtype="float32") == "float32"  # asked for: kept
    assert cache_dtype(quantization="none") == "auto"  # dequantized: float32, token-exact
    assert cache_dtype(dtype="bfloat16", quantization="none") == "auto"
    assert cache_dtype(model=str(tiny_llama)) == "auto"  # a float checkpoint: its dtype
