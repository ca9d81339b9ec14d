"""From sampled token ids to what a caller sees: text, stops, logprobs, finish reasons.

vLLM v1 gives this its own class (`vllm/v1/engine/output_processor.py`), apart from scheduling
and from running the model: it is pure bookkeeping on the host, per sequence, after the step's
tokens are known. For every sequence that sampled a token this step it:

1. appends the token (and, if asked, its logprob and the top-k candidates, decoded);
2. feeds it to the sequence's incremental detokenizer, which holds back text that may still turn
   into a stop string;
3. advances the sequence's grammar matcher, if it has one (structured outputs): only here, after
   the step committed, so a step that fails leaves every matcher where it was;
4. checks the stop conditions (`stop_checker.py`): EOS, stop token ids, stop strings, max_tokens,
   max_model_len — and a grammar that is complete (it accepted a stop token) ends it with "stop".

It never frees blocks: it reports which sequences finished, and the engine tells the scheduler,
the only owner of the KV bookkeeping (see "one engine step" on the docs' architecture page).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from minivllm.core.sequence import Logprob, Request, Sequence, SequenceStatus
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.stop_checker import check_stop
from minivllm.sample.sampler import LogprobsTensors, SampledLists


@dataclass
class ProcessedStep:
    touched: list[Request] = field(default_factory=list)  # requests that got a token, in order
    finished: list[tuple[Sequence, SequenceStatus]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_id: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer  # None with skip_tokenizer_init: token ids only, no text
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len

    def make_detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params, self.eos_token_id
        )

    def process(self, seqs: Seq[Sequence], sampled: SampledLists, rows: Seq[int]) -> ProcessedStep:
        """`seqs[i]` sampled row `rows[i]` of the step's sampler output."""
        now = time.monotonic()
        step = ProcessedStep()
        touched: dict[str, Request] = {}
        done: set[int] = set()  # a sequence keeps several tokens after verifying drafts:
        for seq, j in zip(seqs, rows):  # one that stops at one of them takes none after it
            if seq.seq_id in done:
                continue
            token = sampled.token_ids[j]
            seq.token_ids.append(token)
            if seq.grammar is not None:
                # The mask allowed only tokens the grammar accepts; `sync` catches up otherwise.
                seq.grammar.accept_tokens([token])
            if sampled.top_ids is not None and seq.logprobs is not None:
                self._record_logprobs(seq, token, j, sampled)
            status = self._check_stop(seq, token)
            if status is not None:
                step.finished.append((seq, status))
                done.add(seq.seq_id)
            req = seq.request
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            touched[req.request_id] = req
        step.touched = list(touched.values())
        return step

    def mark_finished(self, seq: Sequence, status: SequenceStatus) -> None:
        """The output side of finishing: the reason, the held-back text, the request's end time."""
        seq.finish_reason = seq.finish_reason or status.value
        if seq.detokenizer is not None and not seq.detokenizer.finished:
            seq.detokenizer.finish()
        if seq.request.is_finished:
            seq.request.finished_time = time.monotonic()

    # ------------------------------------------------------------------ helpers
    def _record_logprobs(self, seq: Sequence, token: int, j: int, lp: SampledLists) -> None:
        top_ids, top_lps, sampled_lp, ranks = (
            lp.top_ids,
            lp.top_logprobs,
            lp.sampled_logprobs,
            lp.sampled_ranks,
        )
        assert (
            top_ids is not None
            and top_lps is not None
            and sampled_lp is not None
            and ranks is not None
        )
        k = seq.request.params.logprobs or 0
        entry = {token: Logprob(sampled_lp[j], ranks[j], self.decode_one(token))}
        for tid, val, rank in zip(top_ids[j][:k], top_lps[j][:k], range(1, k + 1)):
            entry.setdefault(tid, Logprob(val, rank, self.decode_one(tid)))
        assert seq.logprobs is not None
        seq.logprobs.append(entry)
        seq.cumulative_logprob += sampled_lp[j]

    def record_prompt_logprobs(self, request: Request, scored: LogprobsTensors) -> None:
        """A step's scored prompt rows, appended to the request's prompt logprobs (vLLM's entry:
        the prompt token first, with its rank, then the top k by rank)."""
        assert request.prompt_logprobs is not None
        ids, lps, target_lps, ranks = (t.tolist() for t in scored)
        start = len(request.prompt_logprobs)
        for r, target in enumerate(request.prompt_token_ids[start : start + len(ranks)]):
            entry = {target: Logprob(target_lps[r], ranks[r], self.decode_one(target))}
            for rank, (tid, val) in enumerate(zip(ids[r], lps[r]), start=1):
                entry.setdefault(tid, Logprob(val, rank, self.decode_one(tid)))
            request.prompt_logprobs.append(entry)

    def decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode([token_id]))

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
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
        if stop is None and seq.grammar is not None and seq.grammar.is_terminated():
            stop = ("stop", None)  # the structure is complete (e.g. EOS under ignore_eos)
        if stop is None:
            return None
        seq.finish_reason, seq.stop_reason = stop
        if stop[0] == "stop":
            return SequenceStatus.FINISHED_STOPPED
        return SequenceStatus.FINISHED_LENGTH
