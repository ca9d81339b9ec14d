"""From a schedule to logits: flatten the step into one batch, run the model, keep what is sampled.

vLLM's GPU model runner in miniature (vllm/v1/worker/gpu_model_runner.py). It owns the KV cache
tensor, the one big allocation of the engine, and turns the scheduler's plain `SchedulerOutput`
(which sequences, which new tokens, which blocks) into the flat tensors of one step (see "one
engine step" on the docs' architecture page):

    input_ids[T], positions[T]            every new token of every scheduled sequence, end to end
    AttentionMetadata                     where each sequence's tokens are and where its K/V lives

It reads nothing but that message, so the same runner serves a worker in another process: with
tensor parallelism every rank runs this runner on the same message, over its own shard of the
model and its own KV cache (the same blocks, its own KV heads); rank 0's runner returns the
logits, the others None (paper §4.6; `minivllm/distributed/`). With pipeline parallelism a stage
runs its own layers over its own KV cache, between a receive and a send of the hidden states
(`pp`). The attention backend's per-step
plan is built here, once, and handed to every layer in the metadata.

Like vLLM's runner, which captures CUDA graphs of the decode step and replays them, this runner
owns the device's decode loop (`build_decode_loop`): on a CPU, a Llama decode step's layers in one
C++ call (minivllm/worker/cpu_decode_loop.py), bit for bit the model's own loop. The model does not know
it exists; `enforce_eager=True` (vLLM's flag) keeps every step in the model's Python forward, and
so does a forward hook on the model (the C++ loop would skip it).

Logits are computed only at the last new token of sequences that will sample this step (those
whose new tokens reach the end of what they know); a prompt chunk that is not the last needs none.
A request that asks for its prompt's logprobs also gets its prompt rows scored, chunk by chunk,
on the runner (minivllm/sample/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.config import CacheConfig
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.pipeline import SINGLE_STAGE, IntermediateTensors, PipelineParallelGroup
from minivllm.lora.manager import LoRAModelManager
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.platforms import DecodeLoop, platform_for, resolve_obj_by_qualname
from minivllm.sample.prompt_logprobs import score_prompt_logprobs
from minivllm.sample.sampler import LogprobsTensors


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: `kv_cache_dtype` ("auto": the model's dtype, as in vLLM)."""
    if cache_dtype == "auto":
        return model_dtype
    return getattr(torch, cache_dtype)  # validated by CacheConfig: "bfloat16", "float16", ...


