"""Incremental detokenizer: token ids in, new complete text out, stop strings applied.

Decoding a token alone is wrong for most tokenizers (SentencePiece drops a leading space
at the start of a decode, byte-level BPE tokens may hold part of a UTF-8 character), and
decoding the whole output every step costs O(output) per token. So, as vLLM does, we keep
two offsets into the token ids and decode only a short window:

    ids:   ... | prefix window     | unread tokens ... |
               ^ prefix_offset     ^ read_offset       ^ len(ids)

    prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]              (emitted unless incomplete)

When `new_text` ends with U+FFFD the last character's bytes are not all there yet: nothing
is emitted and the offsets stay, so the window grows by one token until the character is
complete. Otherwise both offsets advance. Each push costs O(new tokens * window).

Stop strings: text that could be the beginning of a stop string (the longest suffix that is
a proper prefix of one) is held back; when a stop string appears (also across tokens and
pushes) the text is cut there and every later push is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context for the first output


def fast_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """`ids -> text` through `tokenizer.decode` (splitserve's Tokenizer, or anything with its decode
    arguments), clean-up of tokenization spaces off: cleaning a window could differ from cleaning the
    whole text. Tokenizer.decode is the Rust decode plus one branch, so the two decodes per streamed
    token cost what the library costs."""
    decode = tokenizer.decode
    return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class DetokenizerDelta:
    """New text since the previous push; stop_str is the stop string that ended the output."""

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one push at a time.

    Invariants: the concatenation of every returned text plus `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    when no stop string matches (without prompt context; with it, a SentencePiece leading
    space of the first output token is kept, as in decode(prompt + output)), or that text cut at the first stop
    string (with the stop
    string kept when include_stop_str_in_output) when one does. No returned text ends in
    the middle of a character.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._decode_ids = fast_decode(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context  # prompt context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))
        self._emitted: list[str] = []  # text returned so far
        self._pending = ""  # decoded text held back as a possible stop string start
        self.stop_str: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        """All text decoded so far (emitted plus held back; cut at the stop string if any)."""
        return "".join(self._emitted) + self._pending

    def push(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add newly generated tokens; return the new complete text (may be empty)."""
        if self.finished:
            return DetokenizerDelta("", self.stop_str)
        new_text = "".join(self._decode_next(token_id) for token_id in token_ids)
        return DetokenizerDelta(self._emit(self._pending + new_text, final=False), self.stop_str)

    def flush(self) -> str:
        """End of output: return everything still held back (including an incomplete char)."""
        if self.finished:
            return ""
        tail = self._decode(self._prefix_offset, len(self._ids))[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        text = self._emit(self._pending + tail, final=True)
        self.finished = True
        return text

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_next(self, token_id: int) -> str:
        """Append one token; return the text it completes (empty while a char is partial)."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    def _emit(self, text: str, final: bool) -> str:
        """Apply stop strings to `text` (pending + new); record and return what goes out."""
        held = 0
        if self._stop:
            match = _find_first_stop(text, self._stop)
            if match is not None:
                index, stop_str = match
                text = text[: index + len(stop_str)] if self._include_stop else text[:index]
                self.stop_str, self.finished = stop_str, True
            elif not final:
                held = _stop_prefix_suffix_len(text, self._stop)
        out, self._pending = text[: len(text) - held], text[len(text) - held :]
        if out:
            self._emitted.append(out)
        return out


def _find_first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text; at equal index the longest stop string wins."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))):
            best = (index, stop)
    return best


def _stop_prefix_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
