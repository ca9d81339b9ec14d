"""EngineArgs is the one declaration of the engine's options: the `LLM(...)` keywords, the
`minivllm serve` flags and every bench's engine flags are generated from it and must stay equal to
it. Parsers are inspected without loading any model; the one subprocess only prints `--help`."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from minivllm import LLM, EngineArgs
from minivllm.benchmarks import memory, prefix, throughput
from minivllm.config import SchedulerConfig
from minivllm.engine.arg_utils import ENGINE_GROUP, EngineKwargs
from minivllm.entrypoints.cli import HelpFormatter, make_serve_parser, parse_serve_args
from minivllm.entrypoints.openai import api_server as openai_api_server
from tests.utils.engine_utils import save_tiny_llama

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
DEFAULTS = dataclasses.asdict(EngineArgs())
ENGINE_BENCHES = [throughput, memory, prefix]


def engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    (group,) = [g for g in parser._action_groups if g.title == ENGINE_GROUP]
    return group._group_actions


def bench_parser(module: ModuleType) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


def serve_parsers() -> list[argparse.ArgumentParser]:
    return [make_serve_parser("minivllm serve"), make_serve_parser(openai_api_server.PROG)]


# Every parser that carries the engine's flags, built fresh for each test.
SURFACES: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "serve": lambda: make_serve_parser("minivllm serve"),
    "openai.api_server": lambda: make_serve_parser(openai_api_server.PROG),
    **{
        f"bench {m.__name__.rsplit('.')[-1]}": (lambda m=m: bench_parser(m))  # type: ignore[misc]
        for m in ENGINE_BENCHES
    },
}


def help_entry(text: str, option: str) -> str:
    """The lines of `--help` output that describe `option` (its help may start on the next line)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"\s+{option}([ ,]|$)", ln))
    entry = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("   ") or line.lstrip().startswith("-"):
            break
        entry.append(line.strip())
    return " ".join(entry)


# ---------------------------------------------------------------------------------- LLM(...)
def test_llm_keywords_are_exactly_the_engine_args_with_their_defaults() -> None:
    params = inspect.signature(LLM).parameters
    assert list(params) == FIELDS
    assert {name: p.default for name, p in params.items()} == DEFAULTS
    # Every option but the model is keyword-only, as in vLLM's LLM.
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")


def test_llm_typed_kwargs_match_the_engine_args_types() -> None:
    """EngineKwargs is what IDEs and mypy read for `LLM(**kwargs)`; it may not drift."""
    engine_types = typing.get_type_hints(EngineArgs)
    del engine_types["model"]
    assert typing.get_type_hints(EngineKwargs) == engine_types


def test_llm_help_lists_every_engine_argument_with_its_meaning() -> None:
    doc = LLM.__init__.__doc__ or ""
    for f in dataclasses.fields(EngineArgs):
        assert f"{f.name} (default {f.default!r}): {f.metadata['help']}" in doc


def test_unknown_llm_keyword_is_a_type_error_naming_it_and_the_valid_ones() -> None:
    with pytest.raises(TypeError) as info:
        LLM(max_num_seq=4)  # type: ignore[call-arg]
    message = str(info.value)
    assert "'max_num_seq'" in message and "did you mean 'max_num_seqs'?" in message
    assert all(name in message for name in FIELDS)


