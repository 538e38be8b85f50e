"""Turn a token stream into text deltas, honouring stop strings.

Text is re-decoded from a few tokens back each step, because one token's text
depends on its neighbours (byte-level BPE splits UTF-8 characters across
tokens; some tokenizers drop leading spaces at the start of a decode). Text
that could still become a stop string, or ends in an incomplete character, is
held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalText:
    tokenizer: PreTrainedTokenizerBase
    stops: Sequence[str] = ()
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # all text decided so far (emitted or held back)
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: bool = False

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now safe to emit."""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of generation: release everything held back (minus a stop string)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        for stop in self.stops:
            # search from just before the emitted part, so a stop spanning the boundary is found
            at = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
                return self._take(len(self.text))
        if final:
            return self._take(len(self.text))
        end = len(self.text)
        if self.text.endswith(_REPLACEMENT):
            end = len(self.text.rstrip(_REPLACEMENT))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if self.text[end - n : end] == stop[:n]:
                    end -= n
                    break
        return self._take(max(end, self.emitted))

    def _take(self, end: int) -> str:
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
