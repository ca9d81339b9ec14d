"""The tokenizer a GGUF file describes, as the transformers tokenizer the converted folder holds.

transformers builds most of them from the file itself (`AutoTokenizer.from_pretrained(...,
gguf_file=...)`: byte-level BPE "gpt2", sentencepiece "llama", unigram "t5"). It has no builder
for llama.cpp's "bert" vocabulary, WordPiece, which is built here as BERT's own tokenizer.

llama.cpp's BERT converter (`BertModel.set_vocab`, convert_hf_to_gguf.py) stores WordPiece's tokens
in the "phantom space" spelling its tokenizer (llm_tokenizer_wpm) matches against: a piece that
starts a word gets a leading "▁" ("paris" -> "▁paris"), a continuation loses its "##" ("##s" ->
"s"), and control tokens ([CLS], [SEP], ...) stay as they are. `wordpiece_vocab` spells them back.
The special tokens are the ids the converter wrote (gguf's `SpecialVocab`): [CLS] is the BOS token,
which llama.cpp puts first, as BERT's [CLS]; [SEP] the separator. llama.cpp's WordPiece lowercases
and strips accents, as an uncased BERT's tokenizer does (`do_lower_case`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PHANTOM_SPACE = "\u2581"
CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL (gguf.TokenType.CONTROL)
# BERT's special tokens: the keys llama.cpp writes their ids under (the first present is taken),
# and transformers' default where the file has none.
_SPECIAL_TOKENS = {
    "cls_token": (("bos_token_id",), "[CLS]"),
    "sep_token": (("seperator_token_id", "eos_token_id"), "[SEP]"),  # llama.cpp's spelling
    "unk_token": (("unknown_token_id",), "[UNK]"),
    "pad_token": (("padding_token_id",), "[PAD]"),
    "mask_token": (("mask_token_id",), "[MASK]"),
}


def gguf_tokenizer(path: Path, reader: Any, folder: Path) -> Any:
    """The transformers tokenizer of the file's vocabulary (`folder`: where a WordPiece
    vocabulary is written, vocab.txt)."""
    if reader.fields["tokenizer.ggml.model"].contents() == "bert":
        return wordpiece_tokenizer(reader, folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def wordpiece_vocab(tokens: list[str], types: list[int] | None) -> list[str]:
    """WordPiece's spelling of llama.cpp's phantom-space tokens. An older converter wrote no
    token types: it kept tokens in brackets ([CLS]) as they were."""
    if types is None:
        types = [CONTROL if t.startswith("[") and t.endswith("]") else 1 for t in tokens]
    return [
        token if kind == CONTROL else token[1:] if token.startswith(PHANTOM_SPACE) else f"##{token}"
        for token, kind in zip(tokens, types)
    ]


def wordpiece_tokenizer(reader: Any, folder: Path) -> Any:
    """BERT's tokenizer over the file's vocabulary, with its special tokens: [CLS] text [SEP]."""
    from transformers import BertTokenizer  # transformers 5: the fast one (4: the slow one)

    fields = reader.fields
    types = fields.get("tokenizer.ggml.token_type")
    vocab = wordpiece_vocab(
        fields["tokenizer.ggml.tokens"].contents(), None if types is None else types.contents()
    )
    special: dict[str, Any] = {}  # cls_token=..., sep_token=..., ...: BertTokenizer's keywords
    for name, (keys, default) in _SPECIAL_TOKENS.items():
        ids = [fields[f"tokenizer.ggml.{k}"] for k in keys if f"tokenizer.ggml.{k}" in fields]
        special[name] = vocab[int(ids[0].contents())] if ids else default
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token in vocab))
    return BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True, **special)