def test_invalid_llm_arguments_fail_before_any_model_is_loaded() -> None:
    # "no-such-model" is never resolved: the configs refuse the arguments first.
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM("no-such-model", tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be greater"):
        LLM("no-such-model", max_num_seqs=16, max_num_batched_tokens=8)


# ---------------------------------------------------------------------------------- the configs
def test_create_engine_config_carries_every_argument(tmp_path: Path) -> None:
    model = str(save_tiny_llama(tmp_path))  # resolving reads its config files, no weight
    values = dict(
        model=model,
        tokenizer="t",
        skip_tokenizer_init=True,
        dtype="float16",
        device="cpu",
        quantization="none",
        max_logprobs=-1,
        seed=7,
        max_model_len=99,
        attention_backend="reference",
        enforce_eager=True,
        block_size=8,
        enable_prefix_caching=False,
        num_gpu_blocks_override=11,
        gpu_memory_utilization=0.5,
        cpu_kv_cache_space=1.5,
        kv_allocation="orca-oracle",
        kv_cache_dtype="bfloat16",
        max_num_seqs=3,
        max_num_batched_tokens=50,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=3,
        data_parallel_size_local=1,
        data_parallel_start_rank=2,
        data_parallel_address="10.0.0.2",
        data_parallel_rpc_port=13345,
        distributed_executor_backend="mp",
        nnodes=1,
        node_rank=0,
        master_addr="10.0.0.7",
        master_port=1234,
        structured_outputs_config='{"backend": "xgrammar", "disable_any_whitespace": true}',
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=3,
        speculative_config=None,  # refused with kv_allocation="orca-oracle": carried below
        runner="generate",  # runner, convert, task, pooler_config: one PoolerConfig (or None)
        convert="none",
        task=None,
        pooler_config=None,
        hf_overrides=None,  # carried by the model's source (tests/pooling/test_pooling_reranker.py)
    )
    assert set(values) == set(FIELDS)
    config = EngineArgs(**values).create_engine_config()
    carried: dict[str, object] = {}
    for section in dataclasses.fields(config):
        if section.name not in (
            "resolved",
            "structured_outputs",
            "speculative",
            "draft",  # the draft model's resolved files (`speculative_config.model`)
            "pooler",  # a pooling model's (tests/pooling/): None for a generator
        ):  # one JSON flag -> one typed config
            carried.update(dataclasses.asdict(getattr(config, section.name)))
    carried["enable_lora"] = config.lora is not None  # LoRAConfig exists only when it is on
    carried["kv_cache_dtype"] = carried.pop("cache_dtype")  # vLLM's names: CacheConfig.cache_dtype
    # The model's windows (vLLM's CacheConfig.sliding_window too), not arguments: set by the
    # engine from the model's attention layers (core/kv_cache_groups.py).
    assert carried.pop("sliding_window") is None
    assert carried.pop("layer_sliding_windows") == ()
    assert carried.pop("enable_chunked_prefill") is True  # False only for an encoder's pooler
    assert carried.pop("encoder_only") is False  # True only for an encoder's pooler: no KV blocks
    json_flags = ("structured_outputs_config", "speculative_config")
    json_flags += ("runner", "convert", "task", "pooler_config", "hf_overrides")
    assert config.pooler is None
    assert carried == {k: v for k, v in values.items() if k not in json_flags}
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    speculative = (
        EngineArgs(model=model, speculative_config=spec).create_engine_config().speculative
    )
    assert config.speculative is None and speculative is not None and config.draft is None
    assert speculative.num_speculative_tokens == 3
    assert config.structured_outputs.backend == "xgrammar"
    assert config.structured_outputs.disable_any_whitespace is True
    # ... and what they resolve to, decided before the engine starts (it decides nothing itself).
    resolved = config.resolved
    assert (resolved.device, resolved.dtype) == (torch.device("cpu"), torch.float16)
    assert resolved.max_model_len == 99 and resolved.source.path == Path(model)
    assert resolved.hf_config.max_position_embeddings == 1024


def test_a_max_model_len_beyond_the_model_is_refused_before_any_weight_loads(
    tmp_path: Path,
) -> None:
    args = EngineArgs(model=str(save_tiny_llama(tmp_path)), max_model_len=2048)
    with pytest.raises(ValueError, match="max_model_len must be at most the model's 1024"):
        args.create_engine_config()


INVALID = [
    ({"dtype": "int8"}, "dtype must be one of ("),
    ({"structured_outputs_config": '{"backend": "outlines"}'}, "structured_outputs_config.backend"),
    ({"structured_outputs_config": '{"bakend": "x"}'}, "structured_outputs_config has unknown"),
    (
        {"speculative_config": '{"num_speculative_tokens": 0}'},
        "speculative_config.num_speculative_tokens must be an integer in [1, 16], got 0",
    ),
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda[:N]', got 'tpu'"),
    ({"kv_allocation": "orca"}, "kv_allocation must be one of ('paged', 'orca-max', "),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of ('auto', 'bfloat16', "),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"max_model_len": 0}, "max_model_len must be a positive integer, got 0"),
    ({"attention_backend": "flash"}, "attention_backend must be one of ("),
    ({"quantization": "awq"}, "quantization must be unset or one of ('gguf', 'none')"),
    ({"max_logprobs": -2}, "max_logprobs must be non-negative or -1, got -2"),
    ({"block_size": 0}, "block_size must be a positive integer, got 0"),
    ({"num_gpu_blocks_override": -1}, "num_gpu_blocks_override must be a positive integer, got -1"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"cpu_kv_cache_space": 0.0}, "cpu_kv_cache_space must be > 0 GiB, got 0.0"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer, got 0"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer, got 0"),
    ({"data_parallel_size": 0}, "data_parallel_size must be a positive integer, got 0"),
    (
        {"data_parallel_size_local": 3, "data_parallel_size": 2},
        "data_parallel_size_local must be in [0, data_parallel_size=2], got 3",
    ),
    (
        {"data_parallel_start_rank": 2, "data_parallel_size": 2, "data_parallel_size_local": 1},
        "data_parallel_start_rank + data_parallel_size_local must be at most data_parallel_size=2",
    ),
    ({"data_parallel_rpc_port": 70000}, "data_parallel_rpc_port must be in (0, 65536), got 70000"),
    (
        {"nnodes": 2, "data_parallel_size": 2, "tensor_parallel_size": 2},
        "nnodes > 1 is not supported with data_parallel_size > 1",
    ),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be a positive integer, got 0"),
    (
        {"distributed_executor_backend": "slurm"},
        "distributed_executor_backend must be one of ['mp', 'ray'], got 'slurm'",
    ),
    ({"nnodes": 0}, "nnodes must be a positive integer, got 0"),
    ({"node_rank": 1}, "node_rank must be in [0, nnodes) = [0, 1), got 1"),
    ({"master_port": 70000}, "master_port must be in (0, 65536), got 70000"),
    ({"runner": "draft"}, "runner must be one of ('auto', 'generate', 'pooling'), got 'draft'"),
    ({"convert": "reward"}, "convert must be one of ('auto', 'none', 'embed', 'classify')"),
    ({"task": "transcribe"}, "task must be one of ('auto', 'generate', 'embed', "),
    ({"pooler_config": '{"pooling_type": "MAX"}'}, "pooler_config.pooling_type must be one of"),
    ({"hf_overrides": '{"num_labels": 2}'}, "hf_overrides keys ['num_labels'] are not supported"),
    ({"max_loras": 0, "enable_lora": True}, "max_loras must be in [1, 64], got 0"),
    ({"max_lora_rank": 12, "enable_lora": True}, "max_lora_rank must be one of (1, 8, 16, "),
    (
        {"max_cpu_loras": 1, "enable_lora": True, "max_loras": 2},
        "max_cpu_loras must be at least max_loras (2), got 1",
    ),
    (
        {"enable_lora": True, "pipeline_parallel_size": 2},
        "enable_lora is not supported with pipeline_parallel_size > 1",
    ),
]
# Checked where they are used: a path or hub id is resolved when the model loads; flags are bools.
# An address is checked when rank 0 (or the DP coordinator) listens on it.
UNCHECKED = {"model", "tokenizer", "skip_tokenizer_init", "enable_prefix_caching", "enforce_eager"}
UNCHECKED |= {"master_addr", "data_parallel_address"}


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[next(iter(k)) for k, _ in INVALID])
def test_invalid_engine_argument_raises_value_error_naming_the_field(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs(**kwargs).create_engine_config()  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_every_checked_engine_argument_has_an_invalid_case() -> None:
    assert {name for kwargs, _ in INVALID for name in kwargs} == set(FIELDS) - UNCHECKED


def test_tensor_parallel_size_defaults_to_one_and_any_positive_size_reaches_the_config() -> None:
    # Whether a size splits the model's heads is checked against the model, when it is read.
    assert EngineArgs().create_engine_config().parallel.tensor_parallel_size == 1
    assert (
        EngineArgs(tensor_parallel_size=3).create_engine_config().parallel.tensor_parallel_size == 3
    )


def test_parallel_sizes_take_vllms_short_flags_tp_and_pp() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["-tp", "2", "-pp", "3"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    long = parser.parse_args(["--pipeline-parallel-size", "2"])
    assert EngineArgs.from_cli_args(long).pipeline_parallel_size == 2


def test_scheduler_refuses_a_token_budget_below_max_num_seqs_with_vllms_message() -> None:
    with pytest.raises(ValueError) as info:
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=31)
    assert str(info.value) == (
        "max_num_batched_tokens (31) must be greater than or equal to max_num_seqs (32)."
    )
    SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=32)  # equal is allowed


