"""Speculative decoding: draft k tokens cheaply, verify them in one step of the model.

vLLM v1's `vllm/v1/spec_decode/` and `vllm/v1/sample/rejection_sampler.py`, on paged blocks:

- `config.py`: `SpeculativeConfig` (vLLM's field names), validated where it is made;
- `proposer.py`: what a proposer returns (`Draft`: token ids, and the draft's probabilities q
  where it sampled them);
- `ngram_proposer.py`: prompt lookup, the draft is what followed the latest earlier occurrence of
  the sequence's last n tokens;
- `draft_model_proposer.py`: a smaller model of the same vocabulary, with its own paged KV cache,
  drafts one token per step;
- `rejection_sampler.py`: Leviathan et al. / Chen et al. (2023), in plain PyTorch over the batch,
  so that the tokens kept are distributed exactly as plain sampling would draw them;
- `speculator.py`: the engine's side, which proposes before the scheduler runs and verifies after
  the model ran (the scheduler gives a request 1 + k slots and rolls back the rejected ones).

The package is imported only when `speculative_config` is set; its leaf `config.py` apart.
"""
