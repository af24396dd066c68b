"""/v1/chat/completions: a conversation through the model's chat template, n samples, whole or streamed."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput
from engine.params import SamplingParams
from server.errors import APIError, json_response
from server.limits import MAX_LOGPROBS, structured_param
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from server.serving import PromptIds, Serving
from server.streaming import ChoiceStream, has_news, usage_options


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving

    async def create(self, request: Request) -> Response:
        s = self.s
        b: ChatCompletionRequest = await s.read(request, ChatCompletionRequest)
        if b.top_logprobs is not None and not b.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if b.top_logprobs is not None and not 0 <= b.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs must be between 0 and {MAX_LOGPROBS} (got {b.top_logprobs})",
                "top_logprobs",
            )
        logprobs = (b.top_logprobs or 0) if b.logprobs else None
        mt = "max_completion_tokens" if b.max_completion_tokens is not None else "max_tokens"
        params = s.limits.sampling_params(b, getattr(b, mt), logprobs, mt)
        s.limits.check_size(1, params, bool(b.stream))
        await s.offload(s.limits.check_structured, params, structured_param(b))
        kwargs = s.limits.template_kwargs(b.chat_template_kwargs)
        if b.continue_final_message:
            kwargs["continue_final_message"] = True
        add_generation_prompt = b.add_generation_prompt is not False and not b.continue_final_message
        ids = await s.offload(s.chat_ids, b.messages, add_generation_prompt, kwargs or None)
        prompt = PromptIds(None, ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = s.generate(s.prepare(rid, prompt.ids, params, b.cache_salt))
        created = int(time.time())
        if b.stream:
            include_usage, continuous = usage_options(b.stream_options)
            return s.sse(
                self.chunks(
                    rid, created, prompt, params, gen, include_usage, continuous, bool(b.return_token_ids)
                )
            )
        (final,) = await s.until_disconnected(request, s.collect([gen]))
        choices = []
        for c in final.outputs:
            lps = None if logprobs is None else s.tokens.chat_logprobs(c.token_ids, c.logprobs or [])
            choice = ChatChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=lps,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            if b.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = prompt.ids, c.token_ids
            choices.append(choice)
        body = ChatCompletionResponse(
            id=rid,
            object="chat.completion",
            created=created,
            model=s.model_name,
            choices=choices,
            usage=s.usage([prompt], [final]),
        )
        return json_response(body)

    async def chunks(
        self,
        rid: str,
        created: int,
        prompt: PromptIds,
        params: SamplingParams,
        gen,
        include_usage: bool,
        continuous_usage: bool,
        token_ids: bool,
    ) -> AsyncIterator[ChatCompletionChunk]:
        s = self.s

        chunk = functools.partial(
            ChatCompletionChunk, id=rid, object="chat.completion.chunk", created=created, model=s.model_name
        )

        def choice(i: int, index: int, c: CompletionOutput) -> ChatChunkChoice | None:
            logprobs = None
            if params.logprobs is not None and c.delta_token_ids:
                logprobs = s.tokens.chat_logprobs(c.delta_token_ids, c.delta_logprobs)
            if not has_news(c, c.delta_text, logprobs, token_ids):
                return None
            out = ChatChunkChoice(
                index=index,
                delta=DeltaMessage(content=c.delta_text or None),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            if token_ids:
                out.token_ids = c.delta_token_ids
            return out

        # The role goes first, before any token exists: the client sees the stream open at once.
        first = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(params.n)
        ]
        if token_ids:
            for c in first:
                c.prompt_token_ids = prompt.ids
        yield chunk(choices=first)
        stream = ChoiceStream([gen], params.n, choice)
        async for choices in stream:
            usage = s.usage([prompt], generated=stream.generated) if continuous_usage else None
            yield chunk(choices=choices, usage=usage)
        if include_usage:
            yield chunk(choices=[], usage=s.usage([prompt], generated=stream.generated))
