"""The step trace: what the engine did to the KV cache at every step, as plain data.

The PagedAttention paper's idea is a picture: logical blocks mapped to physical blocks, shared,
copied on write, freed and reused (§4.2–4.4), and a scheduler that admits, chunks and preempts
(§4.5). `StepRecorder` records that picture, one immutable dict per engine step, so that a page
(minivllm/trace/page.py) can draw it and a test can check it.

It is a step listener (minivllm/engine/step_listener.py, "the step as a message" on the docs'
architecture page): after every step that committed, the engine hands it the step's
`SchedulerOutput`, what the step produced (`StepOutputs`: the sequences it sampled for, the
scheduler's sequences after the commit) and the block manager's read-only `BlockPoolSnapshot`,
taken *after* the step — after its commit (new prefix-cache names), its forks and its frees. So a
step's record reads "this batch ran, these events happened, and this is the pool now". Events
that leave no field in the `SchedulerOutput` (cache hits at admission, evictions, forks,
finishes) are found by comparing the snapshot with the previous one, which keeps the engine's own
code free of tracing: the engine does not know the recorder exists.

A step's record, as `trace.json` stores it (docs/trace.md documents every field; JSON object
keys are strings, so seq ids and block ids are strings as keys):

    {"step", "batch", "in_flight", "scheduled": [{"seq_id", "request_id", "num_computed_tokens", "num_new_tokens",
     "block_table", "num_spec_tokens", "num_accepted_tokens"[, "lora_slot", "lora_name"]}],
     "num_batched_tokens", "block_tables": {seq_id: [block id | null]},
     "num_computed_tokens": {seq_id: n}, "ref_counts": {block id: n > 0}, "cached_blocks",
     "copies": [[src, dst]], "preempted", "forked", "finished", "finish_reasons",
     "cache_hits": [{"seq_id", "num_cached_tokens", "blocks"}], "evicted", "num_free_blocks",
     "kv_slots": {"reserved", "filled", "future", "internal_fragmentation"}, "num_running",
     "num_waiting", "waiting"[, "lora_slots": {slot: lora_name}]}

A `null` in a block table is an entry a sliding window freed: no query of that sequence sees its
tokens again, so the block went back to the pool (minivllm/core/sliding_window_manager.py). A
model whose layers keep their KV in groups (Gemma 2/3: minivllm/core/kv_cache_coordinator.py) has
a table per group: `block_tables` are the first (global) group's, a step's `group_block_tables`
the others' in group order, and the trace's `kv_cache_groups` say which layers each one serves.

With pipeline stages the engine keeps a batch per stage in flight (minivllm/engine/llm_engine.py):
a record is one batch, recorded when it commits (its output came back from the last stage), so
`step` counts commits while `batch` is the batch's number in schedule order, and `in_flight`
lists the batches launched after it that were still in the later stages then (stage 0 has run
them). With one stage `batch` equals `step` and `in_flight` is always empty.

With LoRA on (`enable_lora`), each scheduled row also names its adapter and the device slot its
rows ran with (-1 and null: the base model), and a step has `lora_slots`, the adapters resident
after it. The slots are the model runner's choice (minivllm/lora/manager.py: it activates the
step's adapters before the forward), not the scheduler's, so they are read from the driver's LoRA
manager after the step, as the pool is: nothing moves an adapter between a step and the next one's
activation, so what is resident after the step is what its rows used.

Thread safety (the live dashboard reads from the server's thread while the engine thread
records): records are built outside the lock and never changed afterwards; the lock only guards
appending them and copying the list, and the per-sequence token lists the recorder owns.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minivllm.core.kv_cache_coordinator import HybridBlockPoolSnapshot, HybridKVCacheCoordinator
from minivllm.core.kv_cache_utils import BlockHash, BlockPoolSnapshot, KVCacheManagerStats
from minivllm.core.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.core.sequence import Sequence as EngineSequence
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.step_listener import StepOutputs
from minivllm.lora.manager import LoRAModelManager
from minivllm.lora.request import LoRARequest
from minivllm.trace.page import write_page

TRACE_FORMAT_VERSION = 1
StepRecord = dict[str, Any]  # one step, exactly as trace.json stores it


@dataclass
class _SeqRecord:
    """What the page needs to label a sequence and the tokens in its blocks."""

    request_id: str
    index: int  # which of the request's n samples
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)  # the recorder's own copy; grows only
    last_step: int = 0  # the newest step that mentions it (the live window forgets older ones)


class StepRecorder:
    """Records every engine step it is attached to; `max_steps` keeps only the newest steps.

    Offline: `with llm.trace() as trace: llm.generate(...)`, then `trace.save(dir)`. Live:
    `minivllm serve --enable-dashboard` attaches one with a window of recent steps.
    """

    def __init__(self, max_steps: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}")
        self.max_steps = max_steps
        self.meta: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._seqs: dict[int, _SeqRecord] = {}
        self._num_recorded = 0
        self._tokenizer: Any = None
        self._token_text: dict[int, str] = {}  # decoded once per token id
        # What the previous record saw, to find this step's events by comparison. Engine thread only.
        self._following: dict[int, EngineSequence] = {}  # unfinished sequences seen so far
        self._prev_holders: set[int] = set()
        self._prev_cached: dict[int, BlockHash] = {}  # block id -> the name it carried
        self._lora: LoRAModelManager | None = None  # the driver's, when LoRA is on
        self._lora_requests: dict[int, LoRARequest] = {}  # the engine's: every adapter added

    # ------------------------------------------------------------------ attaching
    def attach(self, engine: LLMEngine) -> None:
        """Start recording `engine`'s steps. Attach before its engine thread runs (the server does),
        or between steps: the pool as it is now is the baseline the first record compares with."""
        if any(isinstance(x, StepRecorder) and x is not self for x in engine.step_listeners):
            raise RuntimeError("the engine already has a step recorder attached")
        pool = engine.kv_cache_manager.snapshot()
        cfg = engine.config
        self.meta = {
            "model": engine.source.name,
            "block_size": pool.block_size,
            "num_blocks": pool.num_blocks,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
        }
        manager = engine.kv_cache_manager
        if isinstance(manager, HybridKVCacheCoordinator):  # a table per group of layers
            self.meta["kv_cache_groups"] = [
                {"sliding_window": g.sliding_window, "layers": list(g.layer_ids)}
                for g in manager.kv_cache_groups
            ]
        self._lora = engine.runner.lora_manager
        if self._lora is not None:
            self.meta["max_loras"] = self._lora.config.max_loras
            self._lora_requests = engine.lora_requests
        self._tokenizer = engine.tokenizer
        self._following = dict(engine.scheduler.seqs)
        self._prev_holders = {s for s in self._following if s in pool.block_tables}
        self._prev_cached = dict(pool.cached_blocks)
        if self not in engine.step_listeners:
            engine.add_step_listener(self)

    def detach(self, engine: LLMEngine) -> None:
        engine.remove_step_listener(self)

    # ------------------------------------------------------------------ recording (engine thread)
    def on_step(
        self, scheduler_output: SchedulerOutput, outputs: StepOutputs, blocks: BlockPoolSnapshot
    ) -> None:
        """Record one committed step; a sequence it sampled for is known even if it ended in it."""
        sched = scheduler_output
        seqs = self._following
        for seq in outputs.sampled:
            seqs.setdefault(seq.seq_id, seq)
        seqs.update(outputs.seqs)
        step_no = self._num_recorded + 1

        holders = sorted(s for s in outputs.seqs if s in blocks.block_tables)
        tables, *others = _group_tables(blocks, holders)  # others: a hybrid model's groups
        held = {b for group in (tables, *others) for t in group.values() for b in t}
        ref_counts = {b: blocks.ref_counts[b] for b in held if b is not None}
        cached = dict(blocks.cached_blocks)
        evicted = sorted(b for b, h in self._prev_cached.items() if cached.get(b) is not h)
        finished = sorted(s for s, seq in seqs.items() if seq.status.is_finished)
        scheduled_ids = {item.seq_id for item in sched.scheduled}
        forked = sorted(
            s for s in holders if s not in self._prev_holders and s not in scheduled_ids
        )
        cache_hits = [
            {
                "seq_id": item.seq_id,
                "num_cached_tokens": item.num_computed_tokens,
                "blocks": item.block_table[: item.num_computed_tokens // blocks.block_size],
            }
            for item in sched.scheduled
            if item.seq_id not in self._prev_holders and item.num_computed_tokens > 0
        ]
        record: StepRecord = {
            "step": step_no,
            "batch": sched.batch_id,
            "in_flight": list(outputs.in_flight),  # batches still in the later stages
            "scheduled": [
                {
                    "seq_id": item.seq_id,
                    "request_id": seqs[item.seq_id].request.request_id,
                    "num_computed_tokens": item.num_computed_tokens,
                    "num_new_tokens": item.num_new_tokens,
                    "block_table": list(item.block_table),
                    "num_spec_tokens": item.num_spec_tokens,
                    "num_accepted_tokens": _num_accepted(item, outputs),
                }
                for item in sched.scheduled
            ],
            "num_batched_tokens": sched.num_batched_tokens,
            "block_tables": {str(s): t for s, t in tables.items()},
            "num_computed_tokens": {str(s): seqs[s].num_computed_tokens for s in holders},
            "ref_counts": {str(b): n for b, n in sorted(ref_counts.items())},
            "cached_blocks": sorted(cached),
            "copies": [list(c) for c in sched.block_copies],
            "preempted": list(sched.preempted_seq_ids),
            "forked": forked,
            "finished": finished,
            "finish_reasons": {str(s): seqs[s].status.value for s in finished},
            "cache_hits": cache_hits,
            "evicted": evicted,
            "num_free_blocks": blocks.num_free_blocks,
            # How the held slots split under the engine's kv_allocation (KVCacheManagerStats).
            "kv_slots": _kv_slots(blocks.stats),
            "num_running": outputs.num_running,
            "num_waiting": outputs.num_waiting,
            "waiting": list(outputs.waiting),  # queue order, front first
        }
        if self._lora is not None:
            self._add_lora_slots(record, sched)
        if others:  # a hybrid model's other KV cache groups
            record["group_block_tables"] = [{str(s): t for s, t in g.items()} for g in others]
        mentioned = scheduled_ids | set(holders) | set(finished) | set(sched.preempted_seq_ids)
        with self._lock:
            for s in mentioned:
                self._update_seq(seqs[s], step_no)
            self._steps.append(record)
            self._num_recorded = step_no
            if self.max_steps is not None and len(self._steps) == self.max_steps:
                oldest = self._steps[0]["step"]
                for s in [s for s, r in self._seqs.items() if r.last_step < oldest]:
                    del self._seqs[s]
        for s in finished:
            del seqs[s]
        self._prev_holders = set(holders)
        self._prev_cached = cached

    def _add_lora_slots(self, record: StepRecord, sched: SchedulerOutput) -> None:
        """Each row's adapter and slot, and the slots' adapters (after the step: see above)."""
        assert self._lora is not None
        slots = dict(self._lora.slots)  # lora_int_id -> slot
        for row, item in zip(record["scheduled"], sched.scheduled):
            lora = item.lora_request
            row["lora_slot"] = -1 if lora is None else slots[lora.lora_int_id]
            row["lora_name"] = None if lora is None else lora.lora_name
        record["lora_slots"] = {
            str(slot): self._lora_requests[i].lora_name
            for i, slot in sorted(slots.items(), key=lambda kv: kv[1])
            if i in self._lora_requests  # a slot filled outside the engine's add_lora: unnamed
        }

    def _update_seq(self, seq: EngineSequence, step_no: int) -> None:
        rec = self._seqs.get(seq.seq_id)
        if rec is None:
            req = seq.request
            rec = self._seqs[seq.seq_id] = _SeqRecord(
                req.request_id, seq.index, seq.num_prompt_tokens
            )
        rec.token_ids.extend(seq.token_ids[len(rec.token_ids) :])  # tokens are only appended
        rec.last_step = step_no

    # ------------------------------------------------------------------ reading (any thread)
    @property
    def steps(self) -> list[StepRecord]:
        """The recorded steps, oldest first (a copy of the list; the records are never changed)."""
        with self._lock:
            return list(self._steps)

    @property
    def num_recorded(self) -> int:
        """Steps recorded since attaching, including those the window has dropped."""
        return self._num_recorded

    def snapshot(self, after_step: int = 0) -> dict[str, Any]:
        """The trace of the steps newer than `after_step`, with the sequences they mention: what
        trace.json holds, restricted to a window (the live dashboard polls with it)."""
        with self._lock:
            steps = [s for s in self._steps if s["step"] > after_step]
            seqs = {
                s: (r.request_id, r.index, r.num_prompt_tokens, list(r.token_ids))
                for s, r in self._seqs.items()
                if steps and r.last_step >= steps[0]["step"]
            }
            meta = dict(self.meta)
        sequences = {}
        for s, (request_id, index, num_prompt, token_ids) in sorted(seqs.items()):
            entry: dict[str, Any] = {
                "request_id": request_id,
                "index": index,
                "num_prompt_tokens": num_prompt,
                "token_ids": token_ids,
            }
            if self._tokenizer is not None:
                entry["tokens"] = [self._text(t) for t in token_ids]
            sequences[str(s)] = entry
        return {
            "version": TRACE_FORMAT_VERSION,
            **meta,
            "max_steps": self.max_steps,
            "num_recorded": self._num_recorded,
            "sequences": sequences,
            "steps": steps,
        }

    def to_dict(self) -> dict[str, Any]:
        """The whole trace, as trace.json stores it."""
        return self.snapshot(after_step=0)

    def save(self, out_dir: str | Path) -> Path:
        """Write `out_dir/trace.json` and `out_dir/index.html` (the page, self-contained: open it
        from the file system); returns the page's path."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        trace = self.to_dict()
        (out / "trace.json").write_text(json.dumps(trace, separators=(",", ":")))
        return write_page(trace, out / "index.html")

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id])
        return text


