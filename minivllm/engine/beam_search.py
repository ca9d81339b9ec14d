"""Beam search on copy-on-write blocks: the paper's showcase of sharing (§4.4).

Beam search keeps the `beam_width` most likely continuations of a prompt. Each step, every beam
proposes its most likely next tokens; of all (beam, token) extensions the best `beam_width`
survive. Most of them extend the same few parents, so the beams share their prompt and most of
their history. In a paged KV cache that sharing is free:

- an extension that keeps its parent's history is a **fork**: a new block table that points at
  the parent's blocks, whose reference counts go up (`Scheduler.fork_seq`);
- a parent that no extension chose is **pruned**: its blocks are freed, and the blocks it shared
  with a surviving beam simply lose one reference;
- a beam that writes into a shared, partly filled last block gets its own **copy** of that one
  block (copy-on-write); full blocks stay shared for good.

The search runs inside the engine, through the one hook every request's samples pass
(`BeamSearch`, an `AfterSampling` of minivllm/engine/parallel_sampling.py), batched with every other request under the same token budget:
a beam is an ordinary `Sequence`, scheduled, preempted and recomputed like any other. Only the
choice of which beams live on is this module's, made once every live beam of a request has
sampled in a round (vLLM's `LLM.beam_search` semantics: candidates are each beam's top
`2 * beam_width` tokens by log-probability; the score is `cum_logprob / len ** length_penalty`
over prompt and output, not counting a final EOS; a beam that draws EOS is complete unless
`ignore_eos`; after `max_tokens` the best `beam_width` complete or running beams are returned).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from minivllm.core.outputs import CompletionOutput, RequestOutput, make_request_output
from minivllm.core.sequence import Logprob, Request, Sequence, SequenceStatus
from minivllm.engine.parallel_sampling import RequestContext
from minivllm.sample.sampler import SampledLists
from minivllm.sampling_params import MAX_LOGPROBS, InvalidParamError, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: what `LLM.beam_search` and `use_beam_search` take."""

    beam_width: int  # beams kept after every step
    max_tokens: int  # output tokens of the longest beam
    ignore_eos: bool = False  # EOS is an ordinary token: no beam completes early
    temperature: float = 0.0  # > 0: one sampled token joins each beam's top candidates
    length_penalty: float = 1.0  # score = cum_logprob / len ** length_penalty

    def __post_init__(self) -> None:
        max_width = MAX_LOGPROBS // 2  # each beam asks the sampler for 2 * beam_width logprobs
        for name, low in (("beam_width", 1), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParamError(f"{name} must be a positive integer, got {value!r}", name)
        if self.beam_width > max_width:
            raise InvalidParamError(
                f"beam_width must be in [1, {max_width}], got {self.beam_width}", "beam_width"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParamError(
                f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos"
            )
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise InvalidParamError(
                f"temperature must be a number >= 0, got {self.temperature!r}", "temperature"
            )
        if not (
            isinstance(self.length_penalty, int | float) and math.isfinite(self.length_penalty)
        ):
            raise InvalidParamError(
                f"length_penalty must be a finite number, got {self.length_penalty!r}",
                "length_penalty",
            )

    def sampling_params(self) -> SamplingParams:
        """What each beam asks the sampler for: its top 2 * beam_width candidates' logprobs."""
        return SamplingParams(
            temperature=self.temperature,
            logprobs=2 * self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=True,  # EOS ends a beam here, not in the stop checker
        )

    @property
    def max_num_seqs(self) -> int:
        return self.beam_width  # admission counts a search as its beams

    def make_after_sampling(self, ctx: RequestContext) -> BeamSearch:
        """The engine asks every request's parameters for the hook that handles its samples."""
        return BeamSearch(self, ctx)


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM returns it."""

    tokens: list[int]  # prompt and output
    logprobs: list[dict[int, Logprob]]  # per output token: the candidates it was chosen among
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded tokens (prompt and output, as vLLM's LLM.beam_search)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_ids: Collection[int], length_penalty: float
) -> float:
    """vLLM's score: the mean log-probability per token when length_penalty is 1; a final EOS does
    not count towards the length."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cum_logprob / (seq_len**length_penalty)


@dataclass
class Candidate:
    """One (beam, next token) extension."""

    parent: Sequence
    token_id: int
    logprob: float  # of token_id, under the parent's next-token distribution
    step_logprobs: dict[int, Logprob]  # the parent's candidates this step (the beam's logprobs)

    @property
    def cum_logprob(self) -> float:
        return self.parent.cumulative_logprob + self.logprob

    @property
    def tokens(self) -> list[int]:
        return [*self.parent.token_ids, self.token_id]


@dataclass
class BeamState:
    """A beam-search request's search state, beside its live beams (ordinary sequences)."""

    params: BeamSearchParams
    # seq_id -> that beam's candidates this round; a round is decided once every live beam has some
    pending: dict[int, list[Candidate]] = field(default_factory=dict)
    completed: list[BeamSearchSequence] = field(default_factory=list)  # complete or final beams

    def add_candidates(
        self,
        seq: Sequence,
        top: list[tuple[int, float]],  # [(token id, logprob)] most likely first
        sampled: tuple[int, float],  # the sampler's draw: the argmax at temperature 0
        decode: Callable[[int], str | None],
    ) -> None:
        entry = {tid: Logprob(lp, rank, decode(tid)) for rank, (tid, lp) in enumerate(top, 1)}
        ids = dict(top)
        ids.setdefault(*sampled)  # at temperature > 0 the draw may lie outside the top
        if sampled[0] not in entry:
            entry[sampled[0]] = Logprob(sampled[1], len(entry) + 1, decode(sampled[0]))
        self.pending[seq.seq_id] = [Candidate(seq, t, lp, entry) for t, lp in ids.items()]

    def round_complete(self, live: list[Sequence]) -> bool:
        return all(s.seq_id in self.pending for s in live)

    def decide_round(self, eos_token_ids: set[int]) -> list[Candidate]:
        """EOS extensions complete (unless ignore_eos); of the others, the best `beam_width` by
        score survive. Returns the survivors, best first, and starts the next round."""
        survivors: list[Candidate] = []
        for candidates in self.pending.values():
            for c in candidates:
                if c.token_id in eos_token_ids and not self.params.ignore_eos:
                    self.completed.append(self._record(c.tokens, c, "stop"))
                else:
                    survivors.append(c)
        self.pending.clear()
        lp = self.params.length_penalty
        survivors.sort(key=lambda c: c.cum_logprob / (c.parent.num_tokens + 1) ** lp, reverse=True)
        return survivors[: self.params.beam_width]

    def finish(self, live: list[Sequence], eos_token_ids: set[int]) -> list[BeamSearchSequence]:
        """The search is over: the best `beam_width` of the completed and the live beams."""
        for seq in live:
            self.completed.append(
                BeamSearchSequence(
                    list(seq.token_ids),
                    list(seq.logprobs or []),
                    seq.cumulative_logprob,
                    None,
                    "length",
                )
            )
        lp = self.params.length_penalty
        self.completed.sort(
            key=lambda b: beam_search_score(b.tokens, b.cum_logprob, eos_token_ids, lp),
            reverse=True,
        )
        del self.completed[self.params.beam_width :]
        return self.completed

    @staticmethod
    def _record(tokens: list[int], c: Candidate, finish_reason: str) -> BeamSearchSequence:
        logprobs = [*(c.parent.logprobs or []), c.step_logprobs]
        return BeamSearchSequence(tokens, logprobs, c.cum_logprob, None, finish_reason)


def _extend(seq: Sequence, c: Candidate) -> None:
    seq.token_ids.append(c.token_id)
    seq.cumulative_logprob += c.logprob
    assert seq.logprobs is not None
    seq.logprobs.append(c.step_logprobs)


def beam_request_output(
    request: Request, beams: list[BeamSearchSequence], decode: Callable[[list[int]], str]
) -> RequestOutput:
    """A finished beam search as a `RequestOutput`, one `CompletionOutput` per beam, best first
    (what the server returns for `use_beam_search`)."""
    n = len(request.prompt_token_ids)
    outputs = [
        CompletionOutput(
            index=i,
            text=decode(b.tokens[n:]),
            token_ids=b.tokens[n:],
            cumulative_logprob=b.cum_logprob,
            logprobs=b.logprobs,
            finish_reason=b.finish_reason,
            stop_reason=b.stop_reason,
        )
        for i, b in enumerate(beams)
    ]
    out = make_request_output(request)
    out.outputs, out.finished = outputs, True
    return out


class BeamSearch:
    """One beam-search request's hook after sampling (`minivllm/engine/parallel_sampling.py`): each step's
    candidates in; forks, extensions and prunes out, through the scheduler (the only owner of the
    KV bookkeeping); the finished search as one `RequestOutput`."""

    streams_text = False  # a beam's text is decoded once, at the end of the search

    def __init__(self, params: BeamSearchParams, ctx: RequestContext) -> None:
        if params.beam_width > ctx.max_num_seqs:
            raise InvalidParamError(
                f"beam_width must be at most max_num_seqs ({ctx.max_num_seqs}), "
                f"got {params.beam_width}",
                "beam_width",
            )
        self.state = BeamState(params)
        self.ctx = ctx

    def sequences_to_sample(self, seq: Sequence) -> list[Sequence]:
        return [seq]  # a beam forks once its round is decided, not at the sampler

    def process(
        self, seqs: list[Sequence], sampled: SampledLists, rows: list[int]
    ) -> list[RequestOutput]:
        """`seqs[i]`, a live beam of this request, sampled row `rows[i]`. Returns the search's
        output once it has ended."""
        top_ids, top_lps, sampled_lps = (
            sampled.top_ids,
            sampled.top_logprobs,
            sampled.sampled_logprobs,
        )
        assert top_ids is not None and top_lps is not None and sampled_lps is not None
        decode_one = self.ctx.output_processor.decode_one
        for seq, j in zip(seqs, rows):
            top = list(zip(top_ids[j], top_lps[j]))
            draw = (sampled.token_ids[j], sampled_lps[j])
            self.state.add_candidates(seq, top, draw, decode_one)
        req = seqs[0].request
        max_model_len = self.ctx.output_processor.max_model_len
        eos = set(self.ctx.eos_token_ids)
        beams = advance_beam_search(req, self.state, eos, max_model_len, self._fork, self._prune)
        if beams is None:
            return []
        for seq in req.seqs:
            self.ctx.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return [beam_request_output(req, beams, self._decode_text)]

    def _fork(self, parent: Sequence) -> Sequence:
        """A new beam sharing all of `parent`'s blocks; a parent preempted since it sampled has no
        blocks to share, so its child recomputes (from the prefix cache, mostly)."""
        req = parent.request
        child = self.ctx.new_seq(req, len(req.seqs))
        child.token_ids = list(parent.token_ids)
        child.cumulative_logprob = parent.cumulative_logprob
        child.logprobs = list(parent.logprobs or [])
        child.num_cached_tokens = parent.num_cached_tokens
        if parent.status == SequenceStatus.RUNNING:
            self.ctx.scheduler.fork_seq(parent, child)
        else:
            self.ctx.scheduler.add_seq(child)
        req.seqs.append(child)
        return child

    def _prune(self, seq: Sequence) -> None:
        self.ctx.finish(seq, SequenceStatus.FINISHED_STOPPED)
        seq.request.seqs.remove(seq)

    def _decode_text(self, token_ids: list[int]) -> str:
        tokenizer = self.ctx.output_processor.tokenizer
        return (
            "" if tokenizer is None else str(tokenizer.decode(token_ids, skip_special_tokens=True))
        )


def advance_beam_search(
    request: Request,
    state: BeamState,
    eos_token_ids: set[int],
    max_model_len: int,
    fork: Callable[[Sequence], Sequence],
    prune: Callable[[Sequence], None],
) -> list[BeamSearchSequence] | None:
    """Decide a request's round if every live beam has sampled, and apply it as the paper does:
    a parent no survivor extends is pruned (its blocks freed), a parent extended k times is forked
    k - 1 times (blocks shared) and extended in place once; the copy-on-write of the shared last
    block follows when the beams write their new tokens. Returns the final beams once the search
    is over (the caller then finishes the live beams), else None."""
    live = [s for s in request.seqs if not s.status.is_finished]
    if not state.round_complete(live):
        return None  # a beam still computes (it was preempted): decide when it has sampled
    survivors = state.decide_round(eos_token_ids)
    chosen: dict[int, list[Candidate]] = {}
    for c in survivors:
        chosen.setdefault(c.parent.seq_id, []).append(c)
    for seq in live:
        extensions = chosen.get(seq.seq_id)
        if not extensions:
            prune(seq)
            continue
        for c in extensions[1:]:  # forks first: they copy the parent's history before it grows
            _extend(fork(seq), c)
        _extend(seq, extensions[0])
    request.forked = True  # from now on each beam counts as one sequence at re-admission
    live = [s for s in request.seqs if not s.status.is_finished]
    over = not live or live[0].num_output_tokens >= state.params.max_tokens
    if over or live[0].num_tokens >= max_model_len:
        return state.finish(live, eos_token_ids)
    return None
