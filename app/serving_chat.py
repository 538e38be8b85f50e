"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from app.errors import InvalidRequest, error_code
from app.gateway import (
    CLIENT_CLOSED,
    Disconnected,
    Gateway,
    collect,
    observed_events,
    usage,
)
from app.protocol import ChatCompletionRequest, new_id, now
from app.sse import StreamFramer, merged, stream_response
from scheduler.generation import Finished, GenerationJob, PromptDone, TokenEvent, TokenLogprob
from scheduler.tenancy import PUBLIC, KeySpace
from scheduler.text_stream import TextStream


async def chat_completion(
    gateway: Gateway,
    request: ChatCompletionRequest,
    disconnected: Disconnected | None = None,
    space: KeySpace = PUBLIC,
) -> JSONResponse | StreamingResponse | Response:
    admitted = time.perf_counter()  # a kv_slo_ms budget counts tokenization too
    gateway.check_model(request.model)
    refused = request.unsupported()
    if refused is not None:
        raise InvalidRequest(refused[1], param=refused[0], code="unsupported_parameter")
    prompt_ids = gateway.chat_token_ids(request.messages, add_generation_prompt=True)
    top = (request.top_logprobs or 0) if request.logprobs else None
    jobs = gateway.jobs(
        request, prompt_ids, request.requested_max_tokens(), admitted=admitted, logprobs=top, key_space=space
    )
    if request.stream:
        # admitted here, so a 429 is the response's status, not an error inside a 200 stream
        chunks = _stream(gateway, jobs, request.include_usage, gateway.admit_all(jobs))
        return stream_response(
            chunks, on_error=lambda exc: gateway.metrics.http_errors.labels("stream", error_code(exc)).inc()
        )

    outs = await collect(gateway, "chat", jobs, disconnected)
    if outs is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": {"content": [_logprob(t.logprob) for t in out.tokens if t.logprob]}
            if request.logprobs
            else None,
            "finish_reason": out.finished.reason,
        }
        for i, out in enumerate(outs)
    ]
    completion = sum(out.finished.completion_tokens for out in outs)
    info = outs[0].prompt.kv_info
    body = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": gateway.model_name,
        "choices": choices,
        "usage": usage(len(prompt_ids), completion, info.cached_tokens).model_dump(),
        "kv_cache_info": gateway.kv_cache_info(info),
    }
    return JSONResponse(body)


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    """OpenAI's chat logprob entry: the token, its logprob and UTF-8 bytes, and the top ones."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode()),
        "top_logprobs": [
            {"token": token, "logprob": value, "bytes": list(token.encode())}
            for token, value in (entry.top or {}).items()
        ],
    }


async def _stream(
    gateway: Gateway, jobs: list[GenerationJob], include_usage: bool, streams: list[TextStream]
) -> AsyncIterator[str]:
    framer = StreamFramer("chat.completion.chunk", "chatcmpl", gateway.model_name)

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None, **extra: Any
    ) -> str:
        return framer.choice({"delta": delta, "logprobs": logprobs, "finish_reason": finish}, index, **extra)

    prompt: PromptDone | None = None
    completion = 0
    choices = [observed_events(gateway, "chat", job, events) for job, events in zip(jobs, streams)]
    async for index, event in merged(choices):
        if isinstance(event, PromptDone):
            prompt = prompt or event
            yield chunk(
                index,
                {"role": "assistant", "content": ""},
                kv_cache_info=gateway.kv_cache_info(event.kv_info),
            )
        elif isinstance(event, TokenEvent):
            logprobs = {"content": [_logprob(event.logprob)]} if event.logprob else None
            if event.text or logprobs:
                yield chunk(index, {"content": event.text}, logprobs=logprobs)
        elif isinstance(event, Finished):
            completion += event.completion_tokens
            if event.text_tail:
                yield chunk(index, {"content": event.text_tail})
            yield chunk(index, {}, event.reason)
    if include_usage and prompt is not None:
        u = usage(len(jobs[0].prompt_ids), completion, prompt.kv_info.cached_tokens)
        yield framer.usage(u.model_dump())
