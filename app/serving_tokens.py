"""POST /tokenize and /detokenize, shaped like vLLM's: the tokens the generation endpoints would see."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.errors import InvalidRequest
from app.gateway import Gateway
from app.protocol import ChatMessage

TokenId = Annotated[int, Field(ge=0, strict=True)]


class TokenizeRequest(BaseModel):
    """Exactly one of ``prompt`` (as ``/v1/completions`` tokenizes it) or ``messages`` (as
    ``/v1/chat/completions`` templates them). Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    # prompt only: the chat template writes the special tokens of messages itself
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _exactly_one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


def tokenize(gateway: Gateway, request: TokenizeRequest) -> dict[str, Any]:
    gateway.check_model(request.model)
    if request.messages is not None:
        if request.add_special_tokens:
            raise InvalidRequest(
                "add_special_tokens applies to prompt only: messages are tokenized as the chat "
                "endpoint tokenizes them, special tokens from the chat template",
                param="add_special_tokens",
            )
        ids = gateway.chat_token_ids(request.messages, add_generation_prompt=request.add_generation_prompt)
    else:
        assert request.prompt is not None
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        ids = gateway.text_token_ids(request.prompt, add_special_tokens=add_special)
    strs = gateway.runner.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": gateway.max_context, "tokens": ids, "token_strs": strs}


def detokenize(gateway: Gateway, request: DetokenizeRequest) -> dict[str, Any]:
    gateway.check_model(request.model)
    gateway.check_token_ids(request.tokens, "tokens")
    return {"prompt": gateway.runner.tokenizer.decode(request.tokens)}
