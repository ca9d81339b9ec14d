"""Every engine option, declared once: vLLM's `EngineArgs` (vllm/engine/arg_utils.py).

Each field of `EngineArgs` below is one option, with its default and its help text beside it. The
ways of setting an option are all generated from these fields, so they cannot drift apart:

  Python    `LLM(model, **kwargs)`: the keywords are exactly these fields
  server    `minivllm serve`, `python -m minivllm.entrypoints.openai.api_server`: `--kebab-case`
            flags from `add_cli_args`, read back with `from_cli_args`
  benches   `minivllm bench throughput | memory | prefix`: the same flags

`create_engine_config()` turns the flat options into the typed configs of `minivllm/config/__init__.py`
(`ModelConfig`, `CacheConfig`, `SchedulerConfig`, `ParallelConfig`), whose `__post_init__`
checks the values, so a bad value fails the same way from every surface. See the architecture
page (docs/architecture.md) for where each config is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import logging
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, TypedDict, TypeVar

import torch

from minivllm.attention.abstract import BACKEND_NAMES
from minivllm.attention.selector import resolve_backend_name
from minivllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_ALLOCATIONS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ResolvedConfig,
    SchedulerConfig,
)
from minivllm.config.lora import LoRAConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.model.hf_overrides import HfOverrides, parse_hf_overrides
from minivllm.model.loader import load_config, load_tokenizer
from minivllm.model.resolver import (
    checkpoint_dtype,
    load_generation_defaults,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_model,
    resolve_pooling_dtype,
)
from minivllm.model.source import ModelSource
from minivllm.pooling.config import (
    CONVERTS,
    RUNNERS,
    TASKS,
    PoolerConfig,
    parse_pooler_config,
    resolve_pooler_config,
    resolve_runner,
)
from minivllm.structured_output.params import StructuredOutputsConfig

ENGINE_GROUP = "engine"  # the argparse group holding the engine's flags on every parser
logger = logging.getLogger("minivllm")


def _arg(default: Any, help: str, **cli: Any) -> Any:
    """One option: its default, its help text, and extra `add_argument` keywords (`choices`)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """The engine's options, with vLLM's names and (where vLLM has one) vLLM's defaults."""

    # ---------------------------------------------------------------------- the model
    model: str | None = _arg(
        None, "model folder, .gguf file or hub id; unset: the bundled SmolLM2-135M-Instruct"
    )
    tokenizer: str | None = _arg(None, "tokenizer folder or hub id; unset: the model's own")
    skip_tokenizer_init: bool = _arg(
        False, "load no tokenizer: prompts must be token ids and outputs carry no text"
    )
    dtype: str = _arg(
        "auto", "weights and activations; auto: float32 on CPU, bfloat16 on CUDA", choices=DTYPES
    )
    device: str = _arg("auto", "cpu, cuda or cuda:N; auto: cuda when available, else cpu")
    quantization: str | None = _arg(
        None,
        "how weights are held (vLLM's flag): gguf keeps a .gguf file's quantized blocks in memory "
        "and multiplies by them; none dequantizes them at load (float32 on CPU: token-exact with "
        "transformers); unset: the checkpoint's own (gguf for a .gguf model)",
        choices=QUANTIZATIONS,
    )
    max_logprobs: int = _arg(
        20,
        "most logprobs (and prompt logprobs) per token a request may ask for; -1: the whole "
        "vocabulary (a request's -1 asks for the vocabulary too, vLLM's meaning)",
    )
    seed: int = _arg(0, "seeds the generators of random-sampling requests that bring no seed")
    max_model_len: int | None = _arg(
        None, "most tokens of prompt + output per request; unset: the model's context length"
    )
    attention_backend: str = _arg(
        "auto",
        "reference (plain PyTorch throughout, the specification), cpu (compiled CPU kernels: "
        "paged decode attention, fused RMSNorm / SiLU-mul / RoPE, oneDNN-prepacked linears), triton "
        "(CUDA kernels); auto: cpu on a CPU, triton on CUDA",
        choices=BACKEND_NAMES,
    )
    enforce_eager: bool = _arg(
        False,
        "always run the model's layers from Python; unset, a CPU runs each decode step's layers in "
        "one C++ call (vLLM's flag, which there turns off CUDA graphs)",
    )
    # ---------------------------------------------------------------------- the KV cache
    block_size: int = _arg(16, "tokens per KV cache block (paper §4.1)")
    enable_prefix_caching: bool = _arg(
        True,
        "reuse the KV blocks of identical prompt prefixes (vLLM v1's automatic prefix caching)",
    )
    num_gpu_blocks_override: int | None = _arg(
        None,
        "exact number of KV blocks, on any device; unset: sized by gpu_memory_utilization "
        "(CUDA) or cpu_kv_cache_space (CPU)",
    )
    gpu_memory_utilization: float = _arg(
        0.9, "CUDA: fraction of the device's memory minivllm may fill, KV cache included"
    )
    cpu_kv_cache_space: float = _arg(
        4.0, "CPU: GiB of memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE)"
    )
    kv_allocation: str = _arg(
        "paged",
        "paged: KV blocks on demand (PagedAttention); orca-max / orca-pow2 / orca-oracle: the "
        "paper's baselines, a contiguous reservation per request of max_model_len slots, the next "
        "power of two of its final length, or exactly prompt + max_tokens (these need "
        "--no-enable-prefix-caching and n = 1)",
        choices=KV_ALLOCATIONS,
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "what the KV cache stores (vLLM's flag); auto: the model's dtype (bfloat16 for a GGUF "
        "file's own blocks on a CPU, as vLLM's and llama.cpp's 16-bit caches). bfloat16 under float32 "
        "weights holds 2x the blocks in the same memory and halves the bytes attention reads; "
        "keys and values are rounded to it on write and attention still computes in float32. "
        "fp8 is not supported",
        choices=KV_CACHE_DTYPES,
    )
    # ---------------------------------------------------------------------- the scheduler
    max_num_seqs: int = _arg(256, "most sequences running at once (the batch's rows)")
    max_num_batched_tokens: int = _arg(
        2048,
        "most tokens computed in one step, decodes and prompt chunks together; prompts are "
        "chunked to fit (as in vLLM v1), so it bounds a step's latency, not the prompt length; "
        "at least max_num_seqs",
    )
    # ---------------------------------------------------------------------- parallelism
    tensor_parallel_size: int = _arg(
        1,
        "devices (ranks) each layer is split across, Megatron-style; above 1 the engine spawns "
        "the other ranks itself (gloo on CPU, NCCL on CUDA, rank r on cuda:r), or joins the "
        "ranks torchrun started; it must divide the model's attention heads",
        short="-tp",
    )
    pipeline_parallel_size: int = _arg(
        1,
        "stages the decoder layers are cut into, each on tensor_parallel_size ranks of its own "
        "(tensor_parallel_size x pipeline_parallel_size ranks in all, started as above): the "
        "first stage embeds, the last normalises and computes the logits, and each hands the "
        "next one hidden state per token; layers per stage: the even split, or "
        "VLLM_PP_LAYER_PARTITION ('4,4')",
        short="-pp",
    )
    data_parallel_size: int = _arg(
        1,
        "engine cores behind one API server, each a whole engine with its own weights and KV "
        "cache (and its own tensor_parallel_size x pipeline_parallel_size workers); the server "
        "sends each request to the least-loaded core, prompts that share their first KV block "
        "to the same core (minivllm serve only; docs/distributed.md)",
        short="-dp",
    )
    data_parallel_size_local: int | None = _arg(
        None,
        "of the data_parallel_size cores, how many run on this host; unset: all. Below "
        "data_parallel_size, the others run on other hosts under `minivllm serve --headless` and "
        "dial this server at --data-parallel-address:--data-parallel-rpc-port (0: all remote)",
        short="-dpl",
    )
    data_parallel_start_rank: int | None = _arg(
        None,
        "with --headless: the DP rank of this host's first core (its cores are ranks start.."
        "start+local-1); unset: 0, the API server's host",
        short="-dpr",
    )
    data_parallel_address: str | None = _arg(
        None,
        "with cores on several hosts: the API server host's address, where the other hosts' "
        "cores connect; unset: 127.0.0.1",
        short="-dpa",
    )
    data_parallel_rpc_port: int | None = _arg(
        None,
        "with cores on several hosts: the TCP port of that address (MINIVLLM_DP_AUTHKEY, if set, "
        "must match on every host); unset: 29550",
        short="-dpp",
    )
    distributed_executor_backend: str = _arg(
        "mp",
        "who starts the other ranks: mp, processes the engine spawns (on this machine, or on "
        "each node of nnodes); ray, Ray actors placed over a Ray cluster's nodes (RAY_ADDRESS, "
        "or the cluster `ray start` started here; pip install minivllm[ray])",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    nnodes: int = _arg(
        1,
        "machines the mp backend's ranks span: run the same command on each, with its "
        "--node-rank; node 0 runs the engine, the others run `minivllm serve --headless`",
    )
    node_rank: int = _arg(0, "this machine's place among nnodes (0: the one that runs the engine)")
    master_addr: str = _arg(
        "127.0.0.1", "with nnodes > 1: node 0's address, where every rank meets rank 0"
    )
    master_port: int = _arg(29501, "with nnodes > 1: the port of that meeting (torch's TCPStore)")
    # ---------------------------------------------------------------------- structured outputs
    structured_outputs_config: str | None = _arg(
        None,
        'JSON object (vLLM\'s flag): {"backend": "xgrammar" | "auto", "disable_any_whitespace": '
        'bool, "max_cached_grammars": int}; unset: xgrammar with its defaults',
    )

    # ---------------------------------------------------------------------- LoRA adapters
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters (PEFT folders), many in one batch: a request names its adapter "
        "with lora_request=LoRARequest(name, id, path)",
    )
    max_loras: int = _arg(1, "most distinct LoRA adapters in one step (device slots)")
    max_lora_rank: int = _arg(
        16, "the highest LoRA rank served; one of 1, 8, 16, 32, 64, 128, 256, 320, 512"
    )
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept loaded in host memory (LRU); unset: max_loras"
    )

    # ---------------------------------------------------------------------- speculative decoding
    speculative_config: str | Mapping[str, Any] | None = _arg(
        None,
        'JSON object (vLLM\'s flag): {"num_speculative_tokens": k (1-16), "method": "ngram", '
        '"prompt_lookup_max"/"prompt_lookup_min": n (1-64; unset: 5)} or a draft model of the '
        'same vocabulary {"model": PATH_OR_ID, "quantization": q}; "disable_by_batch_size": b '
        "(speculate while at most b sequences run; unset: 8); unset: off",
    )

    # ---------------------------------------------------------------------- pooling models
    runner: str = _arg(
        "auto",
        "generate, or pooling (embeddings, scores: prefill-only steps, a pooler instead of a "
        "sampler; minivllm/pooling/); auto: pooling for a bare encoder or decoder (BertModel, "
        "Qwen3Model), a classifier or a sentence-transformers folder, else generate",
        choices=RUNNERS,
    )
    convert: str = _arg(
        "auto",
        "embed: run a causal LM as an embedding model (last-token pooling unless pooler_config "
        "or its sentence-transformers files say otherwise); classify; auto: the checkpoint's own",
        choices=CONVERTS,
    )
    task: str | None = _arg(
        None,
        "vLLM's older spelling of runner/convert: embed, classify, score, generate or auto",
        choices=tuple(TASKS),
    )
    pooler_config: str | Mapping[str, Any] | None = _arg(
        None,
        'JSON object (vLLM\'s flag): {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool, '
        '"matryoshka_dimensions": [int, ...]}; unset: sentence-transformers\' files, else the '
        "model's default",
    )
    hf_overrides: str | Mapping[str, Any] | None = _arg(
        None,
        "JSON object (vLLM's flag), for a causal LM served as a classifier from its LM head's "
        'rows (Qwen3-Reranker): {"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}, or '
        '"method": "no_post_processing" with any tokens; other keys are refused',
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`EngineArgs(**kwargs)`, but a misspelled option is named with the valid ones."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"unexpected engine argument {key!r}{hint}; the engine arguments are: "
                    + ", ".join(names)
                )
        return cls(**kwargs)

    # ------------------------------------------------------------------------------ the CLI
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, defaults: EngineArgs | None = None
    ) -> argparse.ArgumentParser:
        """Add one `--kebab-case` flag per field, in an argument group named "engine".

        `defaults` lets a bench start from other values (a fixed KV budget) without a second
        declaration of the flags; `minivllm serve` takes the fields' own defaults."""
        group = parser.add_argument_group(ENGINE_GROUP)
        hints = _field_types()
        for f in fields(cls):
            how: dict[str, Any] = {
                k: v for k, v in f.metadata.items() if k not in ("help", "short")
            }
            if hints[f.name] is bool:  # --enable-prefix-caching / --no-enable-prefix-caching
                how["action"] = argparse.BooleanOptionalAction
            else:
                how["type"] = _scalar(hints[f.name])
            short = [f.metadata["short"]] if "short" in f.metadata else []  # vLLM's -tp, -pp
            group.add_argument(
                *short,
                "--" + f.name.replace("_", "-"),
                default=getattr(defaults, f.name) if defaults is not None else f.default,
                help=f.metadata["help"],
                **how,
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    # ------------------------------------------------------------------------------ the configs
    def create_engine_config(self) -> EngineConfig:
        """The typed configs the engine reads, then what they resolve to (vLLM's name and role):
        each config validates its own fields first, so a bad value fails before any file is read;
        then the model's config files are read and the device, dtype, attention backend and
        max_model_len decided. No weight is loaded here."""
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            quantization=self.quantization,
            max_logprobs=self.max_logprobs,
        )
        speculative = SpeculativeConfig.parse(self.speculative_config)
        resolve_runner(self.runner, self.convert, self.task)  # checked before a file is read
        parse_pooler_config(self.pooler_config)
        hf_overrides = parse_hf_overrides(self.hf_overrides)
        if speculative is not None and self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config is not supported with pipeline_parallel_size > 1 (the draft "
                "model and the rejection sampler run on the driver, which holds the first "
                f"pipeline stage only), got pipeline_parallel_size={self.pipeline_parallel_size}"
            )
        if speculative is not None and self.kv_allocation != "paged":
            raise ValueError(
                "speculative_config needs kv_allocation='paged' (drafts take lookahead slots "
                f"that a reservation does not have), got kv_allocation={self.kv_allocation!r}"
            )
        lora = self.create_lora_config()
        if lora is not None and speculative is not None:
            raise ValueError("enable_lora is not supported with speculative_config; unset one")
        config = EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kv_cache_space=self.cpu_kv_cache_space,
                kv_allocation=self.kv_allocation,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                data_parallel_size_local=self.data_parallel_size_local,
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                distributed_executor_backend=self.distributed_executor_backend,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
            ),
            resolved=_resolve(model, hf_overrides),
            structured_outputs=StructuredOutputsConfig.parse(self.structured_outputs_config),
            speculative=speculative,
            lora=lora,
        )
        config.draft = _resolve_draft(speculative, config.resolved)  # read after the target's
        config.pooler = self._resolve_pooler(config)
        if config.pooler is None:  # a generator's "auto" cache (a pooling model keeps its dtype)
            resolved = config.resolved
            config.cache.cache_dtype = resolve_kv_cache_dtype(
                self.kv_cache_dtype, resolved.dtype, resolved.device, resolved.quantization
            )
        return config

    def _resolve_pooler(self, config: EngineConfig) -> PoolerConfig | None:
        """The pooling runner's pooler, and what it implies for the cache and the scheduler
        (minivllm/pooling/config.py): vLLM's "auto" dtype for pooling, no prefix cache where a hit
        would skip hidden states the pooler reads, and an encoder's prompts whole in one step."""
        resolved = config.resolved
        pooler = resolve_pooler_config(
            self.runner,
            self.convert,
            self.task,
            parse_pooler_config(self.pooler_config),
            resolved.source.path,
            resolved.hf_config.architecture,
            resolved.hf_config.hidden_size,
            causal=getattr(resolved.hf_config, "is_causal", True),
            num_labels=getattr(resolved.hf_config, "num_labels", 0),
            use_pad_token=getattr(resolved.hf_config, "use_pad_token", True),
        )
        if pooler is None:
            if resolved.source.hf_overrides is not None:  # its LM head is gone: nothing to sample
                raise ValueError(
                    "hf_overrides makes a classifier of the model, which needs runner='pooling', "
                    f"got runner={self.runner!r}"
                )
            return None
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "runner='pooling' is not supported with pipeline_parallel_size > 1, got "
                f"pipeline_parallel_size={config.parallel.pipeline_parallel_size}"
            )
        if config.speculative is not None:
            raise ValueError("speculative_config is not supported with runner='pooling'")
        if self.dtype == "auto":  # vLLM's pooling default (resolve_pooling_dtype says why)
            dtype = resolve_pooling_dtype(checkpoint_dtype(resolved.source), resolved.device)
            config.resolved = dataclasses.replace(resolved, dtype=dtype)
            config.check_cache_dtype()
        if not pooler.supports_prefix_caching and config.cache.enable_prefix_caching:
            logger.info("prefix caching is off: %s pooling reads every token", pooler.pooling_type)
            config.cache.enable_prefix_caching = False
        if not pooler.supports_chunked_prefill:  # an encoder: whole prompts, and no KV blocks
            sched = config.scheduler
            sched.enable_chunked_prefill = False
            sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, resolved.max_model_len)
            config.cache.encoder_only = True
        return pooler

    def create_lora_config(self) -> LoRAConfig | None:
        """The adapters' limits, or None when `enable_lora` is off (vLLM's `LoRAConfig`)."""
        if not self.enable_lora:
            return None
        if self.pipeline_parallel_size > 1:  # the stages would each need their layers' slots
            raise ValueError(
                "enable_lora is not supported with pipeline_parallel_size > 1, got "
                f"pipeline_parallel_size={self.pipeline_parallel_size}"
            )
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu)


