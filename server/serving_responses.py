"""/v1/responses: OpenAI's Responses API, stateless, served by the chat path.

A request becomes the ChatCompletionRequest it stands for (input items as chat messages, `text.format` as
`response_format`, flat function tools as chat tools), which ChatServing checks, renders, generates and
parses tool calls from exactly as it does its own; its reply, whole or chunk by chunk, is then re-shaped
into a `response` object or Responses' event stream. Nothing is kept between requests, so what needs an
earlier response (previous_response_id, store, background, conversation) is a 400.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from server.errors import APIError, as_api_error, encode, json_response, short
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolCall,
    ToolDefinition,
    UsageInfo,
)
from server.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputItem,
    MessageItem,
    OutputItem,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextFormat,
    ToolChoiceObject,
)
from server.serving_chat import ChatRun, ChatServing

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# The chat fields that chat's checks name in their errors -> the Responses fields they were made from.
RENAMED = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("].function.name", "].name"),
    ("messages", "input"),
)


T = TypeVar("T")


def _required(value: T | None, where: str) -> T:
    if value is None:
        raise APIError(400, f"missing required field '{where}'", where)
    return value


def _text(content: str | list[ContentPart] | None, where: str) -> str | list[ContentPart]:
    """Message text as chat takes it: a string, or text parts (which chat joins)."""
    content = _required(content, where)
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(
                400,
                f"{where}[{j}]: only input_text and output_text parts are supported (got type "
                f"{short(part.type)})",
                where,
            )
    return [ContentPart(type="text", text=part.text) for part in content]


def chat_messages(b: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` and `input` as the chat messages they stand for: function_call items join the
    assistant message just before them (or make one) as its tool_calls; a function_call_output is a tool
    message."""
    messages = [] if b.instructions is None else [ChatMessage(role="system", content=b.instructions)]
    items = [InputItem(role="user", content=b.input)] if isinstance(b.input, str) else b.input
    if not items:
        raise APIError(400, "input must not be empty", "input")
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if item.type == "message":
            if item.role not in ROLES:
                raise APIError(
                    400, f"{at}.role must be one of {', '.join(ROLES)} (got {short(item.role)})", f"{at}.role"
                )
            messages.append(ChatMessage(role=item.role, content=_text(item.content, f"{at}.content")))
        elif item.type == "function_call":
            function = FunctionCall(
                name=_required(item.name, f"{at}.name"),
                arguments=_required(item.arguments, f"{at}.arguments"),
            )
            call = ToolCall(id=_required(item.call_id, f"{at}.call_id"), function=function)
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            call_id = _required(item.call_id, f"{at}.call_id")
            content = _text(item.output, f"{at}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=content))
        else:
            raise APIError(
                400,
                f"{at}.type must be message, function_call or function_call_output (got {short(item.type)})",
                f"{at}.type",
            )
    return messages


def chat_request(b: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `b` stands for; a 400 names the Responses field at fault."""
    for name, given in (
        ("previous_response_id", b.previous_response_id is not None),
        ("store", b.store is True),
        ("background", b.background is True),
        ("conversation", b.conversation is not None),
    ):
        if given:
            raise APIError(
                400,
                f"{name} is not supported: this server keeps no responses between requests; send the whole "
                "conversation as input",
                name,
            )
    tools = []
    for i, tool in enumerate(b.tools or []):
        if tool.type != "function":
            raise APIError(
                400, f"tools[{i}].type {short(tool.type)} is not supported: only function tools are", "tools"
            )
        function = FunctionDefinition(
            name=_required(tool.name, f"tools[{i}].name"),
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        tools.append(ToolDefinition(type="function", function=function))
    choice = b.tool_choice
    if isinstance(choice, ToolChoiceObject):
        if choice.type != "function" or choice.name is None:
            raise APIError(
                400,
                f"tool_choice of type {short(choice.type)} is not supported: give 'none', 'auto', 'required' "
                "or {'type': 'function', 'name': ...}",
                "tool_choice",
            )
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    f = b.text.format if b.text is not None else None
    response_format = None
    if f is not None:
        schema = None
        if f.type == "json_schema":
            schema = JsonSchemaFormat(
                name=f.name, description=f.description, schema=f.schema, strict=f.strict
            )
        response_format = ResponseFormat(type=f.type, json_schema=schema)
    return ChatCompletionRequest(
        model=b.model,
        messages=chat_messages(b),
        max_completion_tokens=b.max_output_tokens,
        temperature=b.temperature,
        top_p=b.top_p,
        response_format=response_format,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=b.parallel_tool_calls is not False,
        stream=b.stream,
        stream_options=StreamOptions(include_usage=True),
        user=b.user,
    )


def _renamed(e: APIError) -> APIError:
    message, param = e.message, e.param
    for chat, responses in RENAMED:
        message = message.replace(chat, responses)
        param = param and param.replace(chat, responses)
    return APIError(e.status, message, param, e.type, e.code, e.headers)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _Events:
    """A streamed response's events, numbered as they are made, and the output items they build. A message
    item opens at its first text and closes before a call's item opens, so the items keep their order."""

    def __init__(self) -> None:
        self.numbers = itertools.count()
        self.output: list[OutputItem] = []
        self.message: MessageItem | None = None  # the message item still open

    def event(self, type: str, **fields: Any) -> bytes:
        data = encode(StreamEvent(type=type, sequence_number=next(self.numbers), **fields))
        return b"event: " + type.encode() + b"\ndata: " + data + b"\n\n"

    def text(self, delta: str) -> list[bytes]:
        frames = []
        if self.message is None:
            self.message = MessageItem(id=_item_id("msg"), status="in_progress", content=[])
            self.output.append(self.message)
            frames.append(
                self.event("response.output_item.added", output_index=self.index, item=self.message)
            )
            self.message.content.append(OutputText(text=""))
            part = self.message.content[0]  # encoded now, while still empty
            frames.append(self.event("response.content_part.added", **self.at, part=part))
        if delta:
            self.message.content[0].text += delta
            frames.append(self.event("response.output_text.delta", **self.at, delta=delta, logprobs=[]))
        return frames

    def close_text(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        self.message.status, (part,) = status, self.message.content
        frames = [
            self.event("response.output_text.done", **self.at, text=part.text, logprobs=[]),
            self.event("response.content_part.done", **self.at, part=part),
            self.event("response.output_item.done", output_index=self.index, item=self.message),
        ]
        self.message = None
        return frames

    def call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        """A whole call at once: chat's parsers release a call only once all of it is written."""
        frames = self.close_text("completed")
        item = FunctionCallItem(
            id=_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress"
        )
        self.output.append(item)
        at = {"item_id": item.id, "output_index": self.index}
        frames.append(self.event("response.output_item.added", output_index=self.index, item=item))
        frames.append(self.event("response.function_call_arguments.delta", **at, delta=arguments))
        frames.append(self.event("response.function_call_arguments.done", **at, arguments=arguments))
        item.arguments, item.status = arguments, "completed"
        frames.append(self.event("response.output_item.done", output_index=self.index, item=item))
        return frames

    @property
    def index(self) -> int:
        return len(self.output) - 1

    @property
    def at(self) -> dict:
        assert self.message is not None
        return {"item_id": self.message.id, "output_index": self.index, "content_index": 0}


class ResponsesServing:
    """The route: a Responses request in, ChatServing's run of it, the reply re-shaped on the way out."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat, self.s = chat, chat.s

    async def create(self, request: Request) -> Response:
        b: ResponsesRequest = await self.s.read(request, ResponsesRequest)
        chat = chat_request(b)
        try:
            run = await self.chat.start(chat, _item_id("resp"))
        except APIError as e:
            raise _renamed(e) from None
        if b.stream:
            return self.s.event_stream(self.events(b, run))
        reply = await self.chat.complete(request, run)
        (choice,) = reply.choices
        status, output = _status(choice.finish_reason), []
        if choice.message.content is not None:  # None: there are calls, and only whitespace around them
            text = OutputText(text=choice.message.content)
            output.append(MessageItem(id=_item_id("msg"), status=status, content=[text]))
        for call in choice.message.tool_calls or []:
            f = call.function
            item = FunctionCallItem(
                id=_item_id("fc"), call_id=call.id, name=f.name, arguments=f.arguments, status="completed"
            )
            output.append(item)
        return json_response(self.response(b, run, status, output, reply.usage))

    async def events(self, b: ResponsesRequest, run: ChatRun) -> AsyncIterator[bytes]:
        """Responses' event stream over chat's chunks. Whitespace before anything else is held back: chat
        drops it when calls follow, and so does this, never opening a message item for it."""
        e = _Events()
        started = self.response(b, run, "in_progress", [], None)
        yield e.event("response.created", response=started)
        yield e.event("response.in_progress", response=started)
        held, finish_reason, usage = "", None, None
        try:
            async with contextlib.aclosing(self.chat.chunks(run, (True, False))) as chunks:
                async for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish_reason = choice.finish_reason or finish_reason
                        held += choice.delta.content or ""
                        if held and (held.strip() or e.message is not None):
                            for frame in e.text(held):
                                yield frame
                            held = ""
                        for call in choice.delta.tool_calls or []:
                            f = call.function
                            for frame in e.call(call.id or _item_id("call"), f.name or "", f.arguments or ""):
                                yield frame
        except Exception as exc:
            error = as_api_error(exc, "while streaming a response")
            yield e.event("error", code=error.code, message=error.message, param=error.param)
            return
        status = _status(finish_reason)
        frames = e.text(held) if not e.output else []  # an empty reply is an empty message, as when whole
        for frame in [*frames, *e.close_text(status)]:
            yield frame
        final = self.response(b, run, status, e.output, usage)
        yield e.event(f"response.{status}", response=final)

    def response(
        self, b: ResponsesRequest, run: ChatRun, status: str, output: list, usage: UsageInfo | None
    ) -> ResponseObject:
        """The response object, its request's parameters echoed as OpenAI echoes them."""
        tokens = None
        if usage is not None:
            tokens = ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            )
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(
            id=run.rid,
            created_at=run.created,
            status=status,
            model=self.s.model_name,
            output=output,
            usage=tokens,
            incomplete_details=incomplete,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            temperature=run.params.temperature,
            top_p=run.params.top_p,
            text=TextConfig(format=(b.text and b.text.format) or TextFormat(type="text")),
            tools=b.tools or [],
            tool_choice=b.tool_choice or "auto",
            parallel_tool_calls=b.parallel_tool_calls is not False,
            metadata=b.metadata or {},
            user=b.user,
        )