# ---------------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("surface", SURFACES)
def test_every_engine_flag_is_an_engine_arg_in_vllms_spelling_with_help(surface: str) -> None:
    actions = engine_actions(SURFACES[surface]())
    assert [a.dest for a in actions] == FIELDS
    for action in actions:
        assert f"--{action.dest.replace('_', '-')}" in action.option_strings
        assert action.help, action.dest


def test_serve_flags_default_to_the_engine_args_defaults() -> None:
    for parser in serve_parsers():
        assert {a.dest: a.default for a in engine_actions(parser)} == DEFAULTS


@pytest.mark.parametrize("module", ENGINE_BENCHES, ids=lambda m: m.__name__.rsplit(".")[-1])
def test_bench_flags_default_to_the_engine_args_defaults_or_the_bench_s_declared_ones(
    module: ModuleType,
) -> None:
    """A bench may start from other values (a fixed KV budget), declared as an EngineArgs."""
    expected = dataclasses.asdict(getattr(module, "ENGINE_DEFAULTS", EngineArgs()))
    assert {a.dest: a.default for a in engine_actions(bench_parser(module))} == expected
    args = bench_parser(module).parse_args([])
    assert EngineArgs.from_cli_args(args) == EngineArgs(**expected)


@pytest.mark.parametrize("surface", SURFACES)
def test_help_shows_every_flag_with_its_meaning_and_default(
    surface: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a help text
    parser = SURFACES[surface]()
    parser.formatter_class = HelpFormatter  # what the CLI builds every parser with
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry = help_entry(text, action.option_strings[0])
        assert action.help and action.help in entry, entry
        assert f"(default: {action.default})" in entry, entry


def test_cli_flags_round_trip_into_engine_args() -> None:
    argv = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching"]
    argv += ["--dtype", "float16", "--max-model-len", "512", "--tensor-parallel-size", "1"]
    args = parse_serve_args(make_serve_parser("minivllm serve"), argv)
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        dtype="float16",
        max_model_len=512,
    )


