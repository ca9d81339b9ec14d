"""Structured outputs: a grammar masks the logits of its own request's row, inside the batch.

- `params.py`   what a request asks for (`StructuredOutputsParams`) and the engine's settings
- `backend.py`  the seam to a grammar library: compile once, then a cheap matcher per sequence
- `xgrammar_backend.py`  that seam filled by xgrammar (vLLM's default backend)
- `manager.py`  compiled-grammar cache, compile timing, matcher creation and re-sync

The mask itself is applied by the sampler's logits-processor pipeline
(`minivllm/sample/logits_processors.py`). See docs/concepts/structured-outputs.md.

The package itself imports nothing, so that naming `params.py` (a leaf) or `backend.py` (the seam)
does not load the manager; the manager and xgrammar load with the first constrained request.
"""
