"""Embedding models as llama.cpp's convert_hf_to_gguf.py writes them, for tests.

What its `BertModel` and `Qwen3Model` converters do, restated from their behaviour (not their
code):

- **bert**: tensor names from gguf's own `TensorNameMap` for `MODEL_ARCH.BERT`, the map the
  converter uses (token_embd, token_types, position_embd, token_embd_norm, blk.N.attn_q / attn_k /
  attn_v, attn_output, attn_output_norm, ffn_up, ffn_down, layer_output_norm, each .weight and
  .bias); BERT's own pooler and `position_ids` are left out. Metadata: the shape keys,
  `attention.layer_norm_epsilon`, `attention.causal` = false. The vocabulary: `tokenizer.ggml.model`
  = "bert", WordPiece's tokens in phantom-space spelling (a control token as it is, "##x" -> "x",
  any other "x" -> "▁x") with their token types (control for the special tokens),
  `token_type_count`, and the special token ids gguf's `SpecialVocab` reads from the folder.
- **`{arch}.pooling_type`**: from the folder's sentence-transformers Pooling module
  (`_try_set_pooling_type`: mean 1, cls 2, lasttoken 3). The converter looks for the module's old
  type name, `sentence_transformers.models.Pooling`; sentence-transformers 6 saves it under a
  new one, so any module whose type ends in "Pooling" is taken here.
- **qwen3** (Qwen3-Embedding): `llama_cpp_convert.convert`, plus `qwen3.pooling_type`, and no
  `output.weight` (the embedding is tied). Without a tokenizer: building SmolLM2's 49,152-token
  BPE from GGUF metadata takes transformers half a minute, and that path is the generating
  models' (tests/model/test_model_families_gguf.py).
- **types**: with `qtype` the 2-D weights (the token embedding and the linear layers) are F16 (1)
  or blocks (Q8_0: 8, written by gguf's `quantize`); biases, norms and the position and token-type
  embeddings stay F32, as the converter keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

from tests.utils.gguf_utils import write_gguf
from tests.utils.llama_cpp_convert import convert, encode, metadata

POOLING_TYPES = {"mean": 1, "cls": 2, "lasttoken": 3}  # llama.cpp's enum llama_pooling_type
_FLAG_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "lasttoken"}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType
_F32_ALWAYS = ("position_embd", "token_types")


def st_pooling_type(folder: Path) -> int | None:
    """The pooling type of the folder's sentence-transformers Pooling module, if it has one."""
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    for module in modules:
        if module["type"].endswith("Pooling"):
            cfg = json.loads((folder / module["path"] / "config.json").read_text())
            mode = cfg.get("pooling_mode") or next(
                _FLAG_MODES[k.removeprefix("pooling_mode_")]
                for k, on in cfg.items()
                if k.startswith("pooling_mode_") and on is True
            )
            return POOLING_TYPES[mode]
    return None


def phantom_vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """The folder's WordPiece vocabulary as llama.cpp's BERT converter writes it, and the
    token types (`get_vocab_base`: an added token is control if special, else user-defined; an
    id no token has, "[PAD{id}]", unused)."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(folder))
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i, f"[PAD{i}]")  # a duplicate in vocab.txt leaves its first id free
        if i not in by_id:
            kind = UNUSED
        elif token in added:
            kind = CONTROL if decoder[i].special else USER_DEFINED
        else:
            kind = NORMAL
        tokens.append(
            token if kind == CONTROL else token[2:] if token.startswith("##") else f"▁{token}"
        )
        types.append(kind)
    return tokens, types


def convert_bert(
    folder: Path,
    path: Path,
    qtype: int = 0,
    pooling_type: int | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """The BERT checkpoint in `folder` (a sentence-transformers or transformers folder) as the
    GGUF file llama.cpp's converter writes at `path`; `pooling_type` overrides the folder's,
    `extra` adds F32 tensors (a variant's)."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)

    def qtype_of(name: str) -> int:
        return 0 if name.startswith(_F32_ALWAYS) else qtype

    tensors = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name == "embeddings.position_ids" or name.startswith("pooler."):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        tensors[gguf_name] = encode(gguf_name, w.float(), qtype_of)
    for name, array in (extra or {}).items():
        tensors[name] = (array, 0)
    tokens, types = phantom_vocab(folder, config.vocab_size)
    fields: dict[str, object] = {
        "bert.context_length": config.max_position_embeddings,
        "bert.embedding_length": config.hidden_size,
        "bert.feed_forward_length": config.intermediate_size,
        "bert.block_count": config.num_hidden_layers,
        "bert.attention.head_count": config.num_attention_heads,
        "bert.attention.layer_norm_epsilon": float(config.layer_norm_eps),
        "bert.attention.causal": False,
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.token_type_count": config.type_vocab_size,
    }
    pooling_type = st_pooling_type(folder) if pooling_type is None else pooling_type
    if pooling_type is not None:
        fields["bert.pooling_type"] = pooling_type
    special = gguf.SpecialVocab(folder, n_vocab=len(tokens))
    return write_gguf(
        path, fields, tensors, arch="bert", add_more=lambda w: special.add_to_gguf(w, quiet=True)
    )


def convert_decoder_embedding(
    folder: Path, path: Path, arch: str, pooling_type: int, qtype_of: Any = None
) -> Path:
    """A tiny decoder (`save_tiny_decoder`'s folder) as an embedding GGUF file of llama.cpp
    architecture `arch`, with `{arch}.pooling_type` and no tokenizer (prompts are token ids)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    fields = metadata(config, arch) | {f"{arch}.pooling_type": pooling_type}
    return convert(config, folder, path, arch, qtype_of, fields=fields)
