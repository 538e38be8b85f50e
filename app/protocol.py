"""Request and response models of the HTTP API (OpenAI's shapes plus documented extensions).

Pure data: nothing here imports the engine, the scheduler or the store.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

# Sampling divides the logits by the temperature and the repetition penalty, then keeps a nucleus of
# top_p: a value of 1e-38 overflowed float32 logits to inf, and a top_p of 5e-324 rounded to 0 kept no
# token; the sampler failed on both. These limits keep every accepted request samplable.
GREEDY_BELOW = 1e-5  # as vLLM: a lower temperature samples greedily
MIN_REPETITION_PENALTY = 0.01
# holds the top token alone (its probability is at least 1 / vocabulary), as any smaller top_p does
MIN_TOP_P = 1e-6


def _temperature(value: float) -> float:
    return 0.0 if value < GREEDY_BELOW else value


def _top_p(value: float) -> float:
    return max(value, MIN_TOP_P)


Temperature = Annotated[float, Field(ge=0.0, le=2.0), AfterValidator(_temperature)]
TopP = Annotated[float, Field(gt=0.0, le=1.0), AfterValidator(_top_p)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_STOPS = 4
MAX_N = 8
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TTL_SECONDS = 10 * 365 * 86400
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
# torch seeds a generator with any 64-bit value; choice i of n samples with seed + i, still within 2**64
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# token ids are hashed as uint32 into storage keys; no vocabulary comes near (the gateway checks its own)
MAX_TOKEN_ID = 2**32 - 1
# logit_bias keys: plain decimal token ids; ``int()`` would also take " 12", "1_000" and non-ASCII digits
_TOKEN_KEY = re.compile(r"[0-9]{1,20}")

# Fields that accept several shapes are normalized to one by a "before" validator that also
# states the constraint: a pydantic union reports each member's failure ("stop.str: Input should
# be a valid string" for a fifth stop string), which names neither the field nor the rule.


def _unicode(value: str) -> str:
    """Text the tokenizer can encode: JSON may escape a lone surrogate (``"\\ud800"``), UTF-8 cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


# every string that reaches the tokenizer or the chat template
Text = Annotated[str, AfterValidator(_unicode)]


def _stop_list(value: Any) -> Any:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


