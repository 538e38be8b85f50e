"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from app.errors import error_code
from app.gateway import CLIENT_CLOSED, Disconnected, Gateway, collect, kv_cache_info, observed_events, usage
from app.protocol import ChatCompletionRequest, new_id, now
from app.sse import StreamFramer, stream_response
from scheduler.generation import Finished, GenerationJob, PromptDone, TokenEvent


async def chat_completion(
    gateway: Gateway, request: ChatCompletionRequest, disconnected: Disconnected | None = None
) -> JSONResponse | StreamingResponse | Response:
    admitted = time.perf_counter()  # a kv_slo_ms budget counts tokenization too
    gateway.check_model(request.model)
    prompt_ids = gateway.chat_token_ids(request.messages, add_generation_prompt=True)
    job = gateway.job(request, prompt_ids, request.requested_max_tokens(), admitted=admitted)
    if request.stream:
        # admitted here, so a 429 is the response's status, not an error inside a 200 stream
        chunks = _stream(gateway, job, request.include_usage, gateway.events(job))
        return stream_response(
            chunks, on_error=lambda exc: gateway.metrics.http_errors.labels("stream", error_code(exc)).inc()
        )

    out = await collect(gateway, "chat", job, disconnected)
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    body = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": gateway.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None,
                "finish_reason": out.finished.reason,
            }
        ],
        "usage": usage(
            len(job.prompt_ids), out.finished.completion_tokens, out.prompt.kv_info.cached_tokens
        ).model_dump(),
        "kv_cache_info": kv_cache_info(out.prompt.kv_info),
    }
    return JSONResponse(body)


async def _stream(
    gateway: Gateway, job: GenerationJob, include_usage: bool, events: AsyncIterator[Any]
) -> AsyncIterator[str]:
    framer = StreamFramer("chat.completion.chunk", "chatcmpl", gateway.model_name)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return framer.choice({"delta": delta, "logprobs": None, "finish_reason": finish}, **extra)

    prompt: PromptDone | None = None
    async for event in observed_events(gateway, "chat", job, events):
        if isinstance(event, PromptDone):
            prompt = event
            yield chunk({"role": "assistant", "content": ""}, kv_cache_info=kv_cache_info(event.kv_info))
        elif isinstance(event, TokenEvent):
            if event.text:
                yield chunk({"content": event.text})
        elif isinstance(event, Finished):
            if event.text_tail:
                yield chunk({"content": event.text_tail})
            yield chunk({}, event.reason)
            if include_usage and prompt is not None:
                u = usage(len(job.prompt_ids), event.completion_tokens, prompt.kv_info.cached_tokens)
                yield framer.usage(u.model_dump())