def test_engine_flag_choices_are_checked_by_the_parser() -> None:
    parser = make_serve_parser("minivllm serve")
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])


# ---------------------------------------------------------------------------------- the model
@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["my-model"], "my-model"),
        (["--model", "my-model"], "my-model"),
        (["my-model", "--model", "my-model"], "my-model"),
        (["--port", "8001"], None),
    ],
)
def test_serve_takes_the_model_positionally_or_as_model_flag(
    argv: list[str], model: str | None
) -> None:
    for parser in serve_parsers():
        assert parse_serve_args(parser, argv).model == model


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(make_serve_parser("minivllm serve"), ["a", "--model", "b"])
    assert info.value.code == 2
    assert "the model is given twice, as 'a' and as --model 'b'" in capsys.readouterr().err


def test_vllm_guide_command_parses() -> None:
    """vLLM's quickstart: `python -m vllm.entrypoints.openai.api_server --model NAME --port N`."""
    parser = make_serve_parser(openai_api_server.PROG)
    args = parse_serve_args(parser, ["--model", "Qwen/Qwen2.5-1.5B-Instruct", "--port", "8001"])
    assert (args.model, args.port) == ("Qwen/Qwen2.5-1.5B-Instruct", 8001)


def test_openai_api_server_module_prints_its_help_with_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.openai.api_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "1000"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {openai_api_server.PROG}")
    for flag in ["--model", "--port", "--host", "--api-key", "--tensor-parallel-size"]:
        assert flag in result.stdout
    assert "(default: 256)" in result.stdout  # --max-num-seqs
