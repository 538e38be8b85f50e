"""POST /v1/completions (the legacy text API; with echo + logprobs, how quality is measured)."""

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
from app.protocol import CompletionRequest, new_id, now
from app.sse import StreamFramer, merged, stream_response
from scheduler.generation import Finished, GenerationJob, PromptDone, TokenEvent, TokenLogprob
from scheduler.tenancy import PUBLIC, KeySpace
from scheduler.text_stream import TextStream


def prompt_ids(gateway: Gateway, request: CompletionRequest) -> list[int]:
    """The token ids ``request`` is served with (also what ``/v1/completions/render`` answers)."""
    if isinstance(request.prompt, str):
        ids = gateway.text_token_ids(request.prompt)
        if not ids:
            raise InvalidRequest("prompt encodes to no tokens", param="prompt")
        return ids
    ids = list(request.prompt)
    gateway.check_token_ids(ids, "prompt")
    return ids


class _LogprobsBuilder:
    """The legacy ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.body: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }

    def add(self, entry: TokenLogprob) -> None:
        self.body["tokens"].append(entry.token)
        self.body["token_logprobs"].append(entry.logprob)
        self.body["top_logprobs"].append(entry.top)
        self.body["text_offset"].append(self.offset)
        self.offset += len(entry.token)


def _prompt_text(gateway: Gateway, request: CompletionRequest, job: GenerationJob) -> str:
    if isinstance(request.prompt, str):
        return request.prompt
    return gateway.runner.tokenizer.decode(job.prompt_ids)


async def completion(
    gateway: Gateway,
    request: CompletionRequest,
    disconnected: Disconnected | None = None,
    space: KeySpace = PUBLIC,
) -> JSONResponse | StreamingResponse | Response:
    admitted = time.perf_counter()  # a kv_slo_ms budget counts tokenization too
    gateway.check_model(request.model)
    jobs = gateway.jobs(
        request,
        prompt_ids(gateway, request),
        request.max_tokens,
        admitted=admitted,
        prompt_logprobs=request.logprobs if request.echo else None,
        logprobs=request.logprobs,
        key_space=space,
    )
    if request.stream:
        return stream_response(
            # admitted here, so a 429 is the response's status, not an error inside a 200 stream
            _stream(gateway, request, jobs, request.include_usage, gateway.admit_all(jobs)),
            on_error=lambda exc: gateway.metrics.http_errors.labels("stream", error_code(exc)).inc(),
        )

    outs = await collect(gateway, "completions", jobs, disconnected)
    if outs is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for index, out in enumerate(outs):
        text = out.text
        logprobs = None
        if request.logprobs is not None:
            builder = _LogprobsBuilder()
            for entry in out.prompt.prompt_logprobs or []:
                builder.add(entry)
            for token in out.tokens:
                assert token.logprob is not None
                builder.add(token.logprob)
            logprobs = builder.body
        if request.echo:
            text = _prompt_text(gateway, request, jobs[index]) + text
        choices.append(
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finished.reason}
        )
    info = outs[0].prompt.kv_info
    completion_tokens = sum(out.finished.completion_tokens for out in outs)
    body = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": gateway.model_name,
        "choices": choices,
        "usage": usage(len(jobs[0].prompt_ids), completion_tokens, info.cached_tokens).model_dump(),
        "kv_cache_info": gateway.kv_cache_info(info),
    }
    return JSONResponse(body)


async def _stream(
    gateway: Gateway,
    request: CompletionRequest,
    jobs: list[GenerationJob],
    include_usage: bool,
    streams: list[TextStream],
) -> AsyncIterator[str]:
    framer = StreamFramer("text_completion", "cmpl", gateway.model_name)

    def chunk(
        index: int, text: str, logprobs: dict | None = None, finish: str | None = None, **extra: Any
    ) -> str:
        return framer.choice({"text": text, "logprobs": logprobs, "finish_reason": finish}, index, **extra)

    prompt: PromptDone | None = None
    offsets = [0] * len(jobs)  # text_offset of each choice's next token
    completion = 0
    choices = [observed_events(gateway, "completions", job, events) for job, events in zip(jobs, streams)]
    async for index, event in merged(choices):
        if isinstance(event, PromptDone):
            prompt = prompt or event
            text, logprobs = "", None
            if request.echo:
                builder = _LogprobsBuilder()
                for entry in event.prompt_logprobs or []:
                    builder.add(entry)
                text = _prompt_text(gateway, request, jobs[index])
                offsets[index] = len(text)
                logprobs = builder.body if request.logprobs is not None else None
            # the first chunk of every choice carries kv_cache_info, with or without echo
            yield chunk(index, text, logprobs, kv_cache_info=gateway.kv_cache_info(event.kv_info))
        elif isinstance(event, TokenEvent):
            logprobs = None
            if event.logprob is not None:
                builder = _LogprobsBuilder(offsets[index])
                builder.add(event.logprob)
                logprobs = builder.body
            offsets[index] += len(event.text)
            if event.text or logprobs is not None:
                yield chunk(index, event.text, logprobs)
        elif isinstance(event, Finished):
            completion += event.completion_tokens
            yield chunk(index, event.text_tail, None, event.reason)
    if include_usage and prompt is not None:
        u = usage(len(jobs[0].prompt_ids), completion, prompt.kv_info.cached_tokens)
        yield framer.usage(u.model_dump())