def _token_ids(value: Any) -> Any:
    if not isinstance(value, list):
        raise ValueError("must be a list of token ids")  # noqa: TRY004 - pydantic reports ValueError only
    if not value:
        raise ValueError("must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("token ids must be integers")
    if any(t < 0 for t in value):
        raise ValueError("token ids must be >= 0")
    if any(t > MAX_TOKEN_ID for t in value):
        raise ValueError(f"token ids must be <= {MAX_TOKEN_ID}")
    return value


def _prompt(value: Any) -> Any:
    """A string, a list of token ids, or a list holding one string."""
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        if len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        value = value[0]
    if isinstance(value, str):
        if value == "":
            raise ValueError("prompt must not be empty")
        return _unicode(value)
    if isinstance(value, list):
        return _token_ids(value)
    raise ValueError("must be a string or a list of token ids")


def _logit_bias(value: Any) -> Any:
    """OpenAI's shape: token ids (as strings, JSON keys) to a bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")  # noqa: TRY004 - pydantic reports ValueError only
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, int) and not isinstance(key, bool):
            token = key
        elif isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise ValueError(f"keys must be token ids; got {key!r}")
        if token < 0:
            raise ValueError("token ids must be >= 0")
        if token > MAX_TOKEN_ID:
            raise ValueError(f"token ids must be <= {MAX_TOKEN_ID}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ValueError(f"the bias of token {token} must be a number in [-100, 100]")
        out[token] = float(bias)
    return out


def _content_parts(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is not None and not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    return value


# json_schema_input_type: /openapi.json describes what clients may send, not the normalized form
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIdList = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]
Stop = Annotated[
    list[str] | None,
    BeforeValidator(
        _stop_list,
        json_schema_input_type=NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOPS)] | None,
    ),
]
LogitBias = Annotated[
    dict[int, float] | None,
    BeforeValidator(_logit_bias),
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": f"^{_TOKEN_KEY.pattern}$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                    "maxProperties": MAX_LOGIT_BIAS,
                },
                {"type": "null"},
            ]
        }
    ),
]
TokenIds = Annotated[list[int], BeforeValidator(_token_ids, json_schema_input_type=TokenIdList)]
Prompt = Annotated[
    str | list[int],
    BeforeValidator(
        _prompt,
        json_schema_input_type=NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)]
        | TokenIdList,
    ),
]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string arrives here as one text part; None only for an assistant message
    content: Annotated[
        list[TextPart] | None,
        BeforeValidator(_content_parts, json_schema_input_type=str | list[TextPart] | None),
    ] = Field(None, validate_default=True)
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: list[TextPart] | None, info: ValidationInfo) -> list[TextPart] | None:
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        return value

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class StreamOptions(BaseModel):
    include_usage: bool = False


class KVExtension(BaseModel):
    """Extension fields shared by chat and completions requests."""

    kv_cache: bool = Field(True, description="false: ignore stored KV for this request")
    kv_quality: str = Field("auto", description="'auto' or a level name such as 'lossless'")
    kv_slo_ms: Annotated[float, Field(gt=0, le=3_600_000)] | None = Field(
        None, description="time-to-first-token budget for 'auto' (default: the server's)"
    )
    cache_salt: CacheSalt | None = Field(
        None, description="as in vLLM: requests share stored KV only with requests of the same salt"
    )


# Fields vllm-router (after SGLang's) writes into every request it forwards, at these values: they
# ask for nothing we do not do, so only another value is named as ignored.
ROUTER_DEFAULTS: dict[str, object] = {
    "no_stop_trim": False,
    "return_hidden_states": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
    "continue_final_message": False,
}


def unasked_fields(extra: dict[str, Any] | None) -> list[str]:
    """The unknown fields of a request a client asked for something with (router defaults aside)."""
    return sorted(k for k, v in (extra or {}).items() if k not in ROUTER_DEFAULTS or v != ROUTER_DEFAULTS[k])


class SamplingFields(BaseModel):
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=10.0)] = Field(
        1.0, description="extension (as in vLLM): > 1 discourages tokens of the prompt and the output"
    )
    logit_bias: LogitBias = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="extension (as in vLLM): generate max_tokens tokens")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def ignored_fields(self) -> list[str]:
        return unasked_fields(self.model_extra)


class ChatCompletionRequest(SamplingFields, KVExtension):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, and named in the log

    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # accepted so that they can be refused by name (``unsupported``), never silently ignored
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("set max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def unsupported(self) -> tuple[str, str] | None:
        """A parameter this gateway cannot honour, and why; None when there is none."""
        if self.tools:
            return "tools", "tool calling is not supported by this gateway"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calling is not supported by this gateway"
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            return "response_format", f"response_format {kind!r} is not supported; only 'text'"
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields, KVExtension):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, and named in the log

    model: str
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo")
        return self


class ContextRequest(BaseModel):
    """POST /contexts: exactly one of text, messages, prompt_token_ids."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, and named in the log
    SOURCES: ClassVar[tuple[str, ...]] = ("text", "messages", "prompt_token_ids")

    model: str | None = None
    text: Annotated[Text, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    prompt_token_ids: TokenIds | None = None
    levels: Annotated[list[str], Field(min_length=1)] | None = None
    cache_salt: CacheSalt | None = Field(
        None, description="the salt of the requests that are to reuse this context (as in vLLM)"
    )
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS)] | None = Field(
        None, description="the context expires this long after it is stored; default: pinned (never)"
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ContextRequest:
        given = [f for f in self.SOURCES if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, messages, prompt_token_ids")
        return self

    def ignored_fields(self) -> list[str]:
        return unasked_fields(self.model_extra)

    @property
    def source(self) -> str:
        """The field the context's tokens come from."""
        return next(f for f in self.SOURCES if getattr(self, f) is not None)


# -- responses ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None  # the request field at fault, as OpenAI names nested ones: ``messages[0].content``
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the API answers: OpenAI's error object (built by ``app.errors``)."""

    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KVChunkInfo(BaseModel):
    index: int
    tokens: int
    source: Literal["store", "text"]
    level: str | None  # the level fetched; None for text (recomputed)
    bytes: int
    fetch_ms: float
    decode_ms: float
    prefill_ms: float
    idle_ms: float  # waited for the chunk's bytes
    gate_ms: float = 0.0  # waited for the codec, decoding other requests' chunks


class KVCacheInfo(BaseModel):
    """Extension field ``kv_cache_info``: where the prompt's KV came from."""

    cached_tokens: int  # from the store or from memory
    memory_tokens: int = 0  # of those, from KV in memory (the prefix cache): no fetch, no decode
    recomputed_tokens: int
    chunks: list[KVChunkInfo]
    load_ms: float
    prefill_ms: float
    faults: list[str] = []
    bandwidth_mbps: float | None = None  # link estimate after loading (megabits per second)
    budget_ms: float | None = None  # the kv_slo_ms in force
    planned_ms: float | None = None  # the first plan's prediction for load + prefill
    prompt_ms: float = 0.0  # from arrival to the first token's logits (tokenization and queueing included)
    slo_met: bool | None = None  # prompt_ms within the budget
    replica: str | None = None  # which gateway answered (the `replica` setting)
