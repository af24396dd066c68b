"""The server's freed memory handed back to the system (Linux, glibc; elsewhere nothing changes).

Large buffers are mapped on their own and unmapped when freed (`return_large_buffers_to_the_system`).
Smaller ones, freed by the million after a burst of large requests (long prompts tokenized, large
responses built), leave glibc's heaps holding the memory, spread over the arenas of the threads that did
the work; the process would keep that size for good. When no request has run for IDLE_S, `malloc_trim`
returns the free pages of every arena, off the event loop (`ReleaseWhenIdle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import Callable

IDLE_S = 1.0
M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


def return_large_buffers_to_the_system() -> None:
    """glibc raises its mmap threshold each time a large buffer is freed, after which large request bodies
    and replies come from the heap and their memory stays with the process once freed; a fixed threshold
    keeps every buffer from 1 MiB up mapped on its own and given back when freed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class ReleaseWhenIdle:
    """ASGI middleware: counts the HTTP requests in flight; IDLE_S after the last one ends with none
    begun since, the heaps are trimmed on a worker thread."""

    def __init__(self, app, trim: Callable[[int], int] | None = None) -> None:
        self.app, self.trim = app, trim or _malloc_trim()
        self.running, self.timer = 0, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.trim is None:
            return await self.app(scope, receive, send)
        self.running += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1
            if not self.running:
                self.timer = asyncio.get_running_loop().call_later(IDLE_S, self._release)

    def _release(self) -> None:
        self.timer = None
        asyncio.get_running_loop().run_in_executor(None, self.trim, 0)
