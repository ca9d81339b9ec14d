"""A local folder's generic fast-tokenizer class, found without `AutoTokenizer`'s detour.

`AutoTokenizer.from_pretrained(folder)` first reads the model's config through `AutoConfig`,
which imports much of transformers' model zoo, a large share of a learner's start-up
(`python -X importtime` shows it). A folder whose `tokenizer_config.json` names transformers'
generic tokenizers.json-backed class needs none of that: the class is imported from its own
module and built directly (`load_tokenizer` in loader.py); any other folder goes to
`AutoTokenizer`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

# `tokenizer_class` values that name transformers' generic tokenizers.json-backed class, which
# can be imported from its own module (v5 calls it TokenizersBackend; v4 PreTrainedTokenizerFast).
_GENERIC_FAST_TOKENIZERS = {
    "TokenizersBackend": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "PreTrainedTokenizerFast": ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"),
}


def generic_tokenizer_class(folder: Path) -> Any | None:
    """The generic fast-tokenizer class a local folder asks for, imported from its own module, or
    None (`AutoTokenizer` then decides)."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return None
    try:
        wanted = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError):
        return None  # AutoTokenizer reports it
    if wanted not in _GENERIC_FAST_TOKENIZERS:
        return None
    module, name = _GENERIC_FAST_TOKENIZERS[wanted]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # another transformers version: AutoTokenizer decides
        return None
