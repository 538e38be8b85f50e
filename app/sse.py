"""Server-sent events framing for streamed responses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from app.errors import error_body, to_api_error

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_event(chunk_id: str, obj: str, created: int, model: str, usage: dict[str, Any]) -> str:
    """The closing chunk of ``stream_options.include_usage``: no choices, just usage."""
    return sse({"id": chunk_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage})


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
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
