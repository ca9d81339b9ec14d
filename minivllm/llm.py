"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM.

`LLM` owns an `LLMEngine`, feeds it every prompt at once, and steps it until all are done. That
is the whole trick of continuous batching from the user's side: hand over all the work and let
the scheduler keep the batch full (paper §4.5). Outputs come back in input order.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from tqdm.auto import tqdm

from minivllm.core.outputs import RequestOutput
from minivllm.core.sequence import Request
from minivllm.engine.arg_utils import EngineArgs, EngineKwargs, document_engine_args
from minivllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.stats import EngineStats
from minivllm.inputs import PromptTooLongError, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.pooling.scoring import cosine, pair_prompt, pair_texts
from minivllm.sampling_params import SamplingParams
from minivllm.trace.recorder import StepRecorder, record

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch
    from typing_extensions import Unpack

logger = logging.getLogger("minivllm")
T = TypeVar("T")  # a pooling output's result: an embedding, a classification, a score

ChatMessages = list[dict[str, Any]]


class LLM:
    """Load a model and generate from it offline.

    `model=None` is the bundled SmolLM2-135M-Instruct. The keyword arguments are vLLM's engine
    arguments, the fields of `minivllm.EngineArgs` (listed with their meaning under `__init__`).
    """

    @document_engine_args
    def __init__(self, model: str | None = None, **kwargs: Unpack[EngineKwargs]) -> None:
        """Load `model` (None: the bundled SmolLM2-135M-Instruct) and size its KV cache."""
        config = EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()
        if config.parallel.data_parallel_size > 1:
            # vLLM runs offline DP as one process per rank, each its own LLM on a slice of the
            # prompts; minivllm's data parallelism is the server's (one front, N engine cores).
            raise ValueError(
                "data_parallel_size > 1 is not supported by the offline LLM (it runs one engine); "
                "serve the model with `minivllm serve MODEL -dp N` instead (add --headless hosts "
                "for more machines), or, as vLLM's offline DP does, start one process per rank, "
                "each with its own LLM over its slice of the prompts, got "
                f"data_parallel_size={config.parallel.data_parallel_size}"
            )
        self.llm_engine = LLMEngine(config)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if it has any (vLLM's name). Also
        done when the LLM is deleted and at interpreter exit; idempotent."""
        engine = getattr(self, "llm_engine", None)  # None: __init__ failed before the engine
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many: strings, or {"prompt_token_ids": [...]} dicts; under
        one LoRA adapter, or one per prompt (None: the base model), with `enable_lora=True`."""
        self.llm_engine.check_runner("generate")  # a pooling model refuses, naming its runner
        prompt_list = self._prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params must be one SamplingParams or one per prompt "
                    f"({len(prompt_list)}), got {len(params_list)}"
                )
        return self._run(
            prompt_list, params_list, use_tqdm, self._lora_list(lora_request, prompt_list)
        )

    @staticmethod
    def _lora_list(
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None, prompts: list[PromptType]
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, as vLLM's `lora_request` accepts it."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * len(prompts)
        loras = list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(
                f"lora_request must be one LoRARequest or one per prompt ({len(prompts)}), "
                f"got {len(loras)}"
            )
        return loras

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or many, through the model's chat template."""
        convs: list[ChatMessages]
        if messages and isinstance(messages[0], dict):
            convs = [messages]  # type: ignore[list-item]
        else:
            convs = list(messages)  # type: ignore[arg-type]
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(
        self, conversation: ChatMessages, add_generation_prompt: bool = True
    ) -> list[int]:
        tok = self.llm_engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        ids = tok.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation_config.json where it sets any."""
        return SamplingParams(**self.llm_engine.get_diff_sampling_param())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, e.g. after loading new weights; False while busy."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    @contextmanager
    def trace(self, max_steps: int | None = None) -> Iterator[StepRecorder]:
        """Record every engine step inside the block: `with llm.trace() as trace: llm.generate(...)`,
        then `trace.save(dir)` writes trace.json and index.html, a page that shows the block pool,
        the block tables and the scheduler's batch step by step (minivllm/trace/)."""
        with record(self.llm_engine, max_steps) as recorder:
            yield recorder

    # ------------------------------------------------------------------ pooling models
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`), from a model loaded with
        `runner="pooling"` (or `convert="embed"`): `.outputs.embedding` is a list of floats."""

        return [
            self._pooling_output(out, EmbeddingOutput(vector))
            for out, vector in self._pool(prompts, pooling_params, use_tqdm, "embed")
        ]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """A classifier's outputs per prompt (vLLM's `LLM.classify`): `.outputs.probs`, softmax
        over the labels (a sigmoid for one label; raw logits with `activation=False`)."""

        return [
            self._pooling_output(out, ClassificationOutput(vector))
            for out, vector in self._pool(prompts, pooling_params, use_tqdm, "classify")
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs (vLLM's `LLM.score`): one `text_1` against each of
        `text_2` (1:N), or pairwise (N:N). A cross-encoder (a classifier with one label) reads
        each pair as its tokenizer joins pairs, and its score is the sigmoid of its logit
        (sentence-transformers' `CrossEncoder.predict` default); for an embedding model a score
        is the cosine similarity of the two embeddings, as vLLM computes it."""

        firsts, seconds = pair_texts(text_1, text_2)
        pooler = self.llm_engine.pooler
        if pooler is not None and pooler.task == "classify":
            if pooler.hidden_size != 1:
                raise ValueError(
                    f"score needs a cross-encoder (a classifier of one label); this model has "
                    f"{pooler.hidden_size} labels: use classify()"
                )
            tok = self.llm_engine.tokenizer
            pairs: list[PromptType] = [
                pair_prompt(tok, a, b, pooler.use_pad_token) for a, b in zip(firsts, seconds)
            ]
            return [
                self._pooling_output(out, ScoringOutput(vector[0]))
                for out, vector in self._pool(pairs, pooling_params, use_tqdm, "classify")
            ]
        embeds = self.embed([*firsts, *seconds], pooling_params, use_tqdm)
        results = []
        for a, b in zip(embeds[: len(firsts)], embeds[len(firsts) :]):
            score = cosine(a.outputs.embedding, b.outputs.embedding)
            ids = a.prompt_token_ids + b.prompt_token_ids
            results.append(PoolingRequestOutput(a.request_id, ScoringOutput(score), ids))
        return results

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: bool,
        task: str,
    ) -> list[tuple[RequestOutput, list[float]]]:
        """Run pooling requests; each output with its finished vector. A failed one raises."""
        self.llm_engine.check_runner("pooling")
        pooler = self.llm_engine.pooler
        if pooler is not None and pooler.task != task:
            raise ValueError(
                f"{task} is not supported by this model, whose pooling task is {pooler.task!r}"
            )
        prompt_list = self._prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"pooling_params must be one PoolingParams or one per prompt "
                    f"({len(prompt_list)}), got {len(params_list)}"
                )
        results = []
        for out in self._run(prompt_list, params_list, use_tqdm):
            if out.error is not None or out.pooled is None:
                raise ValueError(f"request {out.request_id} failed: {out.error}")
            results.append((out, out.pooled))
        return results

    @staticmethod
    def _pooling_output(out: RequestOutput, result: T) -> PoolingRequestOutput[T]:

        return PoolingRequestOutput(
            out.request_id, result, out.prompt_token_ids, out.finished, out.num_cached_tokens
        )

    # ------------------------------------------------------------------
    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's `LLM.beam_search`), run inside the engine on
        copy-on-write blocks and batched like any other requests: the beams of a prompt share
        their history's KV blocks (paper §4.4). One `BeamSearchOutput` per prompt, best beam first.
        `lora_request`: as `generate`'s; every beam of a prompt runs under its adapter."""
        prompt_list = self._prompt_list(prompts)
        tokenizer = self.llm_engine.tokenizer
        results = []
        loras = self._lora_list(lora_request, prompt_list)
        for out in self._run(prompt_list, [params] * len(prompt_list), use_tqdm, loras):
            if out.error is not None:
                raise RuntimeError(f"beam search failed: {out.error}")
            beams = []
            for c in out.outputs:
                tokens = [*out.prompt_token_ids, *c.token_ids]
                text = None if tokenizer is None else str(tokenizer.decode(tokens))
                beams.append(
                    BeamSearchSequence(
                        tokens,
                        list(c.logprobs or []),
                        c.cumulative_logprob or 0.0,
                        text,
                        c.finish_reason,
                        c.stop_reason,
                    )
                )
            results.append(BeamSearchOutput(beams))
        return results

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        """One prompt (text, a dict, or a list of token ids) or many, as a list."""
        if isinstance(prompts, str | dict):
            return [prompts]
        if prompts and all(isinstance(p, int) for p in prompts):
            return [list(prompts)]  # type: ignore[arg-type]  # one tokenized prompt
        return list(prompts)  # type: ignore[arg-type]

    def _run(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | BeamSearchParams | PoolingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(self._counter)
            self._counter += 1
            order.append(rid)
            try:
                engine.add_request(rid, prompt, p, lora_request=loras[i] if loras else None)
            except PromptTooLongError as exc:
                # One bad prompt fails alone; the others still run (the reason is in the output).
                logger.warning("request %s failed: %s", rid, exc)
                text, ids = engine.tokenize_prompt(prompt)
                if isinstance(p, PoolingParams):
                    sampling = SamplingParams(max_tokens=1)  # a pooling request's placeholder
                else:
                    sampling = p if isinstance(p, SamplingParams) else p.sampling_params()
                request = Request(rid, text, ids, sampling)
                results[rid] = engine.fail_request(request, str(exc))
            except Exception:
                engine.abort_request(order)  # nothing half-added stays behind
                engine.take_aborted_outputs()
                raise
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, unit="req")
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                        generated += sum(len(o.token_ids) for o in out.outputs)
                        rate = generated / max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        except BaseException:
            # Ctrl-C (or a bug): free every block of this call's requests, then re-raise the
            # very exception, so a KeyboardInterrupt stays a KeyboardInterrupt.
            engine.abort_request(order)
            engine.take_aborted_outputs()
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]
