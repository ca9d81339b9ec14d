"""See paging happen: a per-step trace of the engine's KV cache and a page that draws it.

- `recorder.py`: `StepRecorder`, attached to an engine (`LLM.trace()`, or the server's
  dashboard), records one plain dict per step: the batch, every block table, reference counts,
  prefix-cache blocks and the step's events (copy-on-write, preemption, cache hits, evictions,
  forks, finishes).
- `page.py`: writes that trace as one self-contained HTML page (script, style and data inline)
  that opens from the file system; the live dashboard serves the same page.
- `plot.py`: the whole run as one picture (block x step), with matplotlib, for the tutorials.

How the recorder subscribes to the engine's step is on the docs' architecture page
(docs/architecture.md, "the step as a message").
"""

from minivllm.trace.page import render_page, write_page
from minivllm.trace.recorder import TRACE_FORMAT_VERSION, StepRecorder, record

__all__ = ["TRACE_FORMAT_VERSION", "StepRecorder", "record", "render_page", "write_page"]
