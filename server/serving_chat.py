"""/v1/chat/completions: a conversation through the model's chat template, n samples, whole or streamed."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from engine.params import SamplingParams
from server import replies, tools
from server.errors import APIError
from server.limits import MAX_LOGPROBS, structured_param
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from server.serving import PromptIds, Serving
from server.streaming import ChoiceStream, has_news, usage_options


@dataclass
class ChatRun:
    """A chat request admitted to the engine: what its reply, whole or streamed, is made from."""

    body: ChatCompletionRequest
    rid: str
    created: int
    prompt: PromptIds
    params: SamplingParams
    gen: AsyncIterator[RequestOutput]
    plan: tools.ToolPlan | None


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving
        variables = serving.limits.template_variables
        self.renders_tools = variables is None or "tools" in variables
        template = getattr(serving.llm.tokenizer, "chat_template", None)
        self.parser = serving.tool_call_parser or tools.default_parser(template)

    async def create(self, request: Request) -> Response:
        b: ChatCompletionRequest = await self.s.read(request, ChatCompletionRequest)
        run = await self.start(b, f"chatcmpl-{uuid.uuid4().hex}")
        if b.stream:
            return self.s.sse(self.chunks(run, usage_options(b.stream_options)))
        final = await self.finish(request, run)
        return await replies.respond(self.size(run, final), self.reply, run, final)

    async def start(self, b: ChatCompletionRequest, rid: str) -> ChatRun:
        """Check `b` (400s name its fields), render its prompt and admit it to the engine as `rid`: a full
        engine is a 429 here, before any reply starts."""
        s = self.s
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
        plan = tools.plan(b, self.renders_tools, self.parser)
        param = structured_param(b)
        if plan is not None and plan.structured is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    400, "a required or named tool_choice cannot be combined with " + param, "tool_choice"
                )
            params, param = msgspec.structs.replace(params, structured_outputs=plan.structured), "tools"
        s.limits.check_size(1, params, bool(b.stream))
        await s.offload(s.limits.check_structured, params, param)
        kwargs = s.limits.template_kwargs(b.chat_template_kwargs)
        if plan is not None and plan.template_tools:
            kwargs["tools"] = plan.template_tools
        if b.continue_final_message:
            kwargs["continue_final_message"] = True
        add_generation_prompt = b.add_generation_prompt is not False and not b.continue_final_message
        ids = await s.offload(s.chat_ids, b.messages, add_generation_prompt, kwargs or None)
        prompt = PromptIds(None, ids)
        gen = s.generate(s.prepare(rid, prompt.ids, params, b.cache_salt), bool(b.stream))
        return ChatRun(b, rid, int(time.time()), prompt, params, gen, plan)

    async def complete(self, request: Request, run: ChatRun) -> ChatCompletionResponse:
        """The whole reply; its generation is cancelled (so aborted) if the client leaves first."""
        final = await self.finish(request, run)
        return await replies.build(self.size(run, final), self.reply, run, final)

    async def finish(self, request: Request, run: ChatRun) -> RequestOutput:
        (final,) = await self.s.until_disconnected(request, self.s.collect([run.gen]))
        return final

    @staticmethod
    def size(run: ChatRun, final: RequestOutput) -> int:
        shown = bool(run.body.return_token_ids) or run.params.prompt_logprobs is not None
        return replies.size([final], run.params.logprobs, shown)

    def reply(self, run: ChatRun, final: RequestOutput) -> ChatCompletionResponse:
        """The reply not streamed (built off the event loop when large: server/replies.py)."""
        s, b, plan, prompt, logprobs = self.s, run.body, run.plan, run.prompt, run.params.logprobs
        choices = []
        for c in final.outputs:
            lps = None if logprobs is None else s.tokens.chat_logprobs(c.token_ids, c.logprobs or [])
            message = ChatResponseMessage(role="assistant", content=c.text)
            finish_reason = c.finish_reason
            if plan is not None and plan.parser is not None:
                parsed = plan.parse(c.text, final=True)
                if parsed.calls:
                    message.content = parsed.content if parsed.content.strip() else None
                    message.tool_calls = [
                        ToolCall(id=tools.call_id(), function=FunctionCall(name=name, arguments=arguments))
                        for name, arguments in parsed.calls
                    ]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choice = ChatChoice(
                index=c.index,
                message=message,
                logprobs=lps,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
            if b.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = prompt.ids, c.token_ids
            choices.append(choice)
        return ChatCompletionResponse(
            id=run.rid,
            object="chat.completion",
            created=run.created,
            model=s.model_name,
            choices=choices,
            usage=s.usage([prompt], [final]),
            prompt_logprobs=msgspec.UNSET
            if run.params.prompt_logprobs is None
            else s.tokens.prompt_logprobs(
                prompt.ids, final.prompt_logprobs or [], run.params.prompt_logprobs
            ),
        )

    async def chunks(
        self,
        run: ChatRun,
        usage: tuple[bool, bool],  # (in a last chunk, in every chunk)
    ) -> AsyncIterator[ChatCompletionChunk]:
        s, params, plan, prompt = self.s, run.params, run.plan, run.prompt
        token_ids = bool(run.body.return_token_ids)
        include_usage, continuous_usage = usage
        parsing = plan is not None and plan.parser is not None
        readers: dict[int, tools.ToolStream] = {}  # choice index -> its text's reader
        calls_sent: dict[int, int] = {}  # choice index -> calls sent so far

        chunk = functools.partial(
            ChatCompletionChunk,
            id=run.rid,
            object="chat.completion.chunk",
            created=run.created,
            model=s.model_name,
        )

        def choice(i: int, index: int, c: CompletionOutput) -> ChatChunkChoice | None:
            logprobs = None
            if params.logprobs is not None and c.delta_token_ids:
                logprobs = s.tokens.chat_logprobs(c.delta_token_ids, c.delta_logprobs)
            text, calls, finish_reason = c.delta_text, None, c.finish_reason
            if parsing:  # the text of a call still being written is held until the call is whole
                if (reader := readers.get(index)) is None:
                    reader = readers[index] = plan.stream()
                parsed = reader.feed(c.text, final=c.finished)
                text, sent = parsed.content, calls_sent.get(index, 0)
                calls = [
                    DeltaToolCall(
                        index=sent + k,
                        id=tools.call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=arguments),
                    )
                    for k, (name, arguments) in enumerate(parsed.calls)
                ] or None
                calls_sent[index] = sent + len(parsed.calls)
                if calls_sent[index] and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if not has_news(c, text, logprobs, token_ids) and not calls:
                return None
            return ChatChunkChoice(
                index=index,
                delta=DeltaMessage(content=text or None, tool_calls=calls),
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.delta_token_ids if token_ids else msgspec.UNSET,
            )

        # The role goes first, before any token exists: the client sees the stream open at once.
        role = DeltaMessage(role="assistant", content="")
        ids = prompt.ids if token_ids else msgspec.UNSET
        yield chunk(
            choices=[ChatChunkChoice(index=i, delta=role, prompt_token_ids=ids) for i in range(params.n)]
        )
        stream = ChoiceStream([run.gen], params.n, choice)
        async for choices in stream:
            stats = s.usage([prompt], generated=stream.generated) if continuous_usage else None
            yield chunk(choices=choices, usage=stats)
        if include_usage:
            yield chunk(choices=[], usage=s.usage([prompt], generated=stream.generated))
