"""LLMEngine: requests in, one scheduled batch per `step()`, streaming `RequestOutput`s out.

vLLM's `LLMEngine` (vllm/v1/engine/llm_engine.py) without the process boundaries. One `step()` is
the paper's one iteration (§4.5), in the order of "one engine step" on the docs' architecture page:

    schedule -> run the model -> sample -> commit (progress, prefix-cache hashes)
             -> process outputs -> publish the step to its listeners

The engine only orchestrates: its configuration was resolved before it (`EngineArgs.
create_engine_config`), the scheduler owns the KV bookkeeping, the model runner owns the KV
tensors, the sampler picks tokens, and each request's hook after sampling (`after_sampling.py`:
plain and `n > 1` sampling, or a beam search) turns them into outputs. Whoever wants to see the
steps (the engine's counters, the step trace) listens (`step_listener.py`).

With pipeline stages the run and the rest of a step come apart: the engine keeps
`max_concurrent_batches` (one per stage) batches in flight, and a step commits the oldest one
(vLLM v1's batch queue; "Pipeline parallelism" in docs/distributed.md).

A step that raises (an exception, or Ctrl-C inside the model) fails the requests it carried and
frees their blocks; the prefix-cache names it gave are withdrawn (final only when a step commits).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from minivllm.attention.selector import get_attention_backend
from minivllm.config import EngineConfig
from minivllm.core.kv_cache_groups import kv_cache_windows
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import RequestOutput, make_request_output
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Request, Sequence, SequenceStatus
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import (
    AfterSampling,
    ParallelSampling,
    RequestContext,
    RequestParams,
)
from minivllm.engine.stats import EngineStats, StatsCollector
from minivllm.engine.step_listener import StepListener, StepOutputs
from minivllm.executor.abstract import Executor, PipelinedExecutor, make_executor
from minivllm.inputs import PromptType
from minivllm.lora.errors import LoRADisabledError, LoRAError
from minivllm.lora.manager import AddLoRA, RemoveLoRAs
from minivllm.lora.request import LoRARequest
from minivllm.model.loader import load_tokenizer
from minivllm.platforms import resolve_obj_by_qualname
from minivllm.pooling.pooler import finish_pooled
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.worker.model_runner import ModelRunnerOutput, kv_cache_torch_dtype

if TYPE_CHECKING:
    from minivllm.engine.speculator import Speculator

logger = logging.getLogger("minivllm")


class InFlightBatch(NamedTuple):
    """A batch launched on the executor and not yet committed."""

    sched: SchedulerOutput
    output: Future[ModelRunnerOutput]  # the last stage's output, when it comes back


SPECULATOR = "minivllm.engine.speculator.Speculator"  # loaded only when speculating


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        kv_cache_manager_cls: type[KVCacheManager] | None = None,
    ) -> None:
        """`executor` (the simulated-time one of minivllm/experiments/, say) runs the steps
        instead of a model loaded here; `kv_cache_manager_cls` replaces the class the cache config
        names (how the paper's reservation baselines plug in)."""
        self.config = config
        mc, cc, resolved = config.model, config.cache, config.resolved
        self.device, self.dtype, self.source = resolved.device, resolved.dtype, resolved.source
        self.tokenizer: Any = (
            None if mc.skip_tokenizer_init else load_tokenizer(self.source, mc.tokenizer)
        )
        backend = get_attention_backend(mc.attention_backend, self.device)
        self.attention_backend = backend.name  # "auto" resolved, after any fallback
        self.max_model_len = resolved.max_model_len
        self.pooler = config.pooler  # a pooling model's pooler (minivllm/pooling/); None: generate
        # The model runner in this process (tensor_parallel_size 1), or rank 0's of N ranks that
        # each hold 1/N of the model and get every step (paper §4.6; minivllm/distributed/).
        self.executor = executor or make_executor(config, backend)
        self.runner = self.executor.driver_runner
        self.model = self.runner.model  # rank 0's shard (of pipeline stage 0) with several ranks
        self.kv_cache_dtype = kv_cache_torch_dtype(cc.cache_dtype, self.dtype)  # "auto": dtype
        num_blocks = self.executor.num_blocks  # the same on every rank: the smallest any can hold
        # The windows name the KV cache manager (`CacheConfig.kv_cache_manager_cls`).
        cc.sliding_window, cc.layer_sliding_windows = kv_cache_windows(self.model)
        manager_cls = kv_cache_manager_cls or resolve_obj_by_qualname(cc.kv_cache_manager_cls)
        budget = config.scheduler.max_num_batched_tokens  # a windowed group holds a chunk too
        self._fit_max_model_len(num_blocks, manager_cls.max_num_tokens(cc, num_blocks, budget))
        self.kv_cache_manager = manager_cls.from_config(cc, num_blocks, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, config.lora)
        # Unseeded random sampling draws from the engine's own generator, seeded by `seed`: a
        # whole offline run is reproducible, and torch's global RNG stays the user's.
        self.generator = torch.Generator(device=self.device).manual_seed(mc.seed)
        self.sampler = Sampler(self.generator)
        self.eos_token_id: int | None = (
            self.tokenizer.eos_token_id
            if self.tokenizer is not None
            else next(iter(resolved.hf_config.eos_token_ids), None)
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_id, self.max_model_len
        )
        self.vocab_size = self.model.config.vocab_size
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            config,
            resolved.generation,
            self.eos_token_id,
        )
        self.request_context = RequestContext(
            self.scheduler,
            self.output_processor,
            self._new_seq,
            self._finish,
            self.input_processor.eos_token_ids,
            config.scheduler.max_num_seqs,
        )
        self.parallel_sampling = ParallelSampling(self.request_context)
        self.requests: dict[str, Request] = {}
        self.lora_requests: dict[int, LoRARequest] = {}  # every adapter added, by lora_int_id
        # Adapters removed while requests still ran under them: dropped once the last one ends.
        self._loras_to_remove: set[int] = set()
        self.after_sampling: dict[str, AfterSampling] = {}  # request_id -> its hook
        self._next_seq_id = 0
        self._aborted_outputs: list[RequestOutput] = []
        # vLLM's `max_concurrent_batches`: pipeline_parallel_size with pipeline stages (each stage
        # works on a different batch), else 1. The batches launched and not yet committed, the
        # newest first (vLLM's `batch_queue`).
        self.max_concurrent_batches: int = getattr(self.executor, "max_concurrent_batches", 1)
        self.batch_queue: deque[InFlightBatch] = deque()
        # Who hears of every committed step: the counters behind get_stats(), then any other.
        self.stats = StatsCollector(self.scheduler, self.kv_cache_manager)
        self.step_listeners: list[StepListener] = [self.stats]
        spec, make = config.speculative, resolve_obj_by_qualname  # minivllm/spec_decode/, if set
        self.speculator: Speculator | None = make(SPECULATOR)(spec, self) if spec else None
        self._log_start(num_blocks)

    @functools.cached_property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Compiles each constraint once (at add_request) and hands out matchers; built at first
        use, so that an engine that never sees a constrained request never builds it (nor loads
        xgrammar, which the manager imports at its first grammar)."""
        return StructuredOutputManager(
            self.tokenizer,
            self.vocab_size,
            sorted(self.input_processor.eos_token_ids),
            self.config.structured_outputs,
        )

    def _log_start(self, num_blocks: int) -> None:
        logger.info(
            "minivllm engine: model=%s dtype=%s device=%s backend=%s kv_blocks=%d (block_size=%d, "
            "kv_cache_dtype=%s) max_model_len=%d tensor_parallel_size=%d pipeline_parallel_size=%d",
            self.source.name,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.attention_backend,
            num_blocks,
            self.config.cache.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.max_model_len,
            self.config.parallel.tensor_parallel_size,
            self.config.parallel.pipeline_parallel_size,
        )

    def _fit_max_model_len(self, num_blocks: int, capacity: int) -> None:
        """A request must fit the KV cache: an unset max_model_len is lowered to it, a set one
        that does not fit is refused (and no worker outlives the refused engine)."""
        if self.max_model_len <= capacity:
            return
        if self.config.model.max_model_len is not None:
            self.executor.shutdown()
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than a request the KV cache holds "
                f"({capacity} tokens in {num_blocks} blocks of {self.config.cache.block_size})"
            )
        logger.warning("max_model_len lowered to the KV cache's %d tokens", capacity)
        self.max_model_len = capacity

    def add_step_listener(self, listener: StepListener) -> None:
        """Tell `listener` of every committed step from now on (`step_listener.py`)."""
        self.step_listeners.append(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        if listener in self.step_listeners:
            self.step_listeners.remove(listener)

    # ------------------------------------------------------------------ requests in
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; see `minivllm.inputs.process_prompt`."""
        return self.input_processor.tokenize_prompt(prompt)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM's name): they apply to
        every field a request leaves unset."""
        return dict(self.input_processor.sampling_defaults)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | RequestParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a request: sampling (SamplingParams, vLLM's defaults or the model's when None),
        parameters that bring their own hook after sampling (`BeamSearchParams`), or, for a
        pooling model, `PoolingParams` (None: the pooler's defaults); under a LoRA adapter
        (`lora_request`, read and checked now) or the base model (None)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.pooler is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request is not supported for pooling requests")
            return self._add_pooling_request(request_id, prompt, params, arrival_time)
        if lora_request is not None:
            self.add_lora(lora_request)  # a bad adapter is refused here, before anything changes
        hook: AfterSampling = self.parallel_sampling
        width = 0  # the request's sequences at once; 0: its n
        if params is not None and not isinstance(params, SamplingParams):
            hook = params.make_after_sampling(self.request_context)  # it may refuse the request
            width, params = params.max_num_seqs, params.sampling_params()
        forks = (params is not None and params.n > 1) or hook is not self.parallel_sampling
        if forks:
            self.kv_cache_manager.check_forks_allowed()  # refused when added, not at the fork
        request = self.input_processor.process_inputs(
            request_id, prompt, params, width, arrival_time
        )
        request.lora_request = lora_request
        self.after_sampling[request_id] = hook
        try:
            seq = self._new_seq(request, 0)  # compiles a grammar: an invalid one raises here
        except BaseException:
            del self.after_sampling[request_id]  # nothing of a refused request stays behind
            raise
        self.requests[request_id] = request
        request.seqs.append(seq)
        self.scheduler.add_seq(seq)
        return request

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | RequestParams | PoolingParams | None,
        arrival_time: float | None,
    ) -> Request:
        """Queue a prefill-only request (minivllm/pooling/): a pooling model takes nothing else,
        and a generating model takes none."""
        pools = params is None or isinstance(params, PoolingParams)
        self.check_runner("pooling" if pools else "generate")
        assert self.pooler is not None
        pooling = params if isinstance(params, PoolingParams) else PoolingParams()
        request = self.input_processor.process_pooling_inputs(
            request_id, prompt, pooling, self.pooler, arrival_time
        )
        self.after_sampling[request_id] = self.parallel_sampling
        seq = self._new_seq(request, 0)
        self.requests[request_id] = request
        request.seqs.append(seq)
        self.scheduler.add_seq(seq)
        return request

    def check_runner(self, runner: str) -> None:
        """Refuse a request the model's runner does not serve, naming both (vLLM's wording)."""
        if runner == "generate" and self.pooler is not None:
            raise ValueError(
                f"this model runs with runner='pooling' (task {self.pooler.task!r}): it does "
                "not generate; use LLM.embed / LLM.score (or /v1/embeddings), or load it with "
                "runner='generate'"
            )
        if runner == "pooling" and self.pooler is None:
            raise ValueError(
                "this model runs with runner='generate': embeddings and scores need a pooling "
                "model; load it with runner='pooling' (convert='embed', or vLLM's task='embed')"
            )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into every rank's host memory (vLLM's `add_lora`); a later
        request of it then starts without reading its files. Raises a `LoRAError` that names what
        is wrong (minivllm/lora/errors.py); `LoRADisabledError` without `enable_lora`."""
        if self.config.lora is None:
            raise LoRADisabledError(
                f"lora_request {lora_request.lora_name!r} was given, but LoRA is off: build the "
                "engine with enable_lora=True (--enable-lora)"
            )
        known = self.lora_requests.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise LoRAError(
                f"lora_int_id {lora_request.lora_int_id} is already the adapter "
                f"{known.lora_name!r} at {known.lora_path}; each adapter needs its own id"
            )

        errors = [e for e in self.executor.collective_rpc(AddLoRA(lora_request)) if e is not None]
        if errors:  # every rank read the same file: one refusal stands for all
            raise errors[0]
        self.lora_requests[lora_request.lora_int_id] = lora_request
        self._loras_to_remove.discard(lora_request.lora_int_id)  # added again: it stays
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's `remove_lora`); False if it was never added. A request
        already queued or running under it finishes on it: its slot and host copy go when the
        last such request ends (`_remove_unused_loras`), never under a running request."""
        if self.lora_requests.pop(lora_int_id, None) is None:
            return False
        self._loras_to_remove.add(lora_int_id)
        self._remove_unused_loras()
        return True

    def _remove_unused_loras(self) -> None:
        """Drop every removed adapter that no unfinished request runs under from every rank's
        slots and host memory."""
        in_use = {r.lora_int_id for r in self.requests.values() if r.lora_request is not None}
        unused = self._loras_to_remove - in_use
        if not unused:
            return
        self._loras_to_remove -= unused
        self.executor.collective_rpc(RemoveLoRAs(frozenset(unused)))

    def list_loras(self) -> list[LoRARequest]:
        """The adapters added and not removed (vLLM's `list_loras`)."""
        return list(self.lora_requests.values())

    def _new_seq(self, request: Request, index: int) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None and not params.is_greedy:
            # A seeded request owns its generator, so its samples do not depend on the batch.
            # vLLM's rule for n > 1: sample i uses seed + i.
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        self._next_seq_id += 1
        hook = self.after_sampling.get(request.request_id, self.parallel_sampling)
        return Sequence(
            seq_id=self._next_seq_id,
            request=request,
            index=index,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            detokenizer=(
                self.output_processor.make_detokenizer(request) if hook.streams_text else None
            ),
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
            # Compiled at the request's first sequence (cached: its other samples reuse it).
            grammar=self.structured_output_manager.new_grammar(params.structured_outputs)
            if params.structured_outputs is not None
            else None,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; every KV block they hold is freed. Unknown ids are ignored. Their
        final outputs come out of the next `step()`."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            request = self._forget(rid)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._aborted_outputs.append(make_request_output(request))

    def _forget(self, request_id: str) -> Request | None:
        self.after_sampling.pop(request_id, None)
        request = self.requests.pop(request_id, None)
        if request is not None and request.lora_int_id in self._loras_to_remove:
            self._remove_unused_loras()  # it may have been the adapter's last request
        return request

    def take_aborted_outputs(self) -> list[RequestOutput]:
        """The final outputs of requests aborted since the last step (which would return them)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after new weights, say). False, with nothing changed, while
        a request still holds a cached block (vLLM's `reset_prefix_cache`)."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or batches still in flight (vLLM's `has_work`): a batch whose
        requests were all aborted still comes back, and is dropped, in a later step."""
        return bool(self.requests or self.batch_queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at interpreter exit);
        an engine with workers cannot step afterwards."""
        self.executor.shutdown()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One iteration (paper §4.5): schedule, run the model, sample, commit, process outputs,
        publish. Returns the outputs of every request that progressed or ended.

        With pipeline stages a step launches one batch and commits the oldest batch in flight
        (vLLM v1's `step_with_batch_queue`): while fewer than `max_concurrent_batches` are in
        flight it returns at once after launching, so the next step schedules (and stage 0 runs)
        a new batch while the later stages still work on this one. With one batch at a time
        (one stage) each step launches a batch and commits it at once."""
        outputs = self.take_aborted_outputs()
        if self.speculator is not None:  # drafts for the running decodes, before the schedule
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            try:
                self.batch_queue.appendleft(self._launch(sched))
            except BaseException as exc:
                return outputs + self._fail_step(sched, exc)
            if len(self.batch_queue) < self.max_concurrent_batches:
                return outputs  # schedule the next batch before waiting for this one
        if not self.batch_queue:
            return outputs
        sched, pending = self.batch_queue.pop()  # the oldest batch in flight
        try:
            ran = pending.result()
            seqs, sampled, rejected = self._sample(sched, ran.logits)  # rejected drafts
            self.scheduler.update_after_step(sched, rejected)  # the commit: progress, cache names
            for seq_id, scored in ran.prompt_logprobs.items():
                seq = self.scheduler.seqs.get(seq_id)
                if seq is not None:  # not aborted while in flight
                    self.output_processor.record_prompt_logprobs(seq.request, scored)
            step_outputs = self._process_outputs(seqs, sampled)
            step_outputs += self._process_pooled(ran.pooled)
        except BaseException as exc:  # Ctrl-C too: the step's requests cannot be trusted
            return outputs + self._fail_step(sched, exc)
        self._publish(sched, seqs, step_outputs)
        return outputs + step_outputs

    def _launch(self, sched: SchedulerOutput) -> InFlightBatch:
        """Start `sched` on the executor: with several batches in flight it returns once stage 0
        has run it, with a future of the last stage's output; else with the output itself."""
        if self.max_concurrent_batches == 1:
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(self.executor.execute_model(sched))
            return InFlightBatch(sched, done)
        pipelined = cast(PipelinedExecutor, self.executor)  # max_concurrent_batches > 1 says so
        return InFlightBatch(sched, pipelined.execute_model(sched, non_block=True))

    def _sample(
        self, sched: SchedulerOutput, logits: torch.Tensor | None
    ) -> tuple[list[Sequence], SamplerOutput | None, dict[int, int]]:
        """One batched sampler call; an n > 1 request's first row is drawn once per fork."""
        if logits is None:
            return [], None, {}
        if self.speculator is not None and any(s.num_spec_tokens for s in sched.scheduled):
            return self.speculator.sample(sched, logits)  # the rejection sampler's
        seqs: list[Sequence] = []
        row_index: list[int] = []  # which logits row each sampled sequence reads
        sampling = [self.scheduler.seqs.get(s.seq_id) for s in sched.scheduled if s.sample]
        for i, seq in enumerate(sampling):
            if seq is None:  # aborted while its batch was in flight: its row is dropped
                continue
            drawn = self.after_sampling[seq.request.request_id].sequences_to_sample(seq)
            seqs += drawn
            row_index += [i] * len(drawn)
        if not row_index:
            return [], None, {}
        if row_index != list(range(len(sampling))):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        rows = [SamplingRow.of(s, self.eos_token_id) for s in seqs]
        meta = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        return seqs, self.sampler(logits, meta), {}

    def _process_outputs(
        self, seqs: list[Sequence], sampled: SamplerOutput | None
    ) -> list[RequestOutput]:
        """Hand each request's samples to its hook, one call per hook (all plain sampling in one
        batch), after the commit: forks share what the step completed."""
        if sampled is None:
            return []
        lists = sampled.tolist()
        by_hook: dict[int, tuple[AfterSampling, list[int]]] = {}
        for j, seq in enumerate(seqs):
            hook = self.after_sampling[seq.request.request_id]
            by_hook.setdefault(id(hook), (hook, []))[1].append(j)
        outputs: list[RequestOutput] = []
        for hook, rows in by_hook.values():
            outputs += hook.process([seqs[j] for j in rows], lists, rows)
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _process_pooled(self, pooled: dict[int, torch.Tensor]) -> list[RequestOutput]:
        """Each request whose prompt was pooled this step: its vector, finished per its
        `PoolingParams`; the request ends (its KV blocks freed) without a decode step."""
        outputs: list[RequestOutput] = []
        for seq_id, vector in pooled.items():
            seq = self.scheduler.seqs.get(seq_id)
            if seq is None:  # aborted while its batch was in flight
                continue
            request = seq.request
            assert request.pooling_params is not None and self.pooler is not None
            request.pooled = finish_pooled(vector, request.pooling_params, self.pooler).tolist()
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            outputs.append(make_request_output(request))
            self._forget(request.request_id)
        return outputs

    def _publish(
        self, sched: SchedulerOutput, seqs: list[Sequence], outputs: list[RequestOutput]
    ) -> None:
        in_flight = tuple(b.sched.batch_id for b in reversed(self.batch_queue))
        step = StepOutputs.after_commit(seqs, outputs, self.scheduler, in_flight)
        blocks = self.kv_cache_manager.snapshot()
        for listener in self.step_listeners:
            listener.on_step(sched, step, blocks)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish_seq(seq, status)
        self.output_processor.mark_finished(seq, status)
        seq.grammar = None  # a finished sequence samples no more: its matcher goes
        if self.speculator is not None:  # a draft model's cache may hold blocks for it
            self.speculator.free(seq)

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
            self._forget(req.request_id)
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

    def get_stats(self) -> EngineStats:
        return self.stats.get_stats()
