"""Sampling: one batched call turns a step's logits into next tokens (vLLM v1's `vllm/v1/sample/`).

- `metadata.py`           `SamplingMetadata`: each row's parameters as [B] tensors, built once a step
- `logits_processors.py`  the ordered pipeline applied to each row before sampling (penalties,
                          bias, min_tokens, grammar masks, temperature)
- `sampler.py`            greedy and random sampling, top-k / top-p / min-p, logprobs
- `prompt_logprobs.py`    the logprob of each prompt token, scored on the runner
- `rejection_sampler.py`  speculative decoding's verification (Leviathan et al. / Chen et al.,
                          2023), so that kept drafts are distributed as plain sampling draws

The model runner (minivllm/worker/) calls the sampler; the engine reads what it returns.
"""
