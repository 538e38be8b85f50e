"""A generation's events with their text: detokenization and stop strings, off the model thread.

The model thread emits token ids only (``scheduler.generation``). Its
consumer, the request's task on the event loop, wraps the events in a
``TextStream``: each ``TokenEvent`` gets the text it releases, each logprob
entry its token strings, and the final ``Finished`` the text held back until
the end. This is the work vLLM's output processor does outside its engine
core: the model thread spends its time on steps, and a tokenizer call costs
the same whatever the batch.

A stop string is found here too. At the token that completes one, the
stream ends with ``Finished("stop")`` counting the tokens up to it, and the
generation is cancelled: the model thread drops it at its next step, and
whatever it made in between is not delivered and not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from engine.detokenize import IncrementalText
from scheduler.generation import Finished, PromptDone, TokenEvent, TokenLogprob


class Events(Protocol):
    """A job's event stream (``app.admission.EventStream``): closing it cancels the job."""

    def __aiter__(self) -> Any: ...

    async def __anext__(self) -> Any: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


class TextStream:
    """``events`` with their text, for a request generating under ``stops``."""

    def __init__(self, events: Events, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> None:
        self._events = events
        self._tokenizer = tokenizer
        self._text = IncrementalText(tokenizer, stops)
        self._tokens = 0  # delivered
        self._stopped: Finished | None = None  # the end, once a stop string is found
        self._done = False

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        if self._stopped is not None:
            self._done = True
            return self._stopped
        event = await self._events.__anext__()
        if isinstance(event, TokenEvent):
            self._tokens += 1
            event.text = self._text.push(event.token_id)
            if event.logprob is not None:
                self._name(event.logprob)
            if self._text.stopped:
                self._stopped = Finished("stop", self._tokens)
                self._events.close()  # nothing after the stop is wanted
        elif isinstance(event, PromptDone):
            for entry in event.prompt_logprobs or ():
                self._name(entry)
        elif isinstance(event, Finished):
            self._done = True
            if event.reason != "abort":
                event.text_tail = self._text.finish()
        return event

    def close(self) -> None:
        self._done = True
        self._events.close()

    async def aclose(self) -> None:
        self.close()

    def _name(self, entry: TokenLogprob) -> None:
        entry.token = self._piece(entry.token_id)
        if entry.top_ids is not None:
            entry.top = {self._piece(token): value for token, value in entry.top_ids}

    def _piece(self, token: int) -> str:
        return self._tokenizer.decode([token])
