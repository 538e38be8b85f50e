"""Turn a token stream into text deltas, honouring stop strings.

Each step decodes only a short window of recent tokens, as vLLM and TGI do, so
a token costs the same however long the output already is. One token's text
depends on its neighbours: byte-level BPE splits UTF-8 characters across
tokens, and some tokenizers drop the leading space of whatever a decode starts
with. So the window keeps a few already-released tokens as left context, and
the new text is the window's decode minus the context's decode. While the
window ends in an incomplete character (U+FFFD) its tokens stay pending.

Text that could still become a stop string is held back until it cannot; a
stop string can only start in that held text or in the new text, so nothing
older is kept for the search.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
# Left context decoded with the new tokens; one token suffices for a dropped
# leading space, a few more cost little.
_CONTEXT_TOKENS = 4
# A UTF-8 character has at most 4 bytes, and every non-special token carries at
# least one, so a window still ending in U+FFFD after this many new tokens ends
# in bytes that are invalid whatever follows; the full decode shows them as
# U+FFFD too, so they are released.
_MAX_PENDING_TOKENS = 8


class IncrementalText:
    """Text deltas for one generated sequence; special tokens are skipped."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [stop for stop in stops if stop]
        self.stopped = False
        # what decode(..., skip_special_tokens=True) leaves out; dropping these up
        # front keeps them out of the context window, where they would read as
        # the start of a decode
        self._special = set(tokenizer.all_special_ids) | {
            token for token, added in tokenizer.added_tokens_decoder.items() if added.special
        }
        self._window: list[int] = []  # context tokens, then pending ones
        self._read = 0  # tokens of ``_window`` that are context
        self._context_text = ""  # decode of the context tokens
        self._held = ""  # text decoded but held back: it may be the start of a stop string

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now safe to emit."""
        if self.stopped or token in self._special:
            return ""
        self._window.append(token)
        text = self._decode_window()
        if text.endswith(_REPLACEMENT) and len(self._window) - self._read < _MAX_PENDING_TOKENS:
            return ""
        return self._release(self._advance(text), final=False)

    def finish(self) -> str:
        """The end of generation: release everything held back (minus a stop string)."""
        if self.stopped:
            return ""
        new = self._advance(self._decode_window()) if len(self._window) > self._read else ""
        return self._release(new, final=True)

    def _decode_window(self) -> str:
        return self.tokenizer.decode(self._window, skip_special_tokens=True)

    def _advance(self, text: str) -> str:
        """Mark the pending tokens as released; returns their text."""
        new = text[len(self._context_text) :]
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._read = len(self._window)
        self._context_text = self._decode_window()
        return new

    def _release(self, new: str, final: bool) -> str:
        text = self._held + new
        at = first_stop(text, self.stops)
        if at is not None:
            self.stopped = True
            self._held = ""
            return text[:at]
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where ``text`` is cut: at the stop string that is complete first (the earliest end; of two
    ending together, the earlier start). A stream stops there, however its tokens split the text."""
    found = [(at + len(stop), at) for stop in stops if (at := text.find(stop)) != -1]
    return min(found)[1] if found else None
