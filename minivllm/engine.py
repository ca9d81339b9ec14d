"""LLMEngine: requests in, one scheduled batch per `step()`, streaming `RequestOutput`s out.

vLLM's `LLMEngine` (vllm/v1/engine/llm_engine.py) without the process boundaries. One step is the
life of the data in DESIGN.md: schedule -> copy-on-write copies -> prepare inputs -> run model ->
sample -> postprocess (append tokens, detokenize, check stops, free finished sequences' blocks).

Parallel sampling (`n > 1`) follows the paper's §4.4: the prompt is computed once by the first
sequence; when its first token is sampled, it is forked into n sequences that share every prompt
block, and the block manager copies a shared block only when one of them writes into it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from minivllm.attention import get_attention_backend, resolve_backend_name
from minivllm.block_manager import BlockManager
from minivllm.config import EngineConfig
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.inputs import PromptType, process_prompt
from minivllm.model.loader import (
    build_model,
    load_config,
    load_state_dict,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from minivllm.model_runner import ModelRunner, determine_num_blocks
from minivllm.outputs import RequestOutput, make_request_output
from minivllm.sampler import Sampler, SamplingMetadata, SamplingRow
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler, SchedulerOutput
from minivllm.sequence import Logprob, Request, Sequence, SequenceStatus
from minivllm.stats import EngineStats
from minivllm.stop_checker import check_stop

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
    def __init__(self, config: EngineConfig) -> None:
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
        state = load_state_dict(self.source, model_config)
        self.model = build_model(
            model_config, state, backend, self.dtype, self.device, self.max_model_len
        )
        cc = config.cache
        num_blocks = determine_num_blocks(self.model, cc, self.dtype, self.device)
        capacity = num_blocks * cc.block_size
        if self.max_model_len > capacity:
            if mc.max_model_len is not None:
                raise ValueError(
                    f"max_model_len ({self.max_model_len}) is larger than the KV cache holds "
                    f"({num_blocks} blocks x {cc.block_size} = {capacity} tokens)"
                )
            logger.warning("max_model_len lowered to the KV cache's %d tokens", capacity)
            self.max_model_len = capacity
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, self.dtype, self.device)
        self.sampler = Sampler()
        self.eos_token_id: int | None = (
            self.tokenizer.eos_token_id
            if self.tokenizer is not None
            else next(iter(model_config.eos_token_ids), None)
        )
        self.vocab_size = self.model.config.vocab_size
        self.requests: dict[str, Request] = {}
        # Unseeded random sampling draws from torch's global generator, in one batched call per
        # step; seeding it here makes a whole offline run reproducible (vLLM does the same).
        torch.manual_seed(mc.seed)
        self._next_seq_id = 0
        self._aborted_outputs: list[RequestOutput] = []
        # Counters behind get_stats().
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.peak_blocks_used = 0
        self.peak_slot_utilization = 1.0
        logger.info(
            "minivllm engine: model=%s dtype=%s device=%s backend=%s kv_blocks=%d (block_size=%d) "
            "max_model_len=%d",
            self.source.name,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.attention_backend,
            num_blocks,
            cc.block_size,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ requests in
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; see `minivllm.inputs.process_prompt`."""
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter, to leave room for at least one output token"
            )
        request = Request(request_id, text, ids, params)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        request.seqs.append(self._new_seq(request, 0, list(ids)))
        self.requests[request_id] = request
        self.scheduler.add_seq(request.seqs[0])
        return request

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None and not params.is_greedy:
            # A seeded request owns its generator, so its samples do not depend on the batch.
            # vLLM's rule for n > 1: sample i uses seed + i.
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params, self.eos_token_id
            )
        self._next_seq_id += 1
        return Sequence(
            seq_id=self._next_seq_id,
            request=request,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            detokenizer=detok,
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; every KV block they hold is freed. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._aborted_outputs.append(make_request_output(request))

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM's name): they apply to
        every field a request leaves unset."""
        return {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request that progressed or ended."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        self._track_memory()
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        try:
            logits, sampled = self._run_model(sched)
            touched = self._sample_and_postprocess(logits, sampled) if sampled else []
        except Exception as exc:  # a failed step fails its requests; the engine keeps serving
            logger.exception("engine step failed")
            return outputs + self._fail_step(sched, exc)
        outputs += [make_request_output(r) for r in touched]
        for r in touched:
            if r.is_finished:
                self.requests.pop(r.request_id, None)
        return outputs

    def _run_model(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        self.runner.copy_blocks(sched.block_copies)
        tables = [self.block_manager.get_block_table(s.seq.seq_id) for s in sched.scheduled]
        inp = self.runner.prepare_inputs(sched, tables)
        logits = self.runner.execute_model(inp)
        for item in sched.scheduled:
            start, seq = item.seq.num_computed_tokens, item.seq
            self.num_prompt_tokens_computed += max(
                0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start
            )
        self.scheduler.update_after_step(sched)
        return logits, inp.sampled_seqs

    def _sample_and_postprocess(
        self, logits: torch.Tensor | None, sampled: list[Sequence]
    ) -> list[Request]:
        assert logits is not None
        rows: list[SamplingRow] = []
        row_seqs: list[Sequence] = []
        row_index: list[int] = []  # which logits row each sampling row reads
        for i, seq in enumerate(sampled):
            for s in self._fork_if_needed(seq):
                rows.append(
                    SamplingRow(
                        s.request.params,
                        s.prompt_token_ids,
                        s.output_token_ids,
                        s.generator,
                        self.eos_token_id,
                    )
                )
                row_seqs.append(s)
                row_index.append(i)
        if len(row_index) != len(sampled):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        meta = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        out = self.sampler(logits, meta)
        tokens = out.sampled_token_ids.tolist()
        lp = out.logprobs
        lp_lists = None
        if lp is not None:
            lp_lists = (
                lp.logprob_token_ids.tolist(),
                lp.logprobs.tolist(),
                lp.sampled_logprobs.tolist(),
                lp.sampled_token_ranks.tolist(),
            )
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for j, (seq, token) in enumerate(zip(row_seqs, tokens)):
            seq.token_ids.append(token)
            self.num_generated_tokens += 1
            if lp_lists is not None and seq.logprobs is not None:
                self._record_logprobs(seq, token, j, lp_lists)
            self._postprocess_token(seq, token)
            req = seq.request
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            touched[req.request_id] = req
        return list(touched.values())

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """At its first sample, the first sequence of an n > 1 request becomes n sequences."""
        req = seq.request
        if req.forked or req.params.n == 1:
            return [seq]
        req.forked = True
        children: list[Sequence] = []
        for index in range(1, req.params.n):
            child = self._new_seq(req, index, list(seq.token_ids))
            child.num_computed_tokens = seq.num_computed_tokens
            child.num_cached_tokens = seq.num_cached_tokens
            self.block_manager.fork(seq.seq_id, child.seq_id)
            self.scheduler.add_running_fork(seq if not children else children[-1], child)
            req.seqs.append(child)
            children.append(child)
        return [seq, *children]

    def _record_logprobs(self, seq: Sequence, token: int, j: int, lp: tuple[list, ...]) -> None:
        top_ids, top_lps, sampled_lp, ranks = lp
        k = seq.request.params.logprobs or 0
        entry = {token: Logprob(sampled_lp[j], ranks[j], self._decode_one(token))}
        for tid, val, rank in zip(top_ids[j][:k], top_lps[j][:k], range(1, k + 1)):
            entry.setdefault(tid, Logprob(val, rank, self._decode_one(tid)))
        assert seq.logprobs is not None
        seq.logprobs.append(entry)
        seq.cumulative_logprob += sampled_lp[j]

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode([token_id]))

    def _postprocess_token(self, seq: Sequence, token: int) -> None:
        stop_str = None
        if seq.detokenizer is not None:
            seq.detokenizer.append([token])
            stop_str = seq.detokenizer.stop_string_matched
        stop = check_stop(
            seq.output_token_ids,
            seq.request.params,
            self.eos_token_id,
            stop_str,
            seq.num_tokens,
            self.max_model_len,
        )
        if stop is not None:
            seq.finish_reason, seq.stop_reason = stop
            status = (
                SequenceStatus.FINISHED_STOPPED
                if stop[0] == "stop"
                else SequenceStatus.FINISHED_LENGTH
            )
            self._finish(seq, status)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish_seq(seq, status)
        seq.finish_reason = seq.finish_reason or status.value
        if seq.detokenizer is not None and not seq.detokenizer.finished:
            seq.detokenizer.finish()
        if seq.request.is_finished:
            seq.request.finished_time = time.monotonic()

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        failed = {item.seq.request.request_id: item.seq.request for item in sched.scheduled}
        for req in failed.values():
            req.error = f"{type(exc).__name__}: {exc}"
            for seq in req.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ERROR)
            self.requests.pop(req.request_id, None)
        # Blocks hashed this step may hold K/V that was never written: forget the cached prefixes.
        self.block_manager.reset_prefix_cache()
        return [make_request_output(r) for r in failed.values()]

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Record a request that could not be admitted as failed (the offline API's too-long prompt)."""
        request.error = message
        seq = (
            request.seqs[0]
            if request.seqs
            else self._new_seq(request, 0, list(request.prompt_token_ids))
        )
        if not request.seqs:
            request.seqs.append(seq)
        seq.status = SequenceStatus.FINISHED_ERROR
        seq.finish_reason = "error"
        return make_request_output(request)

    # ------------------------------------------------------------------ outputs and stats
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
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_prefix_cache_queries=bm.prefix_cache_queries,
            num_prefix_cache_hit_tokens=bm.prefix_cache_hits,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            peak_kv_blocks_used=self.peak_blocks_used,
            kv_slot_utilization=bm.kv_slot_utilization,
            peak_kv_slot_utilization=self.peak_slot_utilization,
        )
