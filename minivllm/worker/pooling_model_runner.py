"""The pooling runner: the same step as a generator's, with a pooler where the LM head was.

vLLM v1 runs pooling models in its GPU model runner with `runner="pooling"`; here a subclass of
`ModelRunner` (as the hybrid runner is), so the generating runner stays as it was. A pooling
request is prefill-only: the scheduler hands it out in chunks under the same token budget, this
runner keeps each chunk's hidden states until the prompt's last chunk has run (`sample` is set on
it), then pools the whole prompt into one float32 vector (minivllm/pooling/pooler.py) and forgets
it. No logits are computed.

An encoder (BERT: `pooler.causal` False) attends bidirectionally, which is exact only over a
whole prompt: the scheduler runs its prompts unchunked, and this runner refuses a step that
would split one rather than return a wrong vector. Its attention is encoder-only
(`AttentionBackend.attend_encoder`): no KV cache is written or read, so the model holds no KV
blocks (minivllm/core/encoder_only_manager.py), and its step needs no block tables or slot
mapping, only where each prompt's rows start (`prepare_encoder_inputs`). Its pair inputs carry token types
(`ScheduledSequence.token_type_ids`), handed to the model beside the token ids. A classifier's
head (`classify`: BERT's pooler and classifier) runs here on the pooled [CLS] rows, so the engine
receives logits.

Per-sequence state across steps is what the step message tells it to drop: a sequence that was
finished or aborted meanwhile (`SchedulerOutput.finished_seq_ids`), or one whose chunk does not
continue where the kept rows end (preempted and recomputed from 0, or a prefix-cache hit that
LAST pooling allows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.core.scheduler import SchedulerOutput
from minivllm.pooling.config import PoolerConfig
from minivllm.pooling.pooler import pool
from minivllm.worker.model_runner import ModelInput, ModelRunner, ModelRunnerOutput


@dataclass
class PromptRows:
    """A chunked prompt's hidden states so far."""

    next_position: int  # the position the next chunk must start at
    chunks: list[torch.Tensor] = field(default_factory=list)  # each [chunk_len, H]


class PoolingModelRunner(ModelRunner):
    def __init__(self, *args: Any, pooler: PoolerConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pooler = pooler
        self.prompt_rows: dict[int, PromptRows] = {}  # seq_id -> its earlier chunks' rows

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's prompt chunks; pool each prompt whose last chunk this is."""
        for seq_id in sched.finished_seq_ids:
            self.prompt_rows.pop(seq_id, None)
        if self.pooler.causal:
            self.copy_blocks(sched.block_copies)
            inp = self.prepare_inputs(sched)
            hidden = self.run_model(inp)  # [T, hidden_size]
        else:
            inp = self.prepare_encoder_inputs(sched)
            hidden = self.run_encoder(sched, inp)
        assert isinstance(hidden, torch.Tensor)  # one pipeline stage: pooling refuses more
        starts = inp.meta.query_start_loc.tolist()
        pooled: dict[int, torch.Tensor] = {}
        for i, item in enumerate(sched.scheduled):
            rows = hidden[starts[i] : starts[i + 1]]  # [num_new_tokens, H]
            kept = self.prompt_rows.pop(item.seq_id, None)
            if kept is None or kept.next_position != item.num_computed_tokens:
                kept = PromptRows(item.num_computed_tokens)  # a fresh start (see the docstring)
            if item.sample:  # the prompt's last chunk
                whole = torch.cat([*kept.chunks, rows]) if kept.chunks else rows
                pooled[item.seq_id] = pool(whole, self.pooler.pooling_type)
            else:  # a copy: the step's hidden states are not kept alive for one request
                keep = rows[:0] if self.pooler.pooling_type == "LAST" else rows  # LAST: none
                kept.chunks.append(keep.clone())
                kept.next_position = item.seq_len
                self.prompt_rows[item.seq_id] = kept
        if self.pooler.task == "classify" and pooled:
            # The head one row at a time: a GEMM's sums run in another order for 1 row than for
            # 2 or more (MKL's gemv against its gemm), so a request's score would depend on how
            # many others finished in its step. The head is two small matrices: rows are cheap.
            classify = self.model.classify  # [1, H] -> float32 [1, num_labels]
            pooled = {i: classify(row[None])[0] for i, row in pooled.items()}  # type: ignore[operator]
        return ModelRunnerOutput(None, {}, pooled)

    def prepare_encoder_inputs(self, sched: SchedulerOutput) -> ModelInput:
        """An encoder's step: every prompt whole, end to end, each at positions 0..L-1; the
        metadata says where each starts and nothing else (no blocks, no slots)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        for item in sched.scheduled:
            if item.num_computed_tokens != 0 or not item.sample:
                raise RuntimeError(
                    f"sequence {item.seq_id}: an encoder's prompt must run whole in one step "
                    "(enable_chunked_prefill=False), got a chunk of it"
                )
            input_ids += item.new_token_ids
            positions += range(item.num_new_tokens)
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
        dev = self.device
        lens = [item.num_new_tokens for item in sched.scheduled]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((len(lens), 0), dtype=torch.int32, device=dev),  # none
            slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),  # nothing is cached
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        meta.plan = self.backend.plan(meta, self.block_size)  # once per step, for all layers
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.empty(0, dtype=torch.int64, device=dev),
            prompt_rows={},
            token_lora_slots=None,
        )

    def run_encoder(self, sched: SchedulerOutput, inp: ModelInput) -> torch.Tensor:
        """The encoder's forward over whole prompts, with their token types."""
        types = None
        if any(item.token_type_ids is not None for item in sched.scheduled):
            flat = [
                t
                for item in sched.scheduled
                for t in (item.token_type_ids or [0] * item.num_new_tokens)
            ]
            types = torch.tensor(flat, dtype=torch.int64, device=self.device)  # [T]
        return self.model(
            inp.input_ids, inp.positions, self.kv_cache, inp.meta, token_type_ids=types
        )
