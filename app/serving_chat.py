"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from app.gateway import Gateway, collect, observed_events, sampling_params, usage
from app.pipeline import Finished, GenerationJob, PromptDone, TokenEvent
from app.protocol import ChatCompletionRequest, new_id, now
from app.sse import StreamFramer, stream_response


def _job(gateway: Gateway, request: ChatCompletionRequest) -> GenerationJob:
    gateway.check_model(request.model)
    levels = gateway.levels_for(request.kv_quality, request.kv_cache)
    prompt_ids = gateway.chat_token_ids(request.messages, add_generation_prompt=True)
    max_tokens = gateway.token_budget(len(prompt_ids), request.requested_max_tokens())
    return GenerationJob(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling_params(request),
        stops=request.stop_list(),
        levels=levels,
    )


async def chat_completion(gateway: Gateway, request: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
    job = _job(gateway, request)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        chunks = _stream(gateway, job, include_usage)
        return stream_response(chunks, on_error=lambda exc: gateway.metrics.http_errors.labels("stream").inc())

    out = await collect(gateway, "chat", job)
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
        "kv_cache_info": out.prompt.kv_info.model_dump(),
    }
    return JSONResponse(body)


async def _stream(gateway: Gateway, job: GenerationJob, include_usage: bool) -> AsyncIterator[str]:
    framer = StreamFramer("chat.completion.chunk", "chatcmpl", gateway.model_name)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return framer.choice({"delta": delta, "logprobs": None, "finish_reason": finish}, **extra)

    prompt: PromptDone | None = None
    async for event in observed_events(gateway, "chat", job):
        if isinstance(event, PromptDone):
            prompt = event
            yield chunk({"role": "assistant", "content": ""}, kv_cache_info=event.kv_info.model_dump())
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