class EngineKwargs(TypedDict, total=False):
    """EngineArgs's fields but `model`, typed for `LLM(model, **kwargs: Unpack[EngineKwargs])`
    (PEP 692): what type checkers and IDEs read. tests/engine/test_engine_args.py holds it equal to
    EngineArgs, names and types."""

    tokenizer: str | None
    skip_tokenizer_init: bool
    dtype: str
    device: str
    quantization: str | None
    max_logprobs: int
    seed: int
    max_model_len: int | None
    attention_backend: str
    enforce_eager: bool
    block_size: int
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None
    gpu_memory_utilization: float
    cpu_kv_cache_space: float
    kv_allocation: str
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    data_parallel_size_local: int | None
    data_parallel_start_rank: int | None
    data_parallel_address: str | None
    data_parallel_rpc_port: int | None
    distributed_executor_backend: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    structured_outputs_config: str | None
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    speculative_config: str | Mapping[str, Any] | None
    runner: str
    convert: str
    task: str | None
    pooler_config: str | Mapping[str, Any] | None
    hf_overrides: str | Mapping[str, Any] | None


InitT = TypeVar("InitT", bound=Callable[..., None])


def document_engine_args(init: InitT) -> InitT:
    """Show every engine argument in `help(LLM)` and `inspect.signature(LLM)`, from EngineArgs.

    `LLM.__init__` takes `**kwargs` so that an unknown keyword gets `from_kwargs`'s message; this
    gives it the explicit signature (`model` first, the rest keyword-only, with their defaults)
    and a docstring that lists each option's meaning."""
    hints = _field_types()
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    lines = [(init.__doc__ or "").rstrip(), "", "Engine arguments (minivllm.EngineArgs):"]
    for f in fields(EngineArgs):
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if f.name == "model"
            else inspect.Parameter.KEYWORD_ONLY
        )
        assert f.default is not MISSING  # every option has a default
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]))
        lines.append(f"    {f.name} (default {f.default!r}): {f.metadata['help']}")
    init.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    init.__doc__ = "\n".join(lines)
    return init


