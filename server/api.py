"""The OpenAI-compatible HTTP server: Starlette routes over AsyncLLM.

Request and response bodies are msgspec Structs: unknown fields are ignored, a wrong type is a 400
that names the field. Every error, bad input or not, leaves in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; nothing a client sends yields a 500 or a trace.

A request lives in the engine only while its client does: a streaming response is cancelled by
Starlette when the client goes, a non-streaming one races its generation against the connection's
`http.disconnect`; either way closing `AsyncLLM.generate` aborts the request in the engine core,
which frees its KV blocks and stops computing it.

`build_app(llm)` is the whole HTTP surface (tests drive it with a fake llm); `serve(...)` builds the
engine first, then listens: the port accepts connections only once the model is loaded and compiled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine.client import EngineDeadError
from engine.output_processor import InvalidRequestError, RequestOutput
from engine.params import SamplingParams
from server.metrics import RequestTracker, ServerMetrics
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    VersionResponse,
    _SamplingRequest,
)

logger = logging.getLogger("kiln.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_N = 128  # samples per prompt
MAX_CHOICES = 256  # prompts x n in one request
MAX_LOGPROBS = 20
MAX_STOP = 64  # stop strings or stop token ids
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


_encoder = msgspec.json.Encoder()


def _json(body: msgspec.Struct, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


# ---- errors --------------------------------------------------------------------------------------

class APIError(Exception):
    """An error the client gets in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> Response:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return _json(ErrorResponse(error=info), self.status)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def _validation_error(e: msgspec.ValidationError) -> APIError:
    """msgspec's 'Expected `int`, got `str` - at `$.messages[0].role`' -> a 400 naming the field."""
    text = str(e)
    m = _PATH.search(text)
    path = m.group(1) if m else ""
    detail = text[: m.start()] if m else text
    missing = _MISSING.match(detail)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return APIError(400, f"missing required field '{param}'", param)
    if not path:
        return APIError(400, f"invalid request body: {detail}")
    return APIError(400, f"invalid value for '{path}': {detail}", path)


def _bad_param(e: ValueError) -> APIError:
    """SamplingParams' ValueErrors start with the field's name."""
    message = str(e)
    return APIError(400, message, getattr(e, "param", None) or (message.split(" ", 1)[0] or None))


# ---- token strings for logprobs ------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenStrings:
    """A token's exact bytes and its text, as OpenAI's logprobs show them (cached per token id)."""

    _HEX = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id not in self.special:
            if self.byte_level and all(ch in self.byte_decoder for ch in piece):
                return bytes(self.byte_decoder[ch] for ch in piece)
            if (m := self._HEX.match(piece)) is not None:  # SentencePiece byte fallback
                return bytes([int(m.group(1), 16)])
            piece = piece.replace("\u2581", " ")  # SentencePiece's word-boundary marker
        return piece.encode("utf-8", errors="replace")

    def _text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a multi-byte character
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# ---- the app -------------------------------------------------------------------------------------

class _Disconnected(Exception):
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


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        # This may run inside a cancelled scope: nothing here may wait (the generators' cleanup is synchronous).
        for task, i in tasks.items():
            if not task.done():
                task.cancel()  # lands in the generator's pending step: its `finally` aborts the engine request
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


class _Prompt:
    __slots__ = ("ids", "text")

    def __init__(self, text: str | None, ids: list[int]) -> None:
        self.text, self.ids = text, ids


def _as_token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


