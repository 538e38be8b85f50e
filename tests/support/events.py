"""What a request emits, collected: the sink tests hand to the executor or the step loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from scheduler.generation import Finished, TokenEvent


@dataclass
class Collected:
    events: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)  # set by the last event

    def emit(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Finished | BaseException):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    @property
    def logprobs(self) -> list[float]:
        return [e.logprob.logprob for e in self.events if isinstance(e, TokenEvent)]

    @property
    def finished(self) -> Finished:
        return next(e for e in self.events if isinstance(e, Finished))

    @property
    def reason(self) -> str:
        """How the request ended; fails the test when it has not, or ended with an error."""
        assert self.done.is_set(), "the request has not ended"
        last = self.events[-1]
        assert isinstance(last, Finished), f"the request failed: {last!r}"
        return last.reason
