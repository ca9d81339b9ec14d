"""LLMEngine: requests in, one scheduled batch per `step()`, streaming `RequestOutput`s out.

vLLM's `LLMEngine` (vllm/v1/engine/llm_engine.py) without the process boundaries. One `step()` is
the paper's one iteration (§4.5), in the order of "one engine step" on the docs' architecture page:

    schedule -> run the model -> sample -> commit (progress, prefix-cache hashes) -> process outputs

The engine only orchestrates: the scheduler owns the KV bookkeeping, the model runner owns the KV
tensors, the sampler picks tokens and the output processor turns them into text and stops.

A step that raises (an exception, or Ctrl-C inside the model) fails the requests it carried and
frees their blocks; the prefix-cache names it gave are withdrawn (they become final only when a
step commits, last), so nothing it half-did is visible to any later request.

Parallel sampling (`n > 1`, paper §4.4): the prompt is computed once; at its first sample the
sequence is forked into n that share every prompt block until one of them writes into it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from minivllm.attention import get_attention_backend, resolve_backend_name
from minivllm.beam_search import BeamSearchParams, BeamSearchProcessor, BeamState
from minivllm.config import EngineConfig
from minivllm.distributed.executor import Executor, make_executor
from minivllm.inputs import PromptType, process_prompt
from minivllm.kv_allocation import make_block_manager
from minivllm.model.loader import (
    load_config,
    load_generation_defaults,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from minivllm.output_processor import OutputProcessor
from minivllm.outputs import RequestOutput, make_request_output
from minivllm.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler, SchedulerOutput
from minivllm.sequence import Request, Sequence, SequenceStatus
from minivllm.stats import EngineStats

if TYPE_CHECKING:
    from minivllm.trace.recorder import StepRecorder

logger = logging.getLogger("minivllm")


class PromptTooLongError(ValueError):
    """The prompt leaves no room for output within max_model_len."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        """`executor`: run the steps there instead of loading the model's weights (the
        simulated-time executor, minivllm/distributed/simulated.py); the model folder then needs
        only its config.json."""
        self.config = config
        mc = config.model
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        resolve_backend_name(mc.attention_backend, self.device)  # a bad name fails before loading
        self.source = resolve_model(mc.model)
        self.tokenizer: Any = (
            None if mc.skip_tokenizer_init else load_tokenizer(self.source, mc.tokenizer)
        )
        backend = get_attention_backend(mc.attention_backend, self.device)
        self.attention_backend = backend.name  # "auto" resolved, after any fallback
        model_config = load_config(self.source)
        model_max = model_config.max_position_embeddings
        self.max_model_len = mc.max_model_len or model_max
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len must be at most the model's {model_max} positions, got {self.max_model_len}"
            )
        generation = load_generation_defaults(self.source)  # read before any worker starts
        # The model runner in this process (tensor_parallel_size 1), or rank 0's of N ranks that
        # each hold 1/N of the model and get every step (paper §4.6; minivllm/distributed/).
        self.executor = executor or make_executor(
            config, self.source, model_config, backend, self.dtype, self.device, self.max_model_len
        )
        self.runner = self.executor.driver_runner
        self.model = self.runner.model  # rank 0's shard when tensor_parallel_size > 1
        cc = config.cache
        num_blocks = self.executor.num_blocks  # the same on every rank: the smallest any can hold
        capacity = num_blocks * cc.block_size
        if self.max_model_len > capacity:
            if mc.max_model_len is not None:
                self.executor.shutdown()  # no worker outlives a refused engine
                raise ValueError(
                    f"max_model_len ({self.max_model_len}) is larger than the KV cache holds "
                    f"({num_blocks} blocks x {cc.block_size} = {capacity} tokens)"
                )
            logger.warning("max_model_len lowered to the KV cache's %d tokens", capacity)
            self.max_model_len = capacity
        self.block_manager = make_block_manager(cc, num_blocks, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        # Unseeded random sampling draws from the engine's own generator, seeded by `seed`: a
        # whole offline run is reproducible, and torch's global RNG stays the user's.
        self.generator = torch.Generator(device=self.device).manual_seed(mc.seed)
        self.sampler = Sampler(self.generator)
        self.eos_token_id: int | None = (
            self.tokenizer.eos_token_id
            if self.tokenizer is not None
            else next(iter(model_config.eos_token_ids), None)
        )
        # generation_config.json, as vLLM reads it by default: its sampling defaults fill the fields
        # a request leaves unset, and each of its EOS ids stops generation (models whose
        # end-of-turn token is not the tokenizer's eos_token).
        self._diff_sampling_param: dict[str, Any] = dict(generation.sampling_defaults)
        self._extra_eos_token_ids = set(generation.eos_token_ids) - {self.eos_token_id}
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_id, self.max_model_len
        )
        eos_ids = {t for t in (self.eos_token_id, *self._extra_eos_token_ids) if t is not None}
        self.beam_search = BeamSearchProcessor(
            self.scheduler, self._new_seq, self._finish, self.output_processor, eos_ids
        )
        self.vocab_size = self.model.config.vocab_size
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self._aborted_outputs: list[RequestOutput] = []
        # The step trace (minivllm/trace/): when attached, it sees every step after its commit.
        self.step_recorder: StepRecorder | None = None
        # Counters behind get_stats().
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.peak_blocks_used = 0
        self.peak_slot_utilization = 1.0
        logger.info(
            "minivllm engine: model=%s dtype=%s device=%s backend=%s kv_blocks=%d (block_size=%d) "
            "max_model_len=%d tensor_parallel_size=%d",
            self.source.name,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.attention_backend,
            num_blocks,
            cc.block_size,
            self.max_model_len,
            config.parallel.tensor_parallel_size,
        )

    # ------------------------------------------------------------------ requests in
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; see `minivllm.inputs.process_prompt`."""
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM's name): they apply to
        every field a request leaves unset."""
        return dict(self._diff_sampling_param)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request: sampling (SamplingParams, vLLM's defaults or the model's when None) or
        a beam search (BeamSearchParams)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        beam = BeamState(params) if isinstance(params, BeamSearchParams) else None
        if isinstance(params, BeamSearchParams):
            params = params.sampling_params()
        params = params or SamplingParams(**self._diff_sampling_param)
        max_num_seqs = self.config.scheduler.max_num_seqs
        if beam is not None and beam.params.beam_width > max_num_seqs:
            width = beam.params.beam_width
            raise ValueError(
                f"beam_width must be at most max_num_seqs ({max_num_seqs}), got {width}"
            )
        if self.config.cache.kv_allocation != "paged" and (params.n > 1 or beam is not None):
            raise ValueError(
                f"n > 1 and beam search need kv_allocation='paged' (forked sequences share "
                f"blocks), got kv_allocation={self.config.cache.kv_allocation!r}"
            )
        if params.n > max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs ({max_num_seqs}), got {params.n}")
        if self._extra_eos_token_ids and not params.ignore_eos:
            # Every EOS of generation_config.json stops, reported as a stop token (as vLLM does).
            stops = set(params.stop_token_ids or []) | self._extra_eos_token_ids
            params = dataclasses.replace(params, stop_token_ids=sorted(stops))
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter, to leave room for at least one output token"
            )
        request = Request(request_id, text, ids, params, beam=beam)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        request.seqs.append(self._new_seq(request, 0))
        self.requests[request_id] = request
        self.scheduler.add_seq(request.seqs[0])
        return request

    def _new_seq(self, request: Request, index: int) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None and not params.is_greedy:
            # A seeded request owns its generator, so its samples do not depend on the batch.
            # vLLM's rule for n > 1: sample i uses seed + i.
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        self._next_seq_id += 1
        return Sequence(
            seq_id=self._next_seq_id,
            request=request,
            index=index,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            # A beam's text is decoded once, at the end of the search.
            detokenizer=None if request.beam else self.output_processor.make_detokenizer(request),
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; every KV block they hold is freed. Unknown ids are ignored. Their
        final outputs come out of the next `step()`."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._aborted_outputs.append(make_request_output(request))

    def take_aborted_outputs(self) -> list[RequestOutput]:
        """The final outputs of requests aborted since the last step (which would return them)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after new weights, say). False, with nothing changed, while
        a request still holds a cached block (vLLM's `reset_prefix_cache`)."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at interpreter exit);
        an engine with workers cannot step afterwards."""
        self.executor.shutdown()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One iteration (paper §4.5): schedule, run the model, sample, commit, process outputs.
        Returns the outputs of every request that progressed or ended."""
        outputs = self.take_aborted_outputs()
        sched = self.scheduler.schedule()
        self._track_memory()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        try:
            logits = self.executor.execute_model(sched)
            seqs, forks, sampled = self._sample(sched, logits)
            self.scheduler.update_after_step(sched)  # the commit: progress, final cache names
            outputs += self._process_outputs(seqs, forks, sampled)
        except BaseException as exc:  # Ctrl-C too: the step's requests cannot be trusted
            return outputs + self._fail_step(sched, exc)
        if self.step_recorder is not None:
            self.step_recorder.record_step(self, sched, seqs)
        return outputs

    def _sample(
        self, sched: SchedulerOutput, logits: torch.Tensor | None
    ) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]], SamplerOutput | None]:
        """One batched sampler call for the step. An n > 1 request's first sample draws n tokens
        from the same logits row: one per sequence it is about to fork into."""
        sampling = [self.scheduler.seqs[s.seq_id] for s in sched.scheduled if s.sample]
        if logits is None:
            return [], [], None
        seqs: list[Sequence] = []
        forks: list[tuple[Sequence, Sequence]] = []
        row_index: list[int] = []  # which logits row each sampled sequence reads
        for i, seq in enumerate(sampling):
            req = seq.request
            children = []
            if req.params.n > 1 and not req.forked:
                children = [self._new_seq(req, index) for index in range(1, req.params.n)]
                forks += [(seq, child) for child in children]
            for s in (seq, *children):
                seqs.append(s)
                row_index.append(i)
        if len(row_index) != len(sampling):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        rows = [
            SamplingRow(
                s.request.params,
                s.prompt_token_ids,
                s.output_token_ids,
                s.generator,
                self.eos_token_id,
            )
            for s in seqs
        ]
        meta = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        return seqs, forks, self.sampler(logits, meta)

    def _process_outputs(
        self,
        seqs: list[Sequence],
        forks: list[tuple[Sequence, Sequence]],
        sampled: SamplerOutput | None,
    ) -> list[RequestOutput]:
        for parent, child in forks:  # after the commit: children share what the step completed
            req = parent.request
            self.scheduler.fork_seq(parent if not req.forked else req.seqs[-1], child)
            req.forked = True
            req.seqs.append(child)
        if sampled is None:
            return []
        self.num_generated_tokens += len(seqs)
        lists = sampled.tolist()
        beam_rows = [j for j, s in enumerate(seqs) if s.request.beam is not None]
        outputs = self.beam_search.process([seqs[j] for j in beam_rows], lists, beam_rows)
        for out in outputs:
            self.requests.pop(out.request_id, None)
        rows = [j for j, s in enumerate(seqs) if s.request.beam is None]
        processed = self.output_processor.process([seqs[j] for j in rows], lists, rows)
        for seq, status in processed.finished:
            self._finish(seq, status)
        outputs += [make_request_output(req) for req in processed.touched]
        for req in processed.touched:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish_seq(seq, status)
        self.output_processor.mark_finished(seq, status)

    def _fail_step(self, sched: SchedulerOutput, exc: BaseException) -> list[RequestOutput]:
        """Withdraw the prefix-cache names the step gave, then fail every request it carried and
        free all their blocks: no later request can hit a block whose K/V the step may not have
        written, and nothing else needs undoing (no whole-cache reset). An exception is logged
        and the engine serves on; KeyboardInterrupt and the like are re-raised as themselves."""
        self.scheduler.rollback_step()
        failed: dict[str, Request] = {}
        for item in sched.scheduled:
            seq = self.scheduler.seqs.get(item.seq_id)
            if seq is not None:
                failed[seq.request.request_id] = seq.request
        for req in failed.values():
            req.error = f"{type(exc).__name__}: {exc}"
            for seq in req.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ERROR)
            self.requests.pop(req.request_id, None)
        if not isinstance(exc, Exception):
            raise exc
        logger.exception("engine step failed")
        return [make_request_output(r) for r in failed.values()]

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Record a request that could not be admitted as failed (the offline API's too-long prompt)."""
        request.error = message
        if not request.seqs:
            request.seqs.append(self._new_seq(request, 0))
        seq = request.seqs[0]
        seq.status = SequenceStatus.FINISHED_ERROR
        seq.finish_reason = "error"
        return make_request_output(request)

    # ------------------------------------------------------------------ stats
    def _track_memory(self) -> None:
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
            self.peak_slot_utilization = bm.get_stats().kv_slot_utilization

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.get_stats()
        return EngineStats(
            num_kv_blocks=bm.num_total_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            num_cached_kv_blocks=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_total_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            num_prefix_cache_queries=bm.prefix_cache_queries,
            num_prefix_cache_hit_tokens=bm.prefix_cache_hits,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            peak_kv_blocks_used=self.peak_blocks_used,
            kv_slot_utilization=bm.kv_slot_utilization,
            peak_kv_slot_utilization=self.peak_slot_utilization,
            num_reserved_kv_slots=bm.num_reserved_slots,
            num_filled_kv_slots=bm.num_filled_slots,
            kv_internal_fragmentation_slots=bm.internal_fragmentation_slots,
            kv_external_fragmentation=bm.external_fragmentation,
        )
