"""The bundled GGUF model as a float32 Hugging Face folder, for peers that cannot read GGUF the
way minivllm does (vLLM's CPU build, lm-eval's `hf` model): every system then runs the same
weights. Converted once per folder; transformers does the dequantizing."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def export_bundled_model(out: Path) -> Path:
    """`out`, holding the bundled GGUF as config.json, model.safetensors and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minivllm.model.loader import bundled_model_path

    gguf = bundled_model_path()
    if not (out / "config.json").exists():
        kwargs: dict[str, Any] = {"gguf_file": gguf.name}
        dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kwargs)
        # transformers will not save a model it loaded from GGUF: rebuild it from its config.
        config = dequantized.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
        model.load_state_dict(dequantized.state_dict())
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(out)
    return out
