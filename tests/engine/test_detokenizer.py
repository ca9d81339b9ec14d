"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE: multi-byte characters
are split across tokens, special tokens are <|im_start|>, <|im_end|> = EOS, <|endoftext|>)."""

from __future__ import annotations

import random

import pytest

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [
    "Hello 😀 world",
    "你好，世界！这是一个测试。",
    "café naïve résumé — Ærøskøbing",
    "emoji soup: 🇫🇷👍🏽🧑‍💻 done",
    "code:\n\tif x != y:  return 'ok'  # ✓",
]


@pytest.fixture(scope="module")
def tok(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, output_ids, params=None, prompt=PROMPT, chunk=1):
    """Feed `output_ids` `chunk` at a time; return (detokenizer, deltas incl. finish's)."""
    params = params or SamplingParams(max_tokens=None)
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), params)
    deltas = []
    for start in range(0, len(output_ids), chunk):
        deltas.append(detok.append(output_ids[start : start + chunk]))
        assert detok.output_text == "".join(deltas)
        if detok.finished:
            break
    deltas.append(detok.finish())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_decode_of_all_ids(tok, text, chunk):
    ids = encode(tok, text)
    detok, deltas = stream(tok, ids, chunk=chunk)
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=True)
    assert detok.output_text == text
    assert not any("\ufffd" in d for d in deltas)  # half characters are never shown


def test_emoji_split_over_two_tokens_waits_for_the_second(tok):
    ids = encode(tok, "Hello 😀 world")
    assert len(ids) == 4  # 'Hello', ' ' + 3 bytes of 😀, its 4th byte, ' world'
    _, deltas = stream(tok, ids)
    assert deltas == ["Hello", "", " 😀", " world", ""]


def test_random_token_ids_still_add_up_to_decode(tok):
    # Random ids include lone byte tokens that never form a character: the text must still be
    # exactly what decode() gives, with the broken bytes shown as U+FFFD.
    rng = random.Random(0)
    byte_tokens = [i for i in range(200, 400)]  # many single-byte fragments live here
    for _ in range(20):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(49152)]
        ids += [rng.choice(byte_tokens) for _ in range(rng.randrange(1, 12))]
        ids = [i for i in ids if i > 16]  # no special tokens
        _, deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    ids = [1, *encode(tok, "user\nhi"), 0, *encode(tok, " there")]  # <|im_start|>, <|endoftext|>
    params = SamplingParams(skip_special_tokens=skip, max_tokens=None)
    detok, _ = stream(tok, ids, params)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    expected = "user\nhi there" if skip else "<|im_start|>user\nhi<|endoftext|> there"
    assert detok.output_text == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(skip_special_tokens=False), "Hi!"),  # EOS ends it and is not text
        (
            SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True),
            "Hi!<|im_end|>",
        ),
        (SamplingParams(skip_special_tokens=False, ignore_eos=True), "Hi!<|im_end|>"),
        (SamplingParams(include_stop_str_in_output=True), "Hi!"),  # EOS is a special token
    ],
)
def test_eos_is_left_out_of_the_text_unless_asked(tok, params, expected):
    assert tok.eos_token_id == 2
    detok, _ = stream(tok, [*encode(tok, "Hi!"), 2], params)
    assert detok.output_text == expected


def test_stop_token_id_is_left_out_of_the_text(tok):
    ids = encode(tok, "one two three")
    params = SamplingParams(stop_token_ids=[ids[1]])
    detok, _ = stream(tok, ids[:2], params)
    assert detok.output_text == "one"
    params = SamplingParams(stop_token_ids=[ids[1]], include_stop_str_in_output=True)
    assert stream(tok, ids[:2], params)[0].output_text == "one two"


@pytest.mark.parametrize(
    ("include", "expected_text", "expected_deltas"),
    [
        (False, "Hell", ["Hell", "", ""]),
        (True, "Hello wor", ["Hello", " wor", ""]),
    ],
)
def test_stop_string_across_a_token_boundary(tok, include, expected_text, expected_deltas):
    ids = encode(tok, "Hello world, this is a test")
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    params = SamplingParams(stop="o wor", include_stop_str_in_output=include)
    detok, deltas = stream(tok, ids, params)
    assert detok.stop_string_matched == "o wor"
    assert detok.finished and detok.num_output_tokens == 2  # stopped at the 2nd token
    assert detok.output_text == expected_text == "".join(deltas)
    assert deltas == expected_deltas
    with pytest.raises(RuntimeError):
        detok.append(ids[2:3])


def test_earliest_stop_string_wins_within_one_step(tok):
    ids = encode(tok, "alpha beta gamma")
    params = SamplingParams(stop=["gamma", "beta", "pha be"])
    detok, _ = stream(tok, ids, params, chunk=len(ids))
    assert (detok.output_text, detok.stop_string_matched) == ("al", "pha be")


def test_possible_stop_prefix_is_held_back_until_it_cannot_match(tok):
    ids = encode(tok, "Hello world? yes")
    assert tok.convert_ids_to_tokens(ids) == ["Hello", "Ġworld", "?", "Ġyes"]
    detok, deltas = stream(tok, ids, SamplingParams(stop=["world!", "xyz"]))
    assert deltas == ["Hello", " ", "world?", " yes", ""]
    assert detok.stop_string_matched is None


def test_finish_flushes_held_back_text(tok):
    ids = encode(tok, "Hello world")
    detok, deltas = stream(tok, ids, SamplingParams(stop=["world!"]))
    assert deltas == ["Hello", " ", "world"]
    assert detok.output_text == "Hello world"


def test_include_stop_str_holds_nothing_back(tok):
    ids = encode(tok, "Hello world")
    _, deltas = stream(tok, ids, SamplingParams(stop=["world!"], include_stop_str_in_output=True))
    assert deltas == ["Hello", " world", ""]


def test_stop_strings_only_count_after_min_tokens(tok):
    ids = encode(tok, "a b a b a b")  # 'a', ' b', ' a', ...
    assert len(ids) == 6
    detok, _ = stream(tok, ids, SamplingParams(stop=" b", min_tokens=2))
    assert detok.output_text == "a b a"  # the 2nd token's " b" came too early to stop
    assert detok.num_output_tokens == 4


def test_stop_string_inside_a_multibyte_character_sequence(tok):
    ids = encode(tok, "价格是€100，好吗")
    detok, _ = stream(tok, ids, SamplingParams(stop="€1"))
    assert detok.output_text == "价格是"
    assert detok.stop_string_matched == "€1"


class CountingTokenizer:
    """Delegates to the real tokenizer and records the longest id list decode() was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0
        self.eos_token_id = tok.eos_token_id

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_work_per_token_is_bounded_by_a_small_window(tok):
    ids = encode(tok, " ".join(TEXTS) * 20)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, encode(tok, PROMPT), SamplingParams())  # type: ignore[arg-type]
    text = "".join(detok.append([i]) for i in ids) + detok.finish()
    assert len(ids) > 500
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert counting.longest <= 8  # context + the tokens of one character, never the sequence
