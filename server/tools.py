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
    """Content before, between and after calls (while streaming: only what no later token can turn into a
    call), and the calls complete. From `parse`, all of them; from a stream's `feed`, what is new."""

    content: str
    calls: list[Call] = field(default_factory=list)


class ToolStream:
    """One reply's text read as it grows. `feed` takes the whole text so far and returns what is new
    since the last feed; it reads only the text it has not settled yet, so a long streamed reply costs
    O(length) overall, not a parse of everything so far per chunk."""

    def feed(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class ToolParser:
    """One model family's tool-call syntax."""

    name = ""

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        return self.stream().feed(text, final)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (newlines inside), any number: Qwen2.5/3."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self) -> None:
        self.pos = 0  # the text before it is settled: sent as content, or read as calls
        self.open: int | None = None  # where the call still being written opens
        self.scan = 0  # where its closing tag may start

    def feed(self, text: str, final: bool) -> Parsed:
        out, tags = Parsed(""), HermesParser
        while True:
            if self.open is None:
                start = text.find(tags.OPEN, self.pos)
                if start == -1:
                    end = len(text)
                    if not final:  # hold back what may be the start of an opening tag
                        end -= _partial_suffix(text, tags.OPEN, self.pos)
                    out.content += text[self.pos : end]
                    self.pos = end
                    return out
                out.content += text[self.pos : start]
                self.open, self.scan = start, start + len(tags.OPEN)
            end = text.find(tags.CLOSE, self.scan)
            if end == -1 and not final:  # a call still being written
                self.scan = max(self.scan, len(text) - len(tags.CLOSE) + 1)
                return out
            start, self.open = self.open, None
            self.pos = len(text) if end == -1 else end + len(tags.CLOSE)
            call = _call(_object_at(text, start + len(tags.OPEN))[0], "arguments")
            if call is None:
                out.content += text[start : self.pos]
            else:
                out.calls.append(call)


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole reply is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), several separated by `;`; a reply that does not start so is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def stream(self) -> ToolStream:
        return _Llama3Stream()


_SPACE = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s;]*")
_JSON_MARKS = re.compile(r'[][{}"\\]')


class _Llama3Stream(ToolStream):
    def __init__(self) -> None:
        self.mode = ""  # "": undecided yet; "content"; "calls"
        self.skip, self.tagged = 0, False  # undecided: the whitespace (and tag) read so far
        self.sent = 0  # content: the characters sent
        self.pos = 0  # calls: where the next call may start (past the calls read, and separators)
        self.found, self.stopped = 0, False  # calls read; text that is no call follows them
        self.scan, self.depth, self.in_string = 0, 0, False  # the object being written

    def feed(self, text: str, final: bool) -> Parsed:
        tag = Llama3JsonParser.TAG
        if not self.mode:
            i = self.skip = _SPACE.match(text, self.skip).end()
            if not self.tagged and text.startswith(tag, i):
                self.tagged = True
                i = self.skip = _SPACE.match(text, i + len(tag)).end()
            if i == len(text):  # nothing yet but whitespace and the tag
                return Parsed(text if final else "")
            if not final and len(text) - i <= len(tag) and tag.startswith(text[i:]):
                return Parsed("")  # maybe the tag, still being written
            self.mode, self.pos = ("calls", i) if text[i] == "{" else ("content", 0)
            self.scan = self.pos
        if self.mode == "content":
            out, self.sent = Parsed(text[self.sent :]), len(text)
            return out
        out = Parsed("")
        while not self.stopped:
            if self.scan == self.pos:  # between calls: separators, then another call or the end of them
                self.pos = self.scan = _SEPARATORS.match(text, self.pos).end()
                if self.pos == len(text):
                    break
                self.stopped = text[self.pos] != "{"
                self.depth, self.in_string = 0, False
            if self.stopped or not self._object_read(text):
                break
            obj, end = _object_at(text, self.pos)
            call = _call(obj, "parameters")
            self.stopped = call is None
            if call is not None:
                out.calls.append(call)
                self.found += 1
                self.pos = self.scan = end
        if final:  # words after the calls; without calls, the reply is content after all
            out.content = text[self.pos :] if self.found else text
        return out

    def _object_read(self, text: str) -> bool:
        """Whether the object at `pos` is all there: its brackets are counted (outside strings) from where
        the last feed left off, so each character is read once."""
        i = self.scan
        while (m := _JSON_MARKS.search(text, i)) is not None:
            mark, i = m.group(), m.end()
            if self.in_string:
                if mark == "\\":
                    if i == len(text):  # what it escapes is still to come
                        self.scan = i - 1
                        return False
                    i += 1
                elif mark == '"':
                    self.in_string = False
            elif mark == '"':
                self.in_string = True
            elif mark in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.scan = i
                    return True
        self.scan = len(text)
        return False


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def default_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool syntax implies, or None."""
    chat_template = chat_template or ""
    if HermesParser.OPEN in chat_template:
        return HermesParser.name
    if Llama3JsonParser.TAG in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser.name
    return None


def _partial_suffix(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest end of `text[start:]` that begins `tag` (a tag whose rest may still arrive)."""
    longest = min(len(tag) - 1, len(text) - start)
    return next((k for k in range(longest, 0, -1) if text.endswith(tag[:k])), 0)


class _ForcedParser(ToolParser, ToolStream):
    """`required`: a JSON array of {"name", "parameters"}; a named tool: its arguments object alone. Read
    once, whole: nothing is sent before the output ends."""

    def __init__(self, named: str | None) -> None:
        self.named = named

    def stream(self) -> ToolStream:
        return self

    def feed(self, text: str, final: bool) -> Parsed:
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
        return self.stream().feed(text, final)

    def stream(self) -> ToolStream:
        """A reader of one choice's text as it streams."""
        return self.parser.stream() if self.parallel else _FirstCall(self.parser.stream())


class _FirstCall(ToolStream):
    """Calls after the first left out (`parallel_tool_calls` false)."""

    def __init__(self, inner: ToolStream) -> None:
        self.inner, self.room = inner, 1

    def feed(self, text: str, final: bool) -> Parsed:
        parsed = self.inner.feed(text, final)
        parsed.calls = parsed.calls[: self.room]
        self.room -= len(parsed.calls)
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
