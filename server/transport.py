"""The HTTP/1.1 connections `kiln serve` accepts: uvicorn's, with a deadline on each request's head and
on a response's reader.

uvicorn times out idle keep-alive connections but not a request head that trickles in: a client
sending a header byte now and then (slowloris) holds its connection, and one of the server's
connection slots, for as long as it likes. Bodies have their own deadline (server/serving.py). Nor does
it time out a client that stops reading its response: a stream would wait for it, and a whole reply would
sit in the socket's buffer, for ever. A connection whose unsent data has not shrunk for WRITE_TIMEOUT_S
is dropped, and what it held is freed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # from a connection's start, or its last response, to a whole request head
WRITE_TIMEOUT_S = 30.0  # for a client that has stopped reading to take any of what waits for it


class TimeoutProtocol(H11Protocol):
    """Closes a connection whose next request head is not complete within HEAD_TIMEOUT_S, and drops one
    whose client takes nothing of a full write buffer within WRITE_TIMEOUT_S."""

    head_timer: asyncio.TimerHandle | None = None
    write_timer: asyncio.TimerHandle | None = None

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The write buffer is full: the client has this long to take some of it."""
        super().pause_writing()
        self._watch_writes(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def _watch_writes(self, unsent: int) -> None:
        self._stop_write_timer()
        self.write_timer = self.loop.call_later(WRITE_TIMEOUT_S, self._write_timed_out, unsent)

    def _write_timed_out(self, unsent: int) -> None:
        now = self.transport.get_write_buffer_size()
        if now < unsent:  # slow, but reading
            self._watch_writes(now)
        else:
            self.transport.abort()  # close() would wait for the buffer to drain, which it never will

    def _stop_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_head():
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # first: the call below may start a pipelined request, which disarms it
        super().on_response_complete()


def uvicorn_config(app: Any, limit_concurrency: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=TimeoutProtocol,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=1,  # after the drain: only idle connections are left
        # The last line of defence, past the engine's own 429s: connections beyond it get a 503.
        limit_concurrency=limit_concurrency,
    )
