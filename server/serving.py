"""What the OpenAI endpoints share: reading a body (its checks: server/limits.py), tokenizing off the event
loop, generating through the engine with metrics, merging several generations, and the SSE stream (its
chunk loop: server/streaming.py).

A request lives in the engine only while its client does: a streaming response is cancelled by
Starlette when the client goes, a non-streaming one races its generation against the connection's
`http.disconnect`; either way closing `AsyncLLM.generate` aborts the request in the engine core,
which frees its KV blocks and stops computing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from engine.errors import InvalidRequestError
from engine.input_processor import PreparedRequest
from engine.outputs import RequestOutput
from engine.params import SamplingParams
from server.errors import APIError, as_api_error, bad_param, encode, short, validation_error
from server.limits import LARGE_BODY, SMALL_LANE_BYTES, Lane, RequestLimits
from server.logprobs import TokenStrings
from server.metrics import RequestTracker, ServerMetrics
from server.protocol import ChatMessage, ToolCall, UsageInfo
from server.sanitize import sanitized

DEFAULT_MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 30.0  # to receive a whole request body
SHUTTING_DOWN = "the server is shutting down"


_decoder = functools.cache(msgspec.json.Decoder)  # one per body type
_top_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a body's field names, values left unparsed
MAX_WARNED_FIELDS = 256  # unknown field names remembered, so that a client cannot grow the set forever
logger = logging.getLogger("kiln.server")


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(cls))


_body_bytes: contextvars.ContextVar[int] = contextvars.ContextVar("body_bytes", default=0)  # this request's


class Disconnected(Exception):
    """The client went away before its response was ready."""


class _SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so the engine request is always aborted."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(generator index, item) from several generators as items arrive; closing this cancels them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for item in gen:
                yield 0, item
        return
    tasks: dict[asyncio.Task, int] = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = tasks.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                tasks[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, item
    finally:
        # This may run inside a cancelled scope: nothing here may wait (generators clean up at once)
        for task, i in tasks.items():
            if not task.done():
                task.cancel()  # lands in the generator's pending step, whose `finally` aborts the request
                continue
            if not task.cancelled():
                task.exception()  # retrieved: no "exception never retrieved" warning
            with contextlib.suppress(BaseException):
                await gens[i].aclose()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class PromptIds(NamedTuple):
    text: str | None  # None: the prompt came as token ids
    ids: list[int]


def special_strings(tokenizer) -> list[str]:
    """Every special token's text, longest first (so none is left half removed)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    found = {*getattr(tokenizer, "all_special_tokens", []), *(t.content for t in added if t.special)}
    return sorted((s for s in found if s), key=len, reverse=True)