def kv_bytes_per_block(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """Bytes of one KV block on this rank: its KV heads only (all of them on one device), at the
    cache's dtype (`kv_cache_dtype`: a bfloat16 cache under float32 weights fits 2x the blocks)."""
    cfg = model.config
    per_token = 2 * (num_layers or cfg.num_hidden_layers) * model.num_kv_heads * cfg.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def determine_num_blocks(
    model: LlamaForCausalLM,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int | None = None,  # the layers a block spans (every layer: None)
) -> int:
    """`num_gpu_blocks_override` wins; else the platform's budget (CUDA's free memory share, or
    the CPU's GiB). `dtype` is the cache's (`kv_cache_torch_dtype`), not the weights'."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = kv_bytes_per_block(model, cache.block_size, dtype, num_layers)
    budget = platform_for(device).kv_cache_budget_bytes(
        device, cache.gpu_memory_utilization, cache.cpu_kv_cache_space
    )
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"no memory is left for the KV cache (a block needs {per_block} bytes); raise "
            "gpu_memory_utilization / cpu_kv_cache_space or set num_gpu_blocks_override"
        )
    return num_blocks


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]  rows of the flat batch whose logits are sampled
    # seq_id -> (rows of the flat batch, int64 [R]; the prompt tokens they predict, int64 [R]; k)
    prompt_rows: dict[int, tuple[torch.Tensor, torch.Tensor, int]]
    token_lora_slots: (
        torch.Tensor | None
    )  # int64 [T]  each row's adapter slot (-1: none); no LoRA: None


@dataclass
class ModelRunnerOutput:
    """What a step's model run hands back (vLLM's name; there the runner samples too)."""

    logits: torch.Tensor | None  # float32 [S, vocab] for the sampled rows; None: none, or rank > 0
    # seq_id -> the step's scored prompt rows (`LogprobsTensors`, row r: the token at start + 1 + r)
    prompt_logprobs: dict[int, LogprobsTensors]
    # A pooling runner's: seq_id -> float32 [H], for each sequence whose prompt ended this step
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    # This rank's pipeline stage (build_runner sets it): a stage before the last sends its hidden
    # states on instead of computing logits, a later one receives them instead of embedding.
    pp: PipelineParallelGroup = SINGLE_STAGE

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,  # the KV cache's (kv_cache_dtype resolved), not necessarily the model's
        device: torch.device,
        enforce_eager: bool = False,
        num_cache_layers: int
        | None = None,  # layer slots: a hybrid model's group size, or a stage's layers
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        # Not zero-filled: no kernel reads a slot before writing it (the reference masks the
        # padding its batched gather reads), so start-up does not touch all of the default 4 GiB.
        self.kv_cache = torch.empty(
            (
                num_cache_layers or cfg.num_hidden_layers,
                2,
                num_blocks,
                block_size,
                model.num_kv_heads,
                cfg.head_dim,
            ),
            dtype=dtype,
            device=device,
        )  # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], this rank's heads
        self.decode_loop: DecodeLoop | None = None
        # LoRA adapters' slots, set by `build_runner` after it wrapped the model's linears (the
        # decode loop, built above, declares the wrappers and adds their deltas itself).
        self.lora_manager: LoRAModelManager | None = None
        if not enforce_eager:
            self.build_decode_loop()

    def build_decode_loop(self) -> None:
        """The platform's compiled decode loop, where it has one that runs this model exactly."""
        name = platform_for(self.device).decode_loop_cls
        if name is not None:
            self.decode_loop = resolve_obj_by_qualname(name).build(self.model, self.backend)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give the writer its own copy of a shared block, in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        dev = self.device
        for item in sched.scheduled:
            table = item.block_table
            input_ids += item.new_token_ids
            pos = range(item.num_computed_tokens, item.seq_len)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(item.seq_len)
            if item.sample:  # and, when it verifies k drafts, the k rows before that one
                logits_indices += range(
                    query_start_loc[-1] - 1 - item.num_spec_tokens, query_start_loc[-1]
                )
            scored = item.prompt_logprobs
            if scored is not None:
                first = query_start_loc[-2] + scored.start - item.num_computed_tokens
                rows = torch.arange(first, first + len(scored.target_ids), device=dev)
                targets = torch.tensor(scored.target_ids, dtype=torch.int64, device=dev)
                prompt_rows[item.seq_id] = (rows, targets, scored.num_logprobs)
        max_blocks = max(len(item.block_table) for item in sched.scheduled)
        padded = [
            item.block_table + [0] * (max_blocks - len(item.block_table))
            for item in sched.scheduled
        ]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(item.num_new_tokens for item in sched.scheduled),
            max_seq_len=max(seq_lens),
        )
        meta.plan = self.backend.plan(meta, bs)  # once per step, for all layers
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            prompt_rows=prompt_rows,
            token_lora_slots=self.prepare_lora_slots(sched),
        )

    def prepare_lora_slots(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Each row's adapter slot (int64 [T], -1: the base model), after making the step's
        adapters resident: a prompt chunk's rows and a decode's row alike take their request's
        slot, as a block table is per request and read per row (Punica's batching)."""
        if self.lora_manager is None:
            return None
        slot_of = self.lora_manager.activate(
            item.lora_request for item in sched.scheduled if item.lora_request is not None
        )
        slots: list[int] = []
        for item in sched.scheduled:
            lora = item.lora_request
            slots += [slot_of[lora.lora_int_id] if lora else -1] * item.num_new_tokens
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: copy-on-write copies first, then the model over every new token. Returns
        float32 [S, vocab] logits for the scheduled sequences that sample (in schedule order), or
        None when none does (every sequence computed a non-final prompt chunk) or when this runner
        is not rank 0 of a tensor-parallel group; and the scored prompt rows of the sequences
        that asked for prompt logprobs (rank 0 only)."""
        self.copy_blocks(sched.block_copies)
        inp = self.prepare_inputs(sched)
        if self.lora_manager is not None and inp.token_lora_slots is not None:
            self.lora_manager.set_mapping(inp.token_lora_slots)  # read by every LoRA wrapper
        received = None
        if not self.pp.is_first:  # the previous stage's hidden states of the same T tokens
            cfg = self.model.config
            with_residual = self.model.model.carries_residual
            num_tokens = inp.input_ids.shape[0]
            received = self.pp.recv(
                num_tokens, cfg.hidden_size, self.dtype_of_hidden(), self.device, with_residual
            )
        hidden = self.run_model(inp, received)  # [T, hidden_size]
        if isinstance(hidden, IntermediateTensors):  # a stage before the last: hand them on
            self.pp.send(hidden)
            return ModelRunnerOutput(None, {})
        logits = None
        if inp.logits_indices.numel():
            logits = self.model.compute_logits(hidden[inp.logits_indices])
        prompt_logprobs = {}
        if inp.prompt_rows:  # every rank scores: the LM head gathers the vocabulary
            prompt_logprobs = score_prompt_logprobs(self.model, hidden, inp.prompt_rows)
        return ModelRunnerOutput(logits, prompt_logprobs)

    def dtype_of_hidden(self) -> torch.dtype:
        """The activations' dtype: the model's weights' (the loader cast them all to it)."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())

    def run_model(
        self, inp: ModelInput, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size]; a stage before the last's
        """The model's forward over the step (with pipeline parallelism: this stage's layers),
        or the decode loop where it applies."""
        loop = self.decode_loop
        if loop is not None and loop.applies(inp.input_ids.shape[0], inp.meta):
            return loop(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
        return self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta, intermediate)
