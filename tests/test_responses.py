"""POST /v1/responses: OpenAI's Responses API over the chat path.

In-process over a fake engine (the input conversion, the event stream's shape, the 400s, the SDK's parsing),
then live: one `kiln serve` of the default model (tests/conftest.py's, shared with tests/test_server.py),
driven by the `openai` SDK, whose greedy replies must equal /v1/chat/completions' for the same conversation.
"""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.api import build_app
from tests.test_server import MODEL, client  # noqa: F401  (a module-scoped fixture)
from tests.test_server_app import (
    ByteTokenizer,
    FakeLLM,
    _drive_until_disconnect,
    assert_error,
    check_response,
    json_values,
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city",
    "parameters": WEATHER_PARAMETERS,
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def _runs(types: list[str]) -> list[str]:
    """Event types with repeats (a run of deltas) collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


class ScriptedLLM(FakeLLM):
    """Writes `reply` a character a step and stops; `fail_after` steps, the engine dies instead."""

    def __init__(self, reply: str, fail_after: int | None = None) -> None:
        super().__init__(max_model_len=1024)
        self.reply, self.fail_after = reply, fail_after

    async def _outputs(self, request):
        try:
            for k, ch in enumerate(self.reply):
                await asyncio.sleep(0)
                if k == self.fail_after:
                    raise EngineDeadError("engine core process exited unexpectedly")
                last = k == len(self.reply) - 1
                text = self.reply[: k + 1]
                out = CompletionOutput(
                    0, text, [ord(c) for c in text], None, "stop" if last else None, None, ch, [ord(ch)]
                )
                metrics = RequestMetrics(time.time())
                yield RequestOutput(request.request_id, None, request.prompt_token_ids, [out], last, metrics)
        finally:
            self.running.discard(request.request_id)


def _sdk(test_client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test_client, max_retries=0)


# ---- in-process, over a fake engine --------------------------------------------------------------


def test_input_items_become_the_chat_conversation(monkeypatch):
    fake = FakeLLM(max_model_len=512)
    seen = []
    monkeypatch.setattr(fake, "chat_prompt", lambda conversation, *a: seen.append(conversation) or [104, 105])
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    body = {
        "instructions": "Be brief.",
        "max_output_tokens": 2,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            call,
            {**call, "call_id": "call_2", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "?"}],
            },
            {"role": "user", "content": "Thanks"},
        ],
    }
    with TestClient(build_app(fake)) as c:
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        c.post("/v1/responses", json={"input": "Just this", "max_output_tokens": 1})

    def called(call_id, arguments):
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }

    assert seen[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},  # developer, as chat reads it
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [called("call_1", {"city": "Oslo"}), called("call_2", {})],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "?", "tool_call_id": "call_2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert seen[1] == [{"role": "user", "content": "Just this"}]
    assert r.json()["usage"] == {
        "input_tokens": 2,
        "output_tokens": 2,
        "total_tokens": 4,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def test_a_reply_cut_by_max_output_tokens_is_incomplete_whole_and_streamed():
    with TestClient(build_app(FakeLLM())) as c:
        sdk = _sdk(c)
        r = sdk.responses.create(model="fake-model", input="hi", max_output_tokens=4, temperature=0.5)
        assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake-model"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output_text == "abcd" and r.output[0].status == "incomplete"
        assert (r.temperature, r.top_p, r.max_output_tokens, r.tools) == (0.5, 1.0, 4, [])
        events = list(sdk.responses.create(model="fake-model", input="hi", max_output_tokens=4, stream=True))
    assert _runs([e.type for e in events]) == [*TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "abcd" and final.usage.output_tokens == 4 and final.status == "incomplete"


def test_a_streamed_call_parses_in_the_sdk_as_the_whole_reply_does():
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    with TestClient(build_app(ScriptedLLM(reply))) as c:
        sdk = _sdk(c)
        kw = dict(model="fake-model", input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
        whole = sdk.responses.create(**kw)
        with sdk.responses.stream(**kw) as stream:
            types = [e.type for e in stream]
            streamed = stream.get_final_response()
    for r in (whole, streamed):
        assert r.status == "completed" and r.output_text == ""
        (call,) = r.output
        assert (
            call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        )
        assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert _runs(types) == CALL_EVENTS
    assert whole.tool_choice == "required" and whole.tools[0].name == "get_weather"


class ToolTemplateTokenizer(ByteTokenizer):
    """A chat template that renders tools, so that `auto` is served (with the hermes parser)."""

    chat_template = "{{ tools }}" + ByteTokenizer.chat_template

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=False, tools=None, **kw):
        return super().apply_chat_template(conversation, add_generation_prompt, tokenize, **kw)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    ("reply", "items", "text"),
    [
        ("Let me check.\n" + HERMES_CALL, ["message", "function_call"], "Let me check.\n"),
        ("\n" + HERMES_CALL, ["function_call"], ""),  # whitespace alone around calls is no message
        ("It is sunny.", ["message"], "It is sunny."),
    ],
)
def test_text_and_calls_stream_as_items_in_order_and_as_the_whole_reply(reply, items, text):
    fake = ScriptedLLM(reply)
    fake.tokenizer = ToolTemplateTokenizer()
    with TestClient(build_app(fake, tool_call_parser="hermes")) as c:
        sdk = _sdk(c)
        kw = dict(model="fake-model", input="Rome?", tools=[WEATHER], tool_choice="auto")
        whole = sdk.responses.create(**kw)
        with sdk.responses.stream(**kw) as stream:
            types = [e.type for e in stream]
            streamed = stream.get_final_response()
    for r in (whole, streamed):
        assert [o.type for o in r.output] == items and r.status == "completed"
        assert r.output_text == text
    calls = [(o.name, json.loads(o.arguments)) for o in streamed.output if o.type == "function_call"]
    assert calls == [(o.name, json.loads(o.arguments)) for o in whole.output if o.type == "function_call"]
    assert calls == ([("get_weather", {"city": "Rome", "days": 1})] if "function_call" in items else [])
    expected = {"message": TEXT_EVENTS[2:], "function_call": CALL_EVENTS[2:-1]}
    steps = [t for item in items for t in expected[item]]
    assert _runs(types) == [*TEXT_EVENTS[:2], *steps, "response.completed"]


def test_an_engine_death_mid_stream_ends_it_with_an_error_event():
    with TestClient(build_app(ScriptedLLM("hello there", fail_after=3))) as c:
        events = list(_sdk(c).responses.create(model="fake-model", input="hi", stream=True))
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    assert "engine core died" in events[-1].message


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_the_generation(stream):
    fake = FakeLLM(step_s=0.01)
    body = {"input": "hi", "max_output_tokens": 40, "stream": stream}
    _drive_until_disconnect(build_app(fake), body, 0.1, "/v1/responses")
    assert len(fake.aborted) == 1 and not fake.running


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"store": True}, "store", "keeps no responses"),
        ({"background": True}, "background", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", "not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice", "no tool"),
        ({"tools": [{**WEATHER, "name": "a b"}]}, "tools", "tools[0].name must match"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", "function_call_output"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content",
         "only input_text and output_text"),
        ({"input": [{"role": "user"}]}, "input[0].content", "missing required"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
         "missing required"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output",
         "missing required"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", "text.format.type must be"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format",
         "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
        ({"temperature": "hot"}, "temperature", "Expected `float | null`"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(extra, param, says):
    fake = FakeLLM()
    with TestClient(build_app(fake)) as c:
        err = assert_error(
            c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **extra}), 400
        )
    assert err["param"] == param and says in err["message"], err
    assert not fake.running


def test_unknown_fields_are_ignored_and_the_api_key_guards_the_route():
    with TestClient(build_app(FakeLLM(), api_key="sekret")) as c:
        body = {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"}, "include": ["x"]}
        assert_error(c.post("/v1/responses", json=body), 401)
        r = c.post("/v1/responses", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "ab"


ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]) | json_values,
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]) | json_values,
        "content": st.text(max_size=8)
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "x"]), "text": st.text()}))
        | json_values,
        "call_id": st.text(max_size=4) | json_values,
        "name": st.sampled_from(["get_weather", "f"]) | json_values,
        "arguments": st.text(max_size=8) | json_values,
        "output": st.text(max_size=8) | json_values,
    },
)
BODY = st.fixed_dictionaries(
    {"input": st.text(max_size=10) | st.lists(ITEM, max_size=3)},
    optional={
        "max_output_tokens": st.integers(-1, 4) | json_values,
        "stream": st.booleans(),
        "instructions": st.text(max_size=5) | json_values,
        "tools": st.lists(st.sampled_from([WEATHER, {"type": "web_search"}]), max_size=2) | json_values,
        "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "name": "get_weather"}]
        )
        | json_values,
        "text": st.fixed_dictionaries({"format": st.sampled_from([{"type": "json_object"}, {"type": "x"}])})
        | json_values,
        "temperature": st.floats(0, 2) | json_values,
    },
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODY)
def test_random_bodies_never_500(body):
    with TestClient(build_app(FakeLLM()), raise_server_exceptions=False) as c:
        r = c.post(
            "/v1/responses", content=msgspec.json.encode(body), headers={"Content-Type": "application/json"}
        )
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert "event: error" not in r.text and "event: response." in r.text, r.text
        else:
            check_response(r)


# ---- live: the default model behind `kiln serve` -------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a haiku about a kiln."},
]


@pytest.mark.slow
def test_a_greedy_response_is_the_chat_reply(client):  # noqa: F811
    r = client.responses.create(
        model=MODEL, instructions=CONVERSATION[0]["content"], input=CONVERSATION[1]["content"],
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=24)
    assert r.output_text and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finish = chat.choices[0].finish_reason
    assert r.status == {"length": "incomplete", "stop": "completed"}[finish] and r.instructions is not None


@pytest.mark.slow
def test_a_streamed_response_is_the_whole_one_event_by_event(client):  # noqa: F811
    kw = dict(model=MODEL, input=CONVERSATION, temperature=0, max_output_tokens=16)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    last = f"response.{whole.status}"
    assert _runs([e.type for e in events]) == [*TEXT_EVENTS, last]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-1].response.output_text
    item = events[2].item.id
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item, 0, 0)}
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 16


@pytest.mark.slow
def test_json_schema_and_json_object_formats_constrain_the_output(client):  # noqa: F811
    from pydantic import BaseModel

    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "integer"},
            "unit": {"type": "string", "enum": ["apples", "pears"]},
        },
        "required": ["answer", "unit"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    question = "What is 2 + 2?"
    kw = dict(model=MODEL, input=question, temperature=0, max_output_tokens=60)
    r = client.responses.create(**kw, text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(**kw, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)

    class Count(BaseModel):
        answer: int
        unit: str

    with client.responses.stream(**kw, text_format=Count) as stream:
        parsed = stream.get_final_response().output_parsed
    assert isinstance(parsed, Count)


@pytest.mark.slow
def test_a_required_tool_is_called_with_arguments_that_match_its_schema(client):  # noqa: F811
    question = "What will the weather be in Paris for the next 3 days?"
    kw = dict(model=MODEL, input=question, tools=[WEATHER], temperature=0, max_output_tokens=60)
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(**kw, tool_choice=choice)
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and r.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    events = list(client.responses.create(**kw, tool_choice="required", stream=True))
    assert _runs([e.type for e in events]) == CALL_EVENTS
    (delta,) = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert delta == events[-1].response.output[0].arguments == call.arguments


@pytest.mark.slow
def test_function_call_items_and_their_outputs_are_the_chat_tool_turns(client):  # noqa: F811
    arguments = '{"city": "Paris", "days": 3}'
    r = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What will the weather be in Paris for the next 3 days?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 25 C, all three days."},
        ],
        temperature=0,
        max_output_tokens=20,
    )
    messages = [
        {"role": "user", "content": "What will the weather be in Paris for the next 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C, all three days."},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert r.output_text and r.output_text == chat.choices[0].message.content
    # Equal prompts: the tool turn reached the template (without it, the prompt would be shorter).
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_stateful_requests_are_400s(client):  # noqa: F811
    for extra in ({"previous_response_id": "resp_123"}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
        assert e.value.body["param"] == next(iter(extra)) and "keeps no responses" in e.value.body["message"]
