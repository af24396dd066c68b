"""Tool calling: a request's `tools` and `tool_choice` into a prompt and a constraint, and the output back
into OpenAI's `tool_calls`.

`auto` renders the tools through the model's chat template and reads calls out of whatever the model
writes, in its family's syntax (a ToolParser). `required` and a named tool do not rely on the model
knowing any syntax: the output is constrained to JSON (an array of {"name", "parameters"} objects, or the
named tool's arguments), so the arguments always parse and match the tool's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import msgspec

from engine.params import StructuredOutputsParams
from server.errors import APIError, short
from server.protocol import ChatCompletionRequest, NamedToolChoice

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_DECODER = json.JSONDecoder()

Call = tuple[str, str]  # (function name, arguments as JSON text)


def _object_at(text: str, start: int) -> tuple[dict | None, int]:
    """The JSON object starting at `start` (after whitespace) and where it ends, or (None, start)."""
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        value, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None, start
    return (value, end) if isinstance(value, dict) else (None, start)


def _call(obj: dict | None, arguments_key: str) -> Call | None:
    if obj is None or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)


@dataclass
class Parsed:
    """Content before, between and after the calls (while streaming: only what no later token can turn
    into a call), and the calls complete so far. Both only grow as the text does."""

    content: str
    calls: list[Call] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call syntax."""

    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (newlines inside), any number: Qwen2.5/3."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = Parsed(""), 0
        while (start := text.find(self.OPEN, pos)) != -1:
            out.content += text[pos:start]
            end = text.find(self.CLOSE, start)
            if end == -1 and not final:
                return out  # a call still being written
            pos = len(text) if end == -1 else end + len(self.CLOSE)
            call = _call(_object_at(text, start + len(self.OPEN))[0], "arguments")
            if call is None:
                out.content += text[start:pos]
            else:
                out.calls.append(call)
        tail = text[pos:]
        if not final:  # hold back what may be the start of an opening tag
            tail = tail[: len(tail) - _partial_suffix(tail, self.OPEN)]
        out.content += tail
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole reply is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), several separated by `;`; a reply that does not start so is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip().removeprefix(self.TAG).lstrip()
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("{"):
            if not final and (self.TAG.startswith(body) or not text.strip()):
                return Parsed("")
            return Parsed(text)
        out, pos = Parsed(""), 0
        while True:
            obj, end = _object_at(body, pos)
            call = _call(obj, "parameters")
            if call is None:
                break
            out.calls.append(call)
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        if final and not out.calls:
            return Parsed(text)  # not a call after all: the reply is content
        if final:
            out.content = body[pos:]  # words after the calls
        return out


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def default_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool syntax implies, or None."""
    chat_template = chat_template or ""
    if HermesParser.OPEN in chat_template:
        return HermesParser.name
    if Llama3JsonParser.TAG in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser.name
    return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag whose rest may still arrive)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class _ForcedParser(ToolParser):
    """`required`: a JSON array of {"name", "parameters"}; a named tool: its arguments object alone."""

    def __init__(self, named: str | None) -> None:
        self.named = named

    def parse(self, text: str, final: bool) -> Parsed:
        if not final:
            return Parsed("")
        if self.named is not None:
            return Parsed("", [(self.named, text.strip())])
        try:
            calls = [_call(obj, "parameters") for obj in json.loads(text)]
        except (json.JSONDecodeError, TypeError, AttributeError):
            return Parsed(text)  # cut short by max_tokens
        return Parsed("", [c for c in calls if c is not None])


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and the reading of its output."""

    template_tools: list[dict] | None  # passed to the chat template
    structured: StructuredOutputsParams | None  # the constraint (required, named)
    parser: ToolParser | None  # None: the output is content only
    parallel: bool

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = self.parser.parse(text, final)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed


def plan(b: ChatCompletionRequest, renders_tools: bool, parser_name: str | None) -> ToolPlan | None:
    """Check a request's tools and tool_choice (400s naming the field) and decide how to serve them."""
    choice = b.tool_choice
    if not b.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    schemas = {}
    for i, tool in enumerate(b.tools):
        f = tool.function
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type must be 'function' (got {short(tool.type)})", "tools")
        if not _NAME.fullmatch(f.name):
            raise APIError(400, f"tools[{i}].function.name must match {_NAME.pattern}", "tools")
        if f.name in schemas:
            raise APIError(400, f"tools[{i}].function.name {f.name!r} is given twice", "tools")
        schemas[f.name] = f.parameters if f.parameters is not None else {"type": "object"}
    tools = [msgspec.to_builtins(t) for t in b.tools]
    parallel = b.parallel_tool_calls is not False
    named, forced = None, None  # forced: the JSON schema the output is constrained to
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or choice.function.name not in schemas:
            raise APIError(
                400,
                f"tool_choice names no tool of this request: {short(choice.function.name)}",
                "tool_choice",
            )
        named = choice.function.name
        forced = schemas[named]
    elif choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        forced = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not parallel:
            forced["maxItems"] = 1
    if forced is not None:
        structured = StructuredOutputsParams(json=forced)
        return ToolPlan(tools if renders_tools else None, structured, _ForcedParser(named), parallel)
    if choice not in (None, "auto", "none"):
        raise APIError(
            400,
            f"tool_choice must be 'none', 'auto', 'required' or a named function (got {short(choice)})",
            "tool_choice",
        )
    if not renders_tools:
        raise APIError(
            400,
            "this model's chat template does not render tools, so the model cannot choose to call one: "
            "name a tool in tool_choice or use 'required'",
            "tools",
        )
    if choice != "none" and parser_name is None:
        raise APIError(
            400,
            f"tool_choice 'auto' needs a tool-call parser for this model: kiln serve --tool-call-parser "
            f"({' | '.join(PARSERS)})",
            "tool_choice",
        )
    return ToolPlan(tools, None, None if choice == "none" else PARSERS[parser_name](), parallel)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