@contextmanager
def record(engine: LLMEngine, max_steps: int | None = None) -> Iterator[StepRecorder]:
    """Record `engine`'s steps inside the `with` block (what `LLM.trace()` does)."""
    recorder = StepRecorder(max_steps)
    recorder.attach(engine)
    try:
        yield recorder
    finally:
        recorder.detach(engine)


def _kv_slots(stats: KVCacheManagerStats) -> dict[str, int]:
    return {
        "reserved": stats.num_reserved_slots,
        "filled": stats.num_filled_slots,
        # Held ahead for tokens still to come: only a reservation policy has any.
        "future": getattr(stats, "num_future_slots", 0),
        "internal_fragmentation": stats.internal_fragmentation_slots,
    }


def _held_tables(blocks: BlockPoolSnapshot, holders: list[int]) -> dict[int, list[int | None]]:
    """Each holder's block table, with None for the entries a sliding window freed (their
    placeholder id names no block the sequence holds)."""
    tables: dict[int, list[int | None]] = {}
    for s in holders:
        table: list[int | None] = list(blocks.block_tables[s])
        skipped = blocks.num_skipped_blocks.get(s, 0)
        table[:skipped] = [None] * skipped
        tables[s] = table
    return tables


def _group_tables(
    blocks: BlockPoolSnapshot, holders: list[int]
) -> list[dict[int, list[int | None]]]:
    """The holders' tables in every KV cache group: one group, or a hybrid model's several."""
    groups = blocks.other_groups if isinstance(blocks, HybridBlockPoolSnapshot) else ()
    return [_held_tables(group, holders) for group in (blocks, *groups)]


def _num_accepted(item: ScheduledSequence, outputs: StepOutputs) -> int:
    """Drafts a verification step kept: the sequence sampled once per kept token (speculative
    decoding's last token is its own), or fewer when a stop came inside the kept run."""
    if not item.num_spec_tokens:
        return 0
    return max(0, sum(1 for seq in outputs.sampled if seq.seq_id == item.seq_id) - 1)
