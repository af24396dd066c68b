"""An engine core's side of several API servers (`kiln serve --api-server-count N`).

The launcher (`kiln serve`, client 0) starts the cores and the DP coordinator, sends each core StartCore and
stops it; each API server (clients 1..N) is a client of every core. Every socket is ipc:// in the
launcher's private directory (mode 0700): each client's output `out{j}`, each core's input `in{i}`, the
coordinator's input from the cores `coordinator` and its view for the API servers `view`
(engine/coordinator.py).
"""

from __future__ import annotations

import contextlib

import zmq
import zmq.utils.monitor

from engine.messages import EngineCoreOutput


class ApiClients:
    """A core's outputs to its clients. Invariants: `owner` maps each unfinished sample the core was sent
    to the client that sent it; `greeted` holds the launcher and every client whose Hello arrived, which
    are sent CoreReady (on arrival, or once the core is ready) and any CoreFailed."""

    def __init__(self, ctx: zmq.Context, directory: str, num_clients: int) -> None:
        self.outputs: list[zmq.Socket] = []
        self.monitors: list[zmq.Socket] = []
        for j in range(num_clients):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a busy API server's outputs wait for it, not dropped
            self.monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.connect(f"ipc://{directory}/out{j}")
            self.outputs.append(sock)
        self.coordinator = ctx.socket(zmq.PUSH)  # its queue bounded: reports past it are dropped
        self.coordinator.connect(f"ipc://{directory}/coordinator")
        self.owner: dict[str, int] = {}
        self.greeted = {0}

    def send(self, frame: bytes, client: int | None = None) -> None:
        """To `client`, or (None) to every greeted one; dropped where the client has no connection (the
        launcher has then gone, or the API server, whose requests `gone` reports)."""
        for j in sorted(self.greeted) if client is None else (client,):
            if 0 <= j < len(self.outputs):
                with contextlib.suppress(zmq.Again):
                    self.outputs[j].send(frame, copy=False, flags=zmq.NOBLOCK)

    def by_client(self, outputs: list[EngineCoreOutput]) -> dict[int, list[EngineCoreOutput]]:
        """`outputs` grouped by the client each request came from (none for a client gone); finished ones
        are forgotten."""
        grouped: dict[int, list[EngineCoreOutput]] = {}
        for out in outputs:
            client = (self.owner.pop if out.finished else self.owner.get)(out.request_id, None)
            if client is not None:
                grouped.setdefault(client, []).append(out)
        return grouped

    def gone(self) -> list[str]:
        """The requests of every client whose connection has ended since the last call, forgotten: the core
        aborts them (an API server killed, say; a new one at its address is a client again)."""
        ids: list[str] = []
        for j, monitor in enumerate(self.monitors):
            if not monitor.poll(0):
                continue
            while monitor.poll(0):
                zmq.utils.monitor.recv_monitor_message(monitor)
            self.greeted.discard(j)
            ids += [rid for rid, client in self.owner.items() if client == j]
        for rid in ids:
            del self.owner[rid]
        return ids
