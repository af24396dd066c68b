"""/v1/completions: one or more prompts (text or token ids), n samples each, whole or streamed."""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from engine.params import SamplingParams
from server.errors import APIError, json_response
from server.limits import structured_param
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from server.serving import PromptIds, Serving
from server.streaming import ChoiceStream, has_news, usage_options


def _as_token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def count_prompts(prompt: Any) -> int:
    """How many prompts `prompt` holds, counted before anything is tokenized."""
    if isinstance(prompt, list) and prompt and _as_token_ids(prompt) is None:
        return len(prompt)
    return 1


def parse_prompts(tokenize: Callable[[str], list[int]], prompt: Any, param: str) -> list[PromptIds]:
    """str, list[str], list[int] or list[list[int]]: checked here (a msgspec union has one array type)."""
    if isinstance(prompt, str):
        return [PromptIds(prompt, tokenize(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [PromptIds(p, tokenize(p)) for p in prompt]
        if (ids := _as_token_ids(prompt)) is not None:
            return [PromptIds(None, ids)]
        lists = [_as_token_ids(p) for p in prompt]
        if all(ids is not None for ids in lists):
            return [PromptIds(None, ids) for ids in lists]  # type: ignore[arg-type]
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, f"{param} must not be empty", param)
    raise APIError(
        400,
        f"{param} must be a string, a list of strings, a list of token ids or a list of "
        f"token-id lists (got {type(prompt).__name__})",
        param,
    )


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving

    async def create(self, request: Request) -> Response:
        s = self.s
        b: CompletionRequest = await s.read(request, CompletionRequest)
        max_tokens = 16 if b.max_tokens is msgspec.UNSET else b.max_tokens
        echo_only = bool(b.echo) and max_tokens == 0  # scoring a prompt (lm-eval): nothing generated
        params = s.limits.sampling_params(b, 1 if echo_only else max_tokens, b.logprobs)  # type: ignore[arg-type]
        if b.echo and b.logprobs is not None:  # the echoed prompt comes with its tokens' logprobs
            params = msgspec.structs.replace(params, prompt_logprobs=max(b.logprobs, b.prompt_logprobs or 0))
        s.limits.check_size(count_prompts(b.prompt), params, bool(b.stream))
        await s.offload(s.limits.check_structured, params, structured_param(b))
        prompts = await s.offload(parse_prompts, s.tokenize, b.prompt, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        prepared = [s.prepare(r, p.ids, params, b.cache_salt) for r, p in zip(ids, prompts)]
        gens = [s.generate(p) for p in prepared]
        body = functools.partial(
            CompletionResponse, id=rid, object="text_completion", created=int(time.time()), model=s.model_name
        )
        if b.stream:
            usage = usage_options(b.stream_options)
            echo, token_ids = bool(b.echo), bool(b.return_token_ids)
            return s.sse(self.chunks(body, prompts, params, gens, echo, echo_only, usage, token_ids))
        finals = await s.until_disconnected(request, s.collect(gens))
        choices = []
        for i, (p, final) in enumerate(zip(prompts, finals)):
            for c in final.outputs:
                prefix = self.echo_text(p) if b.echo else ""
                if echo_only:
                    c.text, c.token_ids, c.logprobs = "", [], [] if c.logprobs is not None else None
                logprobs = None
                if params.logprobs is not None:
                    ids, lps = c.token_ids, c.logprobs or []
                    if final.prompt_logprobs is not None:
                        echoed = [e and (e[0], e[1][: params.logprobs]) for e in final.prompt_logprobs]
                        ids, lps = p.ids + ids, echoed + lps
                    logprobs, _ = s.tokens.completion_logprobs(ids, lps, 0)
                choice = CompletionChoice(
                    index=i * params.n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                if b.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = p.ids, c.token_ids
                if b.prompt_logprobs is not None:
                    choice.prompt_logprobs = s.tokens.prompt_logprobs(
                        p.ids, final.prompt_logprobs or [], b.prompt_logprobs
                    )
                choices.append(choice)
        usage = s.usage(prompts, generated=0) if echo_only else s.usage(prompts, finals)
        return json_response(body(choices=choices, usage=usage))

    def echo_text(self, p: PromptIds) -> str:
        return p.text if p.text is not None else self.s.llm.tokenizer.decode(p.ids)

    async def chunks(
        self,
        body: Callable[..., CompletionResponse],
        prompts: list[PromptIds],
        params: SamplingParams,
        gens,
        echo: bool,
        echo_only: bool,
        usage: tuple[bool, bool],  # (in a last chunk, in every chunk)
        token_ids: bool,
    ) -> AsyncIterator[CompletionResponse]:
        s = self.s
        include_usage, continuous_usage = usage
        started: set[int] = set()
        offsets: dict[int, int] = {}  # text offset of each choice's next logprob
        prompt_logprobs: dict[int, list] = {}  # prompt index -> its logprobs (with its first output)

        async def noting_prompt_logprobs(i: int, gen: AsyncIterator[RequestOutput]):
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for out in gen:
                    if out.prompt_logprobs is not None:
                        prompt_logprobs.setdefault(i, out.prompt_logprobs)
                    yield out

        def choice(i: int, index: int, c: CompletionOutput) -> CompletionChoice | None:
            if echo_only:
                c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], []
            text, first = c.delta_text, index not in started
            ids, lps = c.delta_token_ids, c.delta_logprobs
            if first:
                prefix = self.echo_text(prompts[i]) if echo else ""
                text, offsets[index] = prefix + text, len(prefix)
                if i in prompt_logprobs:
                    ids, lps, offsets[index] = prompts[i].ids + ids, prompt_logprobs[i] + lps, 0
            logprobs = None
            if params.logprobs is not None and ids:
                logprobs, offsets[index] = s.tokens.completion_logprobs(ids, lps, offsets[index])
            if not has_news(c, text, logprobs, token_ids):
                return None  # the echo goes out with the first chunk actually sent
            started.add(index)
            return CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=prompts[i].ids if token_ids and first else msgspec.UNSET,
                token_ids=c.delta_token_ids if token_ids else msgspec.UNSET,
            )

        if params.prompt_logprobs is not None:
            gens = [noting_prompt_logprobs(i, g) for i, g in enumerate(gens)]
        stream = ChoiceStream(gens, params.n, choice)

        def usage_now():
            return s.usage(prompts, generated=0 if echo_only else stream.generated)

        async for choices in stream:
            yield body(choices=choices, usage=usage_now() if continuous_usage else None)
        if include_usage:
            yield body(choices=[], usage=usage_now())