class OpenAIServer:
    """The routes' state: the engine front end, metrics, and the token-string cache for logprobs."""

    def __init__(self, llm, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.llm = llm
        self.max_body_bytes = max_body_bytes
        self.model_name: str = llm.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.tokens = TokenStrings(llm.tokenizer)
        self.created = int(time.time())
        self._decoders: dict[type, msgspec.json.Decoder] = {}

    # -- plumbing --

    async def _read(self, request: Request, cls: type) -> Any:
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        too_large = length is not None and length.isdigit() and int(length) > limit
        if too_large and int(length) > 4 * limit:  # type: ignore[arg-type]
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            too_large = too_large or size > limit
            if not too_large:
                chunks.append(chunk)
            elif size > 4 * limit:
                break
            # else: drain what is left of a moderately oversized body, so that the 413 reaches the client
            # before the connection closes (closing on unread data resets it)
        if too_large:
            raise self._too_large()
        decoder = self._decoders.get(cls)
        if decoder is None:
            decoder = self._decoders[cls] = msgspec.json.Decoder(cls)
        try:
            return decoder.decode(b"".join(chunks))
        except msgspec.ValidationError as e:
            raise _validation_error(e) from None
        except msgspec.DecodeError as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {_short(model)} does not exist; this server serves "
                                f"{self.model_name!r}", "model", code="model_not_found")

    def _sampling_params(self, b: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                         max_tokens_param: str = "max_tokens") -> SamplingParams:
        n = 1 if b.n is None else b.n
        mt = max_tokens_param
        stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        stop_ids = list(b.stop_token_ids or [])
        checks = [
            (1 <= n <= MAX_N, "n", f"n must be between 1 and {MAX_N} (got {n})"),
            (max_tokens is None or max_tokens >= 1, mt, f"{mt} must be at least 1 (got {max_tokens})"),
            (max_tokens is None or max_tokens <= self.llm.max_model_len, mt,
             f"{mt}={max_tokens} exceeds the model's context of {self.llm.max_model_len} tokens"),
            (logprobs is None or 0 <= logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be between 0 and {MAX_LOGPROBS} (got {logprobs})"),
            (b.top_k is None or -1 <= b.top_k <= _INT32_MAX, "top_k", f"top_k must be -1, 0 or positive (got {b.top_k})"),
            (b.min_tokens is None or 0 <= b.min_tokens <= _INT32_MAX, "min_tokens",
             f"min_tokens must be non-negative (got {b.min_tokens})"),
            (b.seed is None or _INT64_MIN <= b.seed <= _INT64_MAX - MAX_N, "seed",
             "seed must be a signed 64-bit integer"),
            (len(stop) <= MAX_STOP, "stop", f"at most {MAX_STOP} stop strings are allowed"),
            (len(stop_ids) <= MAX_STOP, "stop_token_ids", f"at most {MAX_STOP} stop token ids are allowed"),
            (all(0 <= t <= _INT32_MAX for t in stop_ids), "stop_token_ids", "stop_token_ids must be token ids"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise APIError(400, message, param)
        kwargs: dict[str, Any] = dict(
            n=n, max_tokens=max_tokens, logprobs=logprobs, stop=stop, stop_token_ids=stop_ids, seed=b.seed,
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p,
            top_k=b.top_k or 0, min_p=b.min_p or 0.0,
            presence_penalty=b.presence_penalty or 0.0, frequency_penalty=b.frequency_penalty or 0.0,
            repetition_penalty=1.0 if b.repetition_penalty is None else b.repetition_penalty,
            min_tokens=b.min_tokens or 0, ignore_eos=bool(b.ignore_eos),
            include_stop_str_in_output=bool(b.include_stop_str_in_output),
            skip_special_tokens=True if b.skip_special_tokens is None else b.skip_special_tokens,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise _bad_param(e) from None

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.llm.processor.tokenize(prompt)
        except InvalidRequestError:
            raise
        except Exception as e:  # the tokenizer rejects some strings (lone surrogates)
            raise APIError(400, f"could not tokenize the prompt: {e}", "prompt") from None

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        try:
            self.llm.processor.validate(ids, params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), e.param) from None
        except ValueError as e:  # SamplingParams re-checked with max_tokens resolved (min_tokens > room)
            raise _bad_param(e) from None

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        conversation = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"messages[{i}].role must be system, user or assistant (got {_short(msg.role)})",
                               f"messages[{i}].role")
            content = msg.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported "
                                            f"(got type {_short(part.type)})", f"messages[{i}].content")
                    texts.append(part.text)
                content = "\n".join(texts)
            if content is None:
                if role != "assistant":
                    raise APIError(400, f"messages[{i}].content is required", f"messages[{i}].content")
                content = ""
            conversation.append({"role": role, "content": content})
        try:
            return self.llm.chat_prompt(conversation, add_generation_prompt, kwargs)
        except InvalidRequestError as e:
            raise APIError(400, str(e), e.param or "messages") from None
        except Exception as e:  # a template error, or chat_template_kwargs the template cannot take
            param = "chat_template_kwargs" if kwargs else "messages"
            raise APIError(400, f"could not apply the chat template to these {param}: {type(e).__name__}: {e}",
                           param) from None

    async def _generate(self, request_id: str, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        tracker = RequestTracker(self.metrics, request_id, len(ids), params.n)
        try:
            async with contextlib.aclosing(self.llm.generate(ids, params, request_id)) as gen:
                async for out in gen:
                    tracker.update(out)
                    yield out
        finally:
            tracker.close()

    async def _until_disconnected(self, request: Request, work: Awaitable[Any]) -> Any:
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
        raise _Disconnected

    async def _collect(self, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async with contextlib.aclosing(_merge(gens)) as merged:
            async for i, out in merged:
                finals[i] = out
        if any(f is None or not f.finished for f in finals):
            raise APIError(500, "the engine ended a request without finishing it")
        return finals  # type: ignore[return-value]

    def _logprob(self, value: float) -> float:
        return max(value, _MIN_LOGPROB)

    def _completion_logprobs(self, token_ids: list[int], logprobs, offset: int) -> tuple[CompletionLogprobs, int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, (lp, top) in zip(token_ids, logprobs):
            text = self.tokens.text(tid)
            tokens.append(text)
            token_lps.append(self._logprob(lp))
            entry = {self.tokens.text(t): self._logprob(v) for t, v in top}
            entry.setdefault(text, self._logprob(lp))
            tops.append(entry)
            offsets.append(offset)
            offset += len(self.tokens.bytes(tid).decode("utf-8", errors="ignore"))
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets), offset

    def _chat_logprobs(self, token_ids: list[int], logprobs) -> ChatLogprobs:
        content = []
        for tid, (lp, top) in zip(token_ids, logprobs):
            content.append(ChatLogprobToken(
                token=self.tokens.text(tid), logprob=self._logprob(lp), bytes=list(self.tokens.bytes(tid)),
                top_logprobs=[TopLogprob(token=self.tokens.text(t), logprob=self._logprob(v),
                                         bytes=list(self.tokens.bytes(t))) for t, v in top]))
        return ChatLogprobs(content=content)

    @staticmethod
    def _usage(prompts: list[_Prompt], finals: list[RequestOutput] | None = None, generated: int = 0) -> UsageInfo:
        prompt_tokens = sum(len(p.ids) for p in prompts)
        if finals is not None:
            generated = sum(len(c.token_ids) for f in finals for c in f.outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)

    def _sse(self, chunks: AsyncIterator[msgspec.Struct]) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async with contextlib.aclosing(chunks) as gen:
                    async for chunk in gen:
                        yield b"data: " + _encoder.encode(chunk) + b"\n\n"
            except APIError as e:
                yield b"data: " + e.response().body + b"\n\n"
            except InvalidRequestError as e:
                yield b"data: " + APIError(400, str(e), e.param).response().body + b"\n\n"
            except EngineDeadError as e:
                yield b"data: " + APIError(503, f"the engine core died: {e}").response().body + b"\n\n"
            except Exception:
                logger.exception("error while streaming a response")
                yield b"data: " + APIError(500, "internal error while streaming").response().body + b"\n\n"
            yield b"data: [DONE]\n\n"

        return _SSEResponse(body(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes --

    async def health(self, request: Request) -> Response:
        """Ready and alive: the engine core answers a stats call (a dead core is noticed within ~0.2 s)."""
        if not self.llm.dead:
            try:
                self.metrics.engine.stats = await asyncio.wait_for(self.llm.get_stats(), timeout=10.0)
            except (EngineDeadError, TimeoutError, RuntimeError) as e:
                raise APIError(503, f"the engine core is not responding: {self.llm.dead or e}") from None
        if self.llm.dead:
            raise APIError(503, f"the engine core is dead: {self.llm.dead}")
        return _json(HealthResponse(status="ok"))

    async def version(self, request: Request) -> Response:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            v = package_version("kiln-llm")
        except PackageNotFoundError:
            v = "unknown"
        return _json(VersionResponse(version=v))

    async def models(self, request: Request) -> Response:
        card = ModelCard(id=self.model_name, object="model", created=self.created, owned_by="kiln",
                         root=getattr(self.llm, "model_dir", None), max_model_len=self.llm.max_model_len)
        return _json(ModelList(object="list", data=[card]))

    async def metrics_route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        if not self.llm.dead:
            try:
                self.metrics.engine.stats = await asyncio.wait_for(self.llm.get_stats(), timeout=5.0)
            except Exception as e:  # keep serving the last known values
                logger.warning("could not refresh engine stats: %s", e)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        b: TokenizeRequest = await self._read(request, TokenizeRequest)
        self._check_model(b.model)
        if b.messages is not None:
            ids = self._chat_ids(b.messages, b.add_generation_prompt is not False, None)
        elif b.prompt is not None:
            try:
                ids = self.llm.tokenizer.encode(b.prompt, add_special_tokens=b.add_special_tokens is not False)
            except Exception as e:
                raise APIError(400, f"could not tokenize the prompt: {e}", "prompt") from None
        else:
            raise APIError(400, "either prompt or messages is required", "prompt")
        strs = [self.tokens.text(t) for t in ids] if b.return_token_strs else None
        return _json(TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs))

    async def detokenize(self, request: Request) -> Response:
        b: DetokenizeRequest = await self._read(request, DetokenizeRequest)
        self._check_model(b.model)
        vocab = self.llm.processor.vocab_size
        for i, t in enumerate(b.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]={t} is not a token id (the vocabulary has {vocab})", "tokens")
        return _json(DetokenizeResponse(prompt=self.llm.tokenizer.decode(b.tokens)))

    async def completions(self, request: Request) -> Response:
        b: CompletionRequest = await self._read(request, CompletionRequest)
        self._check_model(b.model)
        prompts = self._completion_prompts(b.prompt)
        max_tokens = 16 if b.max_tokens is msgspec.UNSET else b.max_tokens
        params = self._sampling_params(b, max_tokens, b.logprobs)  # type: ignore[arg-type]
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(400, f"prompts x n must be at most {MAX_CHOICES} (got {len(prompts)} x {params.n})", "n")
        if b.echo and b.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        for p in prompts:
            self._validate(p.ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        gens = [self._generate(r, p.ids, params) for r, p in zip(ids, prompts)]
        created = int(time.time())
        if b.stream:
            include_usage = bool(b.stream_options and b.stream_options.include_usage)
            return self._sse(self._completion_chunks(rid, created, prompts, params, gens, bool(b.echo), include_usage,
                                                     bool(b.return_token_ids)))
        finals = await self._until_disconnected(request, self._collect(gens))
        choices = []
        for i, (p, final) in enumerate(zip(prompts, finals)):
            for c in final.outputs:
                prefix = self._echo_text(p) if b.echo else ""
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = self._completion_logprobs(c.token_ids, c.logprobs or [], 0)
                choice = CompletionChoice(index=i * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                if b.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = p.ids, c.token_ids
                choices.append(choice)
        return _json(CompletionResponse(id=rid, object="text_completion", created=created, model=self.model_name,
                                        choices=choices, usage=self._usage(prompts, finals)))

    def _echo_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.llm.tokenizer.decode(p.ids)

    def _completion_prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str):
            return [_Prompt(prompt, self._tokenize(prompt))]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [_Prompt(p, self._tokenize(p)) for p in prompt]
            if (ids := _as_token_ids(prompt)) is not None:
                return [_Prompt(None, ids)]
            lists = [_as_token_ids(p) for p in prompt]
            if all(ids is not None for ids in lists):
                return [_Prompt(None, ids) for ids in lists]  # type: ignore[arg-type]
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            f"token-id lists (got {type(prompt).__name__})", "prompt")

    async def _completion_chunks(self, rid: str, created: int, prompts: list[_Prompt], params: SamplingParams,
                                 gens, echo: bool, include_usage: bool,
                                 token_ids: bool) -> AsyncIterator[CompletionResponse]:
        n, generated = params.n, 0
        started: set[int] = set()
        done: set[int] = set()
        offsets: dict[int, int] = {}
        async with contextlib.aclosing(_merge(gens)) as merged:
            async for i, out in merged:
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    generated += len(c.delta_token_ids)
                    if index in done:
                        continue
                    text, first = c.delta_text, index not in started
                    if first:
                        started.add(index)
                        prefix = self._echo_text(prompts[i]) if echo else ""
                        text, offsets[index] = prefix + text, len(prefix)
                    logprobs = None
                    if params.logprobs is not None and c.delta_token_ids:
                        logprobs, offsets[index] = self._completion_logprobs(c.delta_token_ids, c.delta_logprobs,
                                                                             offsets[index])
                    if not text and logprobs is None and not c.finished and not (token_ids and c.delta_token_ids):
                        if first:
                            started.discard(index)  # the echo goes out with the first chunk actually sent
                        continue
                    if c.finished:
                        done.add(index)
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    if token_ids:
                        choice.token_ids = c.delta_token_ids
                        if first:
                            choice.prompt_token_ids = prompts[i].ids
                    choices.append(choice)
                if choices:
                    yield CompletionResponse(id=rid, object="text_completion", created=created, model=self.model_name,
                                             choices=choices)
        if include_usage:
            yield CompletionResponse(id=rid, object="text_completion", created=created, model=self.model_name,
                                     choices=[], usage=self._usage(prompts, generated=generated))

    async def chat_completions(self, request: Request) -> Response:
        b: ChatCompletionRequest = await self._read(request, ChatCompletionRequest)
        self._check_model(b.model)
        if b.top_logprobs is not None and not b.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if b.top_logprobs is not None and not 0 <= b.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS} (got {b.top_logprobs})",
                           "top_logprobs")
        logprobs = (b.top_logprobs or 0) if b.logprobs else None
        mt = "max_completion_tokens" if b.max_completion_tokens is not None else "max_tokens"
        params = self._sampling_params(b, getattr(b, mt), logprobs, mt)
        kwargs = dict(b.chat_template_kwargs or {})
        if b.continue_final_message:
            kwargs["continue_final_message"] = True
        add_generation_prompt = b.add_generation_prompt is not False and not b.continue_final_message
        prompt = _Prompt(None, self._chat_ids(b.messages, add_generation_prompt, kwargs or None))
        self._validate(prompt.ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self._generate(rid, prompt.ids, params)
        created = int(time.time())
        if b.stream:
            include_usage = bool(b.stream_options and b.stream_options.include_usage)
            return self._sse(self._chat_chunks(rid, created, prompt, params, gen, include_usage,
                                               bool(b.return_token_ids)))
        (final,) = await self._until_disconnected(request, self._collect([gen]))
        choices = []
        for c in final.outputs:
            choice = ChatChoice(index=c.index, message=ChatResponseMessage(role="assistant", content=c.text),
                                logprobs=None if logprobs is None else self._chat_logprobs(c.token_ids, c.logprobs or []),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if b.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = prompt.ids, c.token_ids
            choices.append(choice)
        return _json(ChatCompletionResponse(id=rid, object="chat.completion", created=created, model=self.model_name,
                                            choices=choices, usage=self._usage([prompt], [final])))

    async def _chat_chunks(self, rid: str, created: int, prompt: _Prompt, params: SamplingParams, gen,
                           include_usage: bool, token_ids: bool) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=self.model_name,
                                       choices=choices, usage=usage)

        # The role goes first, before any token exists: the client sees the stream open at once.
        first = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(params.n)]
        if token_ids:
            for choice in first:
                choice.prompt_token_ids = prompt.ids
        yield chunk(first)
        generated = 0
        done: set[int] = set()
        async with contextlib.aclosing(_merge([gen])) as merged:
            async for _, out in merged:
                choices = []
                for c in out.outputs:
                    generated += len(c.delta_token_ids)
                    if c.index in done:
                        continue
                    logprobs = None
                    if params.logprobs is not None and c.delta_token_ids:
                        logprobs = self._chat_logprobs(c.delta_token_ids, c.delta_logprobs)
                    if not c.delta_text and logprobs is None and not c.finished and not (token_ids and c.delta_token_ids):
                        continue
                    if c.finished:
                        done.add(c.index)
                    choice = ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text or None),
                                             logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    if token_ids:
                        choice.token_ids = c.delta_token_ids
                    choices.append(choice)
                if choices:
                    yield chunk(choices)
        if include_usage:
            yield chunk([], self._usage([prompt], generated=generated))


def _route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every way a request can fail becomes an OpenAI-shaped error; a bug is logged, never shown."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except _Disconnected:
            return Response(status_code=499)
        except ClientDisconnect:
            return Response(status_code=499)
        except InvalidRequestError as e:
            return APIError(400, str(e), e.param).response()
        except EngineDeadError as e:
            return APIError(503, f"the engine core died: {e}").response()
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            return APIError(500, "internal server error").response()

    return wrapped


class _APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every /v1 route; /health, /metrics, /version stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and (path == "/v1" or path.startswith("/v1/")):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return APIError(exc.status_code, f"{message}: {request.method} {request.url.path}").response()


async def _server_error(request: Request, exc: Exception) -> Response:
    return APIError(500, "internal server error").response()


def build_app(llm, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The HTTP app over an AsyncLLM (or anything with its attributes: tokenizer, processor, max_model_len,
    model_name, dead, generate, chat_prompt, get_stats)."""
    server = OpenAIServer(llm, max_body_bytes)
    routes = [
        Route("/health", _route(server.health), methods=["GET"]),
        Route("/version", _route(server.version), methods=["GET"]),
        Route("/metrics", _route(server.metrics_route), methods=["GET"]),
        Route("/v1/models", _route(server.models), methods=["GET"]),
        Route("/v1/completions", _route(server.completions), methods=["POST"]),
        Route("/v1/chat/completions", _route(server.chat_completions), methods=["POST"]),
        Route("/tokenize", _route(server.tokenize), methods=["POST"]),
        Route("/detokenize", _route(server.detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = server
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


# ---- kiln serve ----------------------------------------------------------------------------------

def _bind(host: str, port: int) -> socket.socket:
    """Bind now (a taken port fails before the model loads); uvicorn listens only once the engine is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(model: str | None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          engine_args: dict[str, Any] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          log_level: str = "info") -> int:
    import uvicorn

    from engine.config import EngineConfig
    from engine.llm import AsyncLLM

    engine_args = dict(engine_args or {})
    EngineConfig(model=model, **engine_args)  # bad engine flags fail here, before anything starts
    try:
        sock = _bind(host, port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", host, port, e)
        return 1
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("serving %s at %s (Ctrl-C to stop)", llm.model_name, url)

    # uvicorn re-raises the signal it stopped for once it is done; make SIGTERM unwind through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    llm = None
    try:
        logger.info("loading the model and warming up the engine; %s opens once it is ready", url)
        llm = AsyncLLM(model, **engine_args)
        app = build_app(llm, api_key=api_key, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
        _Server(config).run(sockets=[sock])
    except EngineDeadError as e:
        logger.error("the engine failed to start: %s", e)
        return 1
    finally:
        sock.close()
        if llm is not None:
            llm.shutdown()
    return 0
