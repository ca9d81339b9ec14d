"""The environment variables minivllm reads (vLLM keeps its own in `vllm/envs.py`).

One today: `MINIVLLM_CACHE`, the one folder where minivllm keeps what it makes once and reuses
(GGUF models converted to safetensors, the compiled CPU attention kernel). Like
`VLLM_CACHE_ROOT`, it defaults to a `minivllm` folder under `$XDG_CACHE_HOME`, else `~/.cache`.

This module imports nothing of minivllm, so any module may import it without creating a cycle
(tests/test_imports.py holds the package's import graph acyclic).

Tier: leaves. It imports no other tier of the package.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where minivllm caches what it builds: `$MINIVLLM_CACHE`, else `$XDG_CACHE_HOME/minivllm`,
    else `~/.cache/minivllm`. Read on every call, so a test may point it at a temporary folder."""
    if os.environ.get("MINIVLLM_CACHE"):
        return Path(os.environ["MINIVLLM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "minivllm"
