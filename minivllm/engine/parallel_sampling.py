"""What a sample does to its request: one hook between the sampler and the outputs.

Most requests take each sampled token as it is: append it, check the stops, stream the text
(`output_processor.py`). Two kinds of request change their set of sequences instead, and both
do it through this one hook, so the engine's step has no branch for either:

- parallel sampling (`n > 1`, paper §4.4): the prompt is computed once; its first sample draws
  n tokens from the same logits row, one per sequence it then forks into (`ParallelSampling`);
- beam search (`minivllm/engine/beam_search.py`): each beam samples its candidates; once every live
  beam has, the best `beam_width` extensions survive by forking, extending and pruning beams.

An `AfterSampling` is chosen per request when it is added (vLLM v0 kept the same split in its
per-sequence-group output processors): `SamplingParams` get the engine's one `ParallelSampling`;
any other parameters object brings its own hook (`RequestParams.make_after_sampling`), which
keeps its state (a beam search's candidates and finished beams) off `Request` and `Sequence`.
Both sides of a step call it: `sequences_to_sample` before the sampler (which sequences draw from a row),
`process` after the commit (forks share the blocks the step completed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from minivllm.core.outputs import RequestOutput, make_request_output
from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import Request, Sequence, SequenceStatus
from minivllm.engine.output_processor import OutputProcessor
from minivllm.sample.sampler import SampledLists
from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestContext:
    """What a hook may use of the engine: the scheduler (the only owner of the KV bookkeeping),
    the output processor, and the engine's ways to make and finish a sequence."""

    scheduler: Scheduler
    output_processor: OutputProcessor
    new_seq: Callable[[Request, int], Sequence]  # (request, index) -> a sequence of the prompt
    finish: Callable[[Sequence, SequenceStatus], None]  # frees its blocks, ends its output
    eos_token_ids: frozenset[int]
    max_num_seqs: int  # the scheduler's limit: no request may need more sequences at once


class AfterSampling(Protocol):
    streams_text: (
        bool  # its sequences get an incremental detokenizer (a beam's text comes at the end)
    )

    def sequences_to_sample(self, seq: Sequence) -> list[Sequence]:
        """The sequences that draw a token from `seq`'s logits row this step (`seq` first)."""
        ...

    def process(
        self, seqs: list[Sequence], sampled: SampledLists, rows: list[int]
    ) -> list[RequestOutput]:
        """After the step's commit: `seqs[i]` drew row `rows[i]` of `sampled`. Returns the
        outputs of the requests that progressed or ended (`finished` ones leave the engine)."""
        ...


class RequestParams(Protocol):
    """Parameters other than `SamplingParams` that `add_request` takes (`BeamSearchParams`)."""

    @property
    def max_num_seqs(self) -> int:
        """The most sequences the request runs at once (what admission counts it as)."""
        ...

    def sampling_params(self) -> SamplingParams:
        """What each of the request's sequences asks the sampler for."""
        ...

    def make_after_sampling(self, ctx: RequestContext) -> AfterSampling:
        """This request's own hook (it may refuse the request with a ValueError)."""
        ...


class ParallelSampling:
    """Ordinary sampling, n >= 1: one hook for all such requests, so their outputs are processed
    in one batch."""

    streams_text = True

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx

    def sequences_to_sample(self, seq: Sequence) -> list[Sequence]:
        req = seq.request
        if req.params.n == 1 or req.forked:
            return [seq]
        # vLLM's index rule: sample i is the request's i-th sequence (and seeds with seed + i).
        return [seq, *(self.ctx.new_seq(req, index) for index in range(1, req.params.n))]

    def process(
        self, seqs: list[Sequence], sampled: SampledLists, rows: list[int]
    ) -> list[RequestOutput]:
        scheduler = self.ctx.scheduler
        for seq in seqs:
            if (
                seq.seq_id not in scheduler.seqs
            ):  # a child `sequences_to_sample` drew for: it forks now
                req = seq.request
                scheduler.fork_seq(req.seqs[-1], seq)  # any sibling: they share every block
                req.seqs.append(seq)
                req.forked = True
        processed = self.ctx.output_processor.process(seqs, sampled, rows)
        for seq, status in processed.finished:
            self.ctx.finish(seq, status)
        return [make_request_output(req) for req in processed.touched]
