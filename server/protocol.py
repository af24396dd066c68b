"""OpenAI's wire format as msgspec Structs: unknown fields are ignored, a wrong type fails decoding
with the field's name."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.params import StructuredOutputsParams

# ---- request bodies ------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage in every chunk, with include_usage


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # every schema is enforced in full


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    cache_salt: str | None = None  # vLLM's: prefixes are shared only between requests of the same salt
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    # vLLM extras
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top-N, in the whole reply
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    return_token_ids: bool | None = False  # vLLM's: prompt_token_ids and token_ids in each choice
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: json, regex, choice, grammar
    priority: int | None = 0  # vLLM's: lower is served first, under --scheduling-policy priority only


class CompletionRequest(_SamplingRequest, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec unions hold one array type, so checked by hand.
    prompt: Any
    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET  # absent: 16; null: up to the context
    logprobs: int | None = None
    echo: bool | None = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # every schema is enforced in full


class ToolDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" (with tools) | "required" | named
    parallel_tool_calls: bool | None = True


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Any  # str | list[str] | list[int] | list[list[int]], checked by hand as a completion's prompt
    model: str | None = None
    encoding_format: str | None = "float"  # or "base64": the vector's little-endian float32 bytes
    dimensions: int | None = None  # refused: the model's embeddings have one size
    user: str | None = None
    # vLLM extras
    normalize: bool | None = True
    cache_salt: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---- response bodies -----------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Response(msgspec.Struct, kw_only=True):  # what every completion body and chunk starts with
    id: str
    object: str
    created: int
    model: str


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int | None  # 1 for the likeliest token; null where not computed
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # UNSET fields are left out of the JSON: present only when the request asked for return_token_ids.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(_Response, kw_only=True, omit_defaults=True):
    """A whole completion, or one SSE chunk of one (then `usage` is absent except in the last)."""

    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobToken(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprobToken]


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponse(_Response, kw_only=True):
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(_Response, kw_only=True, omit_defaults=True):
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response, kw_only=True):
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class HealthResponse(msgspec.Struct, kw_only=True):
    status: str


class TokenizerInfoResponse(msgspec.Struct, kw_only=True):
    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str