# ---------------------------------------------------------------------------------- helpers
def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def _resolve(mc: ModelConfig, hf_overrides: HfOverrides | None = None) -> ResolvedConfig:
    """Read the model's config files and decide for the machine (see `create_engine_config`).
    `hf_overrides`' tokens become ids here, with the tokenizer, and travel with the source."""
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device)
    resolve_backend_name(mc.attention_backend, device)  # a bad name fails before loading
    source = resolve_model(mc.model)
    if hf_overrides is not None:
        if source.gguf_file is not None:
            raise ValueError("hf_overrides is not supported for a GGUF model")
        tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(source, mc.tokenizer)
        source = dataclasses.replace(source, hf_overrides=hf_overrides.with_token_ids(tokenizer))
    hf_config = load_config(source)
    model_max = hf_config.max_position_embeddings
    max_model_len = mc.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(
            f"max_model_len must be at most the model's {model_max} positions, got {max_model_len}"
        )
    generation = load_generation_defaults(source)  # read before any worker starts
    quantization = resolve_quantization(mc.quantization, source)
    return ResolvedConfig(source, hf_config, generation, device, dtype, max_model_len, quantization)


def _resolve_draft(spec: SpeculativeConfig | None, target: ResolvedConfig) -> ResolvedConfig | None:
    """The draft model's files, read beside the target's (before any weight loads): it runs on
    the target's device and dtype, and must share its vocabulary and cover its context."""
    if spec is None or not spec.uses_draft_model:
        return None
    source = resolve_model(spec.model)
    hf_config = load_config(source)
    prefix = f"speculative_config.model={spec.model!r}"
    if hf_config.vocab_size != target.hf_config.vocab_size:
        raise ValueError(
            f"{prefix}: its vocab_size {hf_config.vocab_size} differs from the target model's "
            f"{target.hf_config.vocab_size}; a draft model must share the target's tokenizer"
        )
    if hf_config.max_position_embeddings < target.max_model_len:
        raise ValueError(
            f"{prefix}: its {hf_config.max_position_embeddings} positions are fewer than "
            f"max_model_len ({target.max_model_len}); lower max_model_len"
        )
    quant = resolve_quantization(spec.quantization, source)
    return dataclasses.replace(target, source=source, hf_config=hf_config, quantization=quant)


def resolve_quantization(quantization: str | None, source: ModelSource) -> str:
    """A .gguf model runs its own quantization unless told "none" (vLLM detects gguf the same
    way); any other checkpoint has plain weights, and asking it for "gguf" is an error."""
    if quantization == "gguf" and source.gguf_file is None:
        raise ValueError(
            f"quantization='gguf' needs a .gguf model; {source.name} is a folder of float "
            "weights (leave quantization unset)"
        )
    if quantization is None:
        return "gguf" if source.gguf_file is not None else "none"
    return quantization


@cache
def _field_types() -> dict[str, Any]:
    """EngineArgs's annotations as types (`int | None`), not the strings `__future__` leaves."""
    return typing.get_type_hints(EngineArgs)


def _scalar(hint: Any) -> type:
    """The argparse `type` of an annotation: `int | None` -> int."""
    members = [t for t in typing.get_args(hint) if t is not type(None)]
    return members[0] if members else hint