def template_call(call: ToolCall) -> dict:
    """An earlier turn's call as chat templates read it: its arguments an object, not JSON text."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class Serving:
    """The endpoints' shared state (the engine front end, metrics, token strings) and plumbing."""

    def __init__(
        self,
        llm,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        trust_request_chat_template: bool = False,
        sanitize_special_tokens: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        self.llm = llm
        self.tool_call_parser = tool_call_parser  # None: the one the chat template implies, if any
        # Special-token strings typed into message content would become real role markers.
        self.special_strings = special_strings(llm.tokenizer) if sanitize_special_tokens else []
        self.max_body_bytes = max_body_bytes
        self.draining = False  # set once shutdown begins
        self.limits = RequestLimits(
            llm.max_model_len,
            getattr(llm.tokenizer, "chat_template", None),
            llm.check_capacity,
            trust_request_chat_template,
        )
        # Tokenizing, chat templates and grammar checks run off the event loop, on two lanes: bodies from
        # LARGE_BODY bytes on one, smaller ones on the other, so that huge prompts never hold up the rest;
        # and where cores are few, the model's threads go before the large lane's encoding.
        large = Lane("kiln-tokenize-large", 4 * max_body_bytes, llm.processor.encode_at_low_priority)
        self.lanes = (Lane("kiln-tokenize", SMALL_LANE_BYTES), large)
        self.model_name: str = llm.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.tokens = TokenStrings(llm.tokenizer)
        self.created = int(time.time())
        self.warned_fields: set[str] = set()

    async def read(self, request: Request, cls: type, limit: int | None = None) -> Any:
        """The body decoded as `cls`, whose `model`, if given, must be the one this server serves; a route
        may set a `limit` below the server's on its body's bytes."""
        if self.draining:
            raise APIError(503, SHUTTING_DOWN)
        limit = self.max_body_bytes if limit is None else min(limit, self.max_body_bytes)
        length = request.headers.get("content-length")
        too_large = length is not None and length.isdigit() and int(length) > limit
        if too_large and int(length) > 4 * limit:  # type: ignore[arg-type]
            raise self._too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):  # a client trickling its body holds no slot for long
                async for chunk in request.stream():
                    size += len(chunk)
                    too_large = too_large or size > limit
                    if not too_large:
                        chunks.append(chunk)
                    elif size > 4 * limit:
                        break
                    # else: drain what is left of a moderately oversized body, so that the 413 reaches the
                    # client before the connection closes (closing on unread data resets it)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {BODY_TIMEOUT_S} s", code="request_timeout"
            ) from None
        if too_large:
            raise self._too_large(limit)
        _body_bytes.set(size)
        try:
            raw = b"".join(chunks)
            body = _decoder(cls).decode(raw)
        except msgspec.ValidationError as e:
            raise validation_error(e) from None
        except msgspec.DecodeError as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None
        self.warn_unknown_fields(_top_keys.decode(raw).keys() - _field_names(cls))
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"the model {short(body.model)} does not exist; this server serves {self.model_name!r}",
                "model",
                code="model_not_found",
            )
        return body

    def warn_unknown_fields(self, names: set[str]) -> None:
        """Ignored, as OpenAI's API does, but logged once per name: a client's misspelt field is visible."""
        new = names - self.warned_fields
        if new and len(self.warned_fields) < MAX_WARNED_FIELDS:
            self.warned_fields |= new
            logger.warning("request fields ignored (not supported): %s", ", ".join(sorted(map(short, new))))

    def _too_large(self, limit: int) -> APIError:
        return APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the lane for this request's body size (429 when that lane's queue is full): streams
        keep flowing while a long prompt is tokenized."""
        size = _body_bytes.get()
        return await self.lanes[size >= LARGE_BODY].run(fn, args, size)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.llm.processor.tokenize(prompt)
        except InvalidRequestError:
            raise
        except Exception as e:  # the tokenizer rejects some strings (lone surrogates)
            raise APIError(400, f"could not tokenize the prompt: {e}", "prompt") from None

    def prepare(
        self, request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> PreparedRequest:
        """Validate a prompt against the model (the engine's one check); nothing is sent yet."""
        if cache_salt is not None and not 0 < len(cache_salt) <= 256:
            raise APIError(400, "cache_salt must be a string of 1 to 256 characters", "cache_salt")
        try:
            return self.llm.process(ids, params, request_id, cache_salt)
        except InvalidRequestError as e:
            raise as_api_error(e, "") from None
        except ValueError as e:  # SamplingParams' own checks, with max_tokens resolved
            raise bad_param(e) from None

    def chat_ids(
        self, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict | None
    ) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        conversation = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            if role not in ("system", "user", "assistant", "tool"):
                raise APIError(
                    400,
                    f"messages[{i}].role must be system, user, assistant or tool (got {short(msg.role)})",
                    f"messages[{i}].role",
                )
            content = msg.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            400,
                            f"messages[{i}].content[{j}]: only text parts are supported "
                            f"(got type {short(part.type)})",
                            f"messages[{i}].content",
                        )
                content = "\n".join(part.text for part in content)  # type: ignore[misc]
            if content is None:
                if role != "assistant":
                    raise APIError(400, f"messages[{i}].content is required", f"messages[{i}].content")
                content = ""
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "tool" and msg.tool_call_id is not None:
                message["tool_call_id"] = msg.tool_call_id
            if role == "assistant" and msg.tool_calls:
                message["tool_calls"] = [template_call(c) for c in msg.tool_calls]
            conversation.append(message)
        conversation, kwargs = sanitized(conversation, kwargs, self.special_strings)
        try:
            return self.llm.chat_prompt(conversation, add_generation_prompt, kwargs)
        except InvalidRequestError as e:
            raise APIError(400, str(e), e.param or "messages") from None
        except Exception as e:  # a template error, or chat_template_kwargs the template cannot take
            param = "chat_template_kwargs" if kwargs else "messages"
            raise APIError(
                400, f"could not apply the chat template to these {param}: {type(e).__name__}: {e}", param
            ) from None

    def generate_all(self, requests: list[PreparedRequest], stream=False) -> list[AsyncIterator]:
        """Admit every one of `requests` or none: a full engine refuses the lot, leaving no stream behind."""
        self.llm.check_capacity(*(sum(c) for c in zip(*(r.cost for r in requests))))
        return [self.generate(r, stream) for r in requests]

    def generate(self, request: PreparedRequest, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """Admit `request` now: a full engine is a 429, not an error in a stream (which keeps no logprobs)."""
        return self._tracked(request, self.llm.add(request, keep_logprobs=not stream))

    async def _tracked(
        self, request: PreparedRequest, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        tracker = RequestTracker(
            self.metrics, request.request_id, len(request.prompt_token_ids), request.params.n
        )
        try:
            async with contextlib.aclosing(stream) as gen:  # type: ignore[type-var]
                async for out in gen:
                    tracker.update(out)
                    yield out
        finally:
            tracker.close()

    async def until_disconnected(self, request: Request, work: Awaitable[Any]) -> Any:
        """Run `work` unless the client goes first; then cancel it (which aborts its engine requests)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()  # the client is gone (or this handler was cancelled)
        if task.done() and not task.cancelled():
            return task.result()
        raise Disconnected

    async def collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async with contextlib.aclosing(merge(gens)) as merged:
            async for i, out in merged:
                finals[i] = out
        if any(f is None or not f.finished for f in finals):
            raise APIError(500, "the engine ended a request without finishing it")
        return finals  # type: ignore[return-value]

    @staticmethod
    def usage(
        prompts: list[PromptIds], finals: list[RequestOutput] | None = None, generated: int = 0
    ) -> UsageInfo:
        prompt_tokens = sum(len(p.ids) for p in prompts)
        if finals is not None:
            generated = sum(len(c.token_ids) for f in finals for c in f.outputs)
        return UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated
        )

    def sse(self, chunks: AsyncIterator[msgspec.Struct]) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async with contextlib.aclosing(chunks) as gen:
                    async for chunk in gen:
                        yield b"data: " + encode(chunk) + b"\n\n"
            except Exception as e:
                yield b"data: " + as_api_error(e, "while streaming a response").response().body + b"\n\n"
            yield b"data: [DONE]\n\n"

        return self.event_stream(body())

    @staticmethod
    def event_stream(body: AsyncIterator[bytes]) -> Response:
        """SSE of events `body` frames itself; `body` is closed however the response ends."""
        return _SSEResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
