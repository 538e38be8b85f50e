"""Server-sent events framing for streamed responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from app.errors import error_body, to_api_error
from app.protocol import new_id, now

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class StreamFramer:
    """The envelope every chunk of one streamed response shares: id, object, created, model."""

    def __init__(self, obj: str, id_prefix: str, model: str) -> None:
        self.head = {"id": new_id(id_prefix), "object": obj, "created": now(), "model": model}

    def choice(self, choice: dict[str, Any], index: int = 0, **extra: Any) -> str:
        return sse({**self.head, "choices": [{"index": index, **choice}], **extra})

    def usage(self, usage: dict[str, Any]) -> str:
        """The closing chunk of ``stream_options.include_usage``: no choices, just usage."""
        return sse({**self.head, "choices": [], "usage": usage})


def stream_response(chunks: AsyncIterator[str], on_error: Callable[[Exception], None]) -> StreamingResponse:
    """Frames already produced by ``chunks``; an error mid-stream becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in-band, as OpenAI does
            on_error(exc)
            err = to_api_error(exc)
            yield sse(error_body(err.message, err.type, err.param, err.code))
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield DONE

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several streams as they come, each with its stream's index (a request's ``n``
    choices). The first error ends it; leaving it early cancels every stream."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, end))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
