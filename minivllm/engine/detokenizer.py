"""Incremental detokenization: the text of a sequence, one delta per step, with stop strings.

How the text grows — vLLM's prefix_offset / read_offset idea (`detokenize_incrementally` in
`vllm/transformers_utils/detokenizer_utils.py`), applied to token ids and `tokenizer.decode`:

    token_ids:  ... | prefix_offset ... read_offset | new tokens
    prefix_text = decode(token_ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(token_ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

Why a window and not `decode(all ids)` each step: that is O(length) per token, O(length²) per
sequence. Why not decode each token alone: a token's text depends on its neighbours — a byte-level
BPE token may hold half of a UTF-8 character (😀 is two SmolLM2 tokens, each "�" on its own), and
SentencePiece decoders drop the leading space of the first token of what they are given. Decoding a
short window that starts a few tokens back gives each new token its context, and the prefix cancels
out. While the window's text ends in "�" (U+FFFD, an incomplete character), nothing is emitted and
the offsets stay put, so the window grows until the character is whole. The window starts with the
last prompt tokens, for the same context, and is cut after each emission: O(window) per token.

Why `decode` of ids rather than vLLM's `convert_ids_to_tokens` + `convert_tokens_to_string`: the
tokenizer itself then applies `skip_special_tokens` and `spaces_between_special_tokens` exactly as
`tokenizer.decode(all ids)` would, so the deltas add up to that text by construction.

Stop strings. After each token the new text is searched for the stop strings (only the part where a
new match can be: the last len(stop) - 1 old characters and the new ones). On a match the text is
cut before the stop string (or after it, with `include_stop_str_in_output`) and the sequence is
finished. Deltas never need to be taken back: the longest end of the text that is the beginning of
some stop string is held back until the next tokens show that it is not one (or `finish()` flushes
it). EOS and `stop_token_ids` that end the sequence are not decoded, unless
`include_stop_str_in_output` (vLLM's behaviour; EOS is still dropped by `skip_special_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minivllm.engine.stop_checker import is_stop_token
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context before the first output token (vLLM uses 5 too).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence. Call `append` with each step's new tokens, and `finish` once
    the sequence has finished (for any reason) to flush text held back for stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_id: int | None = None,  # None: the tokenizer's
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.stop: list[str] = list(params.stop or [])
        self.num_output_tokens = 0
        self.stop_string_matched: str | None = None
        self.finished = False

        # The decode window: [prefix_offset, read_offset) is emitted context, the rest is pending.
        self._window: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._text = ""  # all decoded output text, including what is held back
        self._num_emitted = 0  # chars of _text handed out as deltas

    @property
    def output_text(self) -> str:
        """The text handed out so far (the concatenation of the deltas); final after `finish`."""
        return self._text[: self._num_emitted]

    def append(self, token_ids: Sequence[int]) -> str:
        """Add new output tokens; return the text delta they make safe to show."""
        if self.finished:
            raise RuntimeError("append() after the sequence finished")
        for token_id in token_ids:
            self.num_output_tokens += 1
            if (
                is_stop_token(token_id, self.num_output_tokens, self.params, self.eos_token_id)
                and not self.params.include_stop_str_in_output
            ):
                continue  # it ends the sequence; the stop checker reports it
            old_len = len(self._text)
            self._window.append(token_id)
            self._text += self._decode_pending()
            if self.stop and self.params.stops_allowed(self.num_output_tokens):
                self._check_stop_strings(old_len)
                if self.finished:
                    break
        return self._take_delta()

    def finish(self) -> str:
        """Mark the sequence finished and return the text still held back (and the bytes of an
        unfinished character, shown as "\ufffd" as `tokenizer.decode` shows them)."""
        if not self.finished:
            # Stop strings are not searched here: the sequence has already ended for another
            # reason, and a partial character cannot complete a stop string.
            self._text += self._decode_pending(final=True)
            self.finished = True
        return self._take_delta()

    # ------------------------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(
                token_ids,
                skip_special_tokens=self.params.skip_special_tokens,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            )
        )

    def _decode_pending(self, final: bool = False) -> str:
        """The text the window's pending tokens add, or "" while it ends in a partial character
        (unless `final`: then the partial character stays as "\ufffd", as `decode` would show it)."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 character: wait for the bytes that finish it
        # The emitted tokens become the next window's context; older ones are not needed again.
        del self._window[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._window)
        return new_text[len(prefix_text) :]

    def _check_stop_strings(self, old_len: int) -> None:
        """Find the earliest stop string that ends in the new text; cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # A new match ends after old_len, so it starts at most len(stop) - 1 chars before it.
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self._text = self._text[:end]
        self.stop_string_matched = stop
        self.finished = True

    def _num_held_back(self) -> int:
        """Length of the longest end of the text that could still grow into a stop string."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0  # an included stop string is emitted anyway, so nothing needs holding
        longest = min(max(len(s) for s in self.stop) - 1, len(self._text))
        for n in range(longest, 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self.stop):
                return n
        return 0

    def _take_delta(self) -> str:
        end = len(self._text) if self.finished else len(self._text) - self._num_held_back()
        assert end >= self._num_emitted, "held-back text must cover any later stop string"
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return delta
