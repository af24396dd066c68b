"""OpenAI's Responses API (`POST /v1/responses`) as msgspec Structs, as server/protocol.py holds the chat and
completion bodies: unknown fields are ignored, a wrong type fails decoding with the field's name."""

from __future__ import annotations

from typing import Any

import msgspec

from server.protocol import ContentPart

# ---- the request ---------------------------------------------------------------------------------


class InputItem(msgspec.Struct, kw_only=True):
    """One `input` item, flat: a message may come without `type`, so there is no tag to decode a union by.
    Which fields an item needs depends on its type, and is checked where it becomes a chat message."""

    type: str = "message"  # "message" | "function_call" | "function_call_output"
    role: str | None = None  # message
    content: str | list[ContentPart] | None = None  # message: parts of type input_text or output_text
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str  # "text" | "json_object" | "json_schema"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # every schema is enforced in full


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A `tools` entry in the Responses' flat shape; other tool types decode only to be refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolChoiceObject(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str  # "function" (others are refused)
    name: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceObject | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Decoded to be refused when set: each needs responses kept between requests, and none are kept.
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None


# ---- the response --------------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str  # "in_progress" | "completed" | "incomplete"
    role: str = "assistant"
    content: list[OutputText] = []


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str


OutputItem = MessageItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str  # "max_output_tokens"


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response, whole or as it stands in a stream's lifecycle events. The request's parameters are
    echoed, as OpenAI echoes them: the SDK's `Response` model requires several."""

    id: str
    object: str = "response"
    created_at: int
    status: str  # "in_progress" | "completed" | "incomplete"
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    text: TextConfig
    tools: list[FunctionTool]
    tool_choice: str | ToolChoiceObject
    parallel_tool_calls: bool
    metadata: dict[str, str]
    user: str | None
    previous_response_id: None = None
    background: bool = False
    store: bool = False
    truncation: str = "disabled"


class StreamEvent(msgspec.Struct, kw_only=True):
    """Any event of a streamed response: the fields its type does not carry stay UNSET, left out."""

    type: str
    sequence_number: int
    response: ResponseObject | msgspec.UnsetType = msgspec.UNSET
    output_index: int | msgspec.UnsetType = msgspec.UNSET
    item: OutputItem | msgspec.UnsetType = msgspec.UNSET
    item_id: str | msgspec.UnsetType = msgspec.UNSET
    content_index: int | msgspec.UnsetType = msgspec.UNSET
    part: OutputText | msgspec.UnsetType = msgspec.UNSET
    delta: str | msgspec.UnsetType = msgspec.UNSET
    text: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str | msgspec.UnsetType = msgspec.UNSET
    logprobs: list[Any] | msgspec.UnsetType = msgspec.UNSET
    # an `error` event's
    code: str | msgspec.UnsetType | None = msgspec.UNSET
    message: str | msgspec.UnsetType = msgspec.UNSET
    param: str | msgspec.UnsetType | None = msgspec.UNSET
