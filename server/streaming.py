"""The chunk loop both endpoints stream: which choices a step of the merged generations sends, and usage."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from server.protocol import StreamOptions
from server.serving import merge


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(usage in a last chunk of its own, usage in every chunk too), as vLLM reads `stream_options`."""
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def has_news(c: CompletionOutput, text: str, logprobs: object, token_ids: bool) -> bool:
    """Whether a choice's chunk would carry anything: text, logprobs, its finish, or asked-for token ids."""
    return bool(text) or logprobs is not None or c.finished or (token_ids and bool(c.delta_token_ids))


class ChoiceStream:
    """The chunk loop both endpoints stream: per step of the merged generations, the choices with something
    new. `make_choice(prompt index, choice index, output)` builds one, or None when it has nothing to send;
    a finished choice is sent once. `generated` counts every token, sent or not."""

    def __init__(
        self,
        gens: list[AsyncIterator[RequestOutput]],
        n: int,
        make_choice: Callable[[int, int, CompletionOutput], Any | None],
    ) -> None:
        self.gens, self.n, self.make_choice = gens, n, make_choice
        self.generated = 0

    async def __aiter__(self) -> AsyncIterator[list]:
        done: set[int] = set()
        async with contextlib.aclosing(merge(self.gens)) as merged:
            async for i, out in merged:
                choices = []
                for c in out.outputs:
                    index = i * self.n + c.index
                    self.generated += len(c.delta_token_ids)
                    if index in done or (choice := self.make_choice(i, index, c)) is None:
                        continue
                    if c.finished:
                        done.add(index)
                    choices.append(choice)
                if choices:
                    yield choices
