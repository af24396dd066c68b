"""Large replies: built off the event loop, written in pieces.

An echoed prompt with its logprobs, or /tokenize of a long text with its token strings, is tens of
megabytes of JSON made in Python: built on the event loop, it would hold every stream and /health for a
second. A reply of more than INLINE_ENTRIES entries is built and encoded on a thread of its own; one thread,
since the work holds the GIL and more threads would only take more of the loop's turns. The body then
goes out in PIECE-byte writes, each once the client has taken enough of the one before (uvicorn's flow
control), so it is never copied whole into the socket's buffer; a client that stops reading is cut off by
the connection's write deadline (server/transport.py), and the body is freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from engine.outputs import RequestOutput
from server.errors import encode

INLINE_ENTRIES = 4096  # tokens, or logprob entries, that a reply built on the event loop may hold
PIECE = 64 << 10  # bytes per write of a large body

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _builder() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-reply")
        return _pool


def size(finals: list[RequestOutput], logprobs: int | None, with_prompts: bool) -> int:
    """About how many entries a reply made of `finals` holds: its tokens (and its prompts' tokens, where it
    shows them), times the logprobs each one carries."""
    tokens = sum(sum(len(c.token_ids) for c in f.outputs) for f in finals)
    if with_prompts:
        tokens += sum(len(f.prompt_token_ids) for f in finals)
    return tokens * (1 if logprobs is None else logprobs + 1)


async def build(entries: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: on the event loop for a small reply of `entries`, else on the reply thread."""
    if entries <= INLINE_ENTRIES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_builder(), fn, *args)


async def respond(entries: int, fn: Callable[..., Any], *args: Any) -> Response:
    """The JSON reply of the msgspec Struct `fn(*args)` makes, built and encoded as `build` says."""
    return json_body(await build(entries, lambda: encode(fn(*args))))


def json_body(body: bytes) -> Response:
    """`body` as a response: in one write when small, else PIECE bytes at a time."""
    if len(body) <= PIECE:
        return Response(body, media_type="application/json")

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), PIECE):
            yield body[start : start + PIECE]

    length = {"Content-Length": str(len(body))}
    return StreamingResponse(pieces(), media_type="application/json", headers=length)
