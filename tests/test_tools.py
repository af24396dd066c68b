"""Tool-call parsing and planning without a model: each family's syntax back into calls, streamed parses
that only ever grow into the final one, and the 400s a request's tools can earn."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.tools import HermesParser, Llama3JsonParser, default_parser, plan

TEMPLATE = (Path(__file__).parent / "templates" / "qwen2_5_tools.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_hermes_calls_and_content():
    p = HermesParser()
    text = "Let me look.\n" + _hermes("get_weather", {"city": "Paris"}) + "\n" + _hermes("now", {})
    out = p.parse(text, final=True)
    assert out.calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert out.content.strip() == "Let me look."
    assert p.parse("no calls here", final=True).content == "no calls here"
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert p.parse(broken, final=True).calls == [] and p.parse(broken, final=True).content == broken
    unclosed = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}'  # EOS before the closing tag
    assert p.parse(unclosed, final=True).calls == [("f", '{"x": 1}')]


def test_llama3_json_calls_and_content():
    p = Llama3JsonParser()
    assert p.parse('{"name": "f", "parameters": {"a": 1}}', final=True).calls == [("f", '{"a": 1}')]
    two = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}'
    assert p.parse(two, final=True).calls == [("f", "{}"), ("g", '{"b": "x"}')]
    assert p.parse("Paris is in France.", final=True).content == "Paris is in France."
    mixed = p.parse('{"name": "f", "parameters": {}} and then some words', final=True)
    assert mixed.calls == [("f", "{}")] and mixed.content == "and then some words"
    assert p.parse('{"not": "a call"}', final=True).content == '{"not": "a call"}'


_pieces = st.lists(
    st.one_of(
        st.text("ab \n<>{}", max_size=8),
        st.builds(
            _hermes,
            st.sampled_from(["f", "get_weather"]),
            st.dictionaries(st.text("xy", min_size=1, max_size=3), st.integers(), max_size=2),
        ),
        st.just('{"name": "f", "parameters": {"k": [1, 2]}}'),
        st.just("<|python_tag|>"),
        st.just("<tool_"),
    ),
    max_size=5,
)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
@given(pieces=_pieces, data=st.data())
def test_streamed_parses_only_grow_into_the_final_one(parser, pieces, data):
    text = "".join(pieces)
    final = parser.parse(text, final=True)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    for cut in cuts:
        partial = parser.parse(text[:cut], final=False)
        assert final.content.startswith(partial.content), (text, cut)
        assert final.calls[: len(partial.calls)] == partial.calls, (text, cut)


def test_default_parser_follows_the_template(smollm2_dir):
    from transformers import AutoTokenizer

    assert default_parser(TEMPLATE) == "hermes"
    assert default_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_parser(AutoTokenizer.from_pretrained(smollm2_dir).chat_template) is None


def _request(**kw) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def test_plans():
    auto = plan(_request(tools=[WEATHER]), renders_tools=True, parser_name="hermes")
    assert auto.structured is None and auto.parser.name == "hermes" and auto.template_tools == [WEATHER]
    named = plan(
        _request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        renders_tools=False,
        parser_name=None,
    )
    assert named.structured.json == WEATHER["function"]["parameters"] and named.template_tools is None
    assert named.parse('{"city": "Oslo"}', final=True).calls == [("get_weather", '{"city": "Oslo"}')]
    required = plan(_request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), True, None)
    assert required.structured.json["maxItems"] == 1
    calls = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert required.parse(calls, final=True).calls == [("get_weather", '{"city": "Rome"}')]
    assert plan(_request(), True, "hermes") is None


@pytest.mark.parametrize(
    ("kw", "renders", "param", "says"),
    [
        ({"tool_choice": "required"}, True, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True,
         "tool_choice", "names no tool"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, True, "tool_choice", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, True, "tools", "must match"),
        ({"tools": [WEATHER, WEATHER]}, True, "tools", "twice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, True, "tools", "type"),
        ({"tools": [WEATHER]}, False, "tools", "does not render tools"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, True, "tool_choice", "--tool-call-parser"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(kw, renders, param, says):
    with pytest.raises(APIError) as e:
        plan(_request(**kw), renders_tools=renders, parser_name=None)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


class _CountedText(str):
    """A reply's text that counts the characters searched or copied out of it."""

    read = 0

    def find(self, sub, start=0, end=None):
        found = super().find(sub, start, len(self) if end is None else end)
        _CountedText.read += (len(self) if found == -1 else found + len(sub)) - start
        return found

    def __getitem__(self, key):
        piece = super().__getitem__(key)
        _CountedText.read += len(piece)
        return piece

    def lstrip(self, chars=None):
        _CountedText.read += len(self)
        return super().lstrip(chars)

    def strip(self, chars=None):
        _CountedText.read += len(self)
        return super().strip(chars)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_long_streamed_reply_is_read_once_not_once_per_chunk(parser):
    """The chat stream's tool-call reader looks only at text it has not settled: a reply of L characters
    in many chunks costs O(L) reading, where a parse of the whole text per chunk costs O(L^2)."""
    import asyncio

    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from engine.params import SamplingParams
    from server.serving import PromptIds, Serving
    from server.serving_chat import ChatRun, ChatServing
    from tests.test_server_app import FakeLLM

    words = ["word "] * 2000 + [_hermes("now", {}) if parser == "hermes" else " done"]

    async def outputs():
        text = ""
        for i, word in enumerate(words):
            text += word
            last = i == len(words) - 1
            out = CompletionOutput(0, _CountedText(text), [1] * (i + 1), None, "stop" if last else None)
            out.delta_text, out.delta_token_ids = word, [1]
            yield RequestOutput("r", None, [1], [out], last, RequestMetrics(0.0))

    async def go():
        chat = ChatServing(Serving(FakeLLM()))
        b = _request(tools=[WEATHER, {"type": "function", "function": {"name": "now"}}])
        tool_plan = plan(b, renders_tools=True, parser_name=parser)
        run = ChatRun(b, "r", 0, PromptIds(None, [1]), SamplingParams(), outputs(), tool_plan)
        return [c async for c in chat.chunks(run, (False, False))]

    _CountedText.read = 0
    chunks = asyncio.run(go())
    length = len("".join(words))
    assert _CountedText.read < 8 * length, f"{_CountedText.read} characters read for a reply of {length}"
    content = "".join(c.choices[0].delta.content or "" for c in chunks[1:])
    assert content.startswith("word word") and content.count("word") == 2000
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []] if chunks else []
    assert [call.function.name for call in calls] == (["now"] if parser == "hermes" else [])
