"""The front end's handles on its engine cores: a process it started here, or a headless core elsewhere.

A local core runs as a fresh `python -m engine.core` process (not a fork); it dies with its parent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import zmq
import zmq.utils.monitor

from engine import cluster
from engine import messages as m


class CoreProcess:
    """One engine core as the front end sees it: the process it started, its input socket, ready or dead."""

    ready: m.CoreReady | None = None
    dead: str | None = None

    def __init__(self, ctx: zmq.Context, index: int, in_addr: str, out_addr: str, prepare: str) -> None:
        self.index = index
        self.input = ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "engine.core", in_addr, out_addr, prepare, str(os.getpid())],
            stdin=subprocess.DEVNULL,
        )

    def gone(self) -> str | None:
        """Why the core is gone, if it is."""
        if self.proc.poll() is None:
            return None
        return f"process exited unexpectedly (exit code {self.proc.returncode})"

    def kill(self) -> None:
        stop_process(self.proc)


class RemoteCore(CoreProcess):
    """An engine core started elsewhere (`kiln serve --headless`), reached over TCP at `address`
    (inputs) and the port after it (outputs). It is gone once its connection drops or stops answering
    heartbeats (engine/cluster.py), or at once if it refuses this front end's key. A core that leaves
    before it is ready was one still serving an earlier front end, which our StartCore stopped: its
    host starts a fresh one, which is sent StartCore again."""

    RESTARTS = 3

    def __init__(self, ctx: zmq.Context, index: int, address: str, key: cluster.ClusterKey | None) -> None:
        self.index, self.address = index, address
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.output_address = f"tcp://{host}:{int(port) + 1}"
        self.input = ctx.socket(zmq.PUSH)
        self.monitor = self.input.get_monitor_socket(zmq.EVENT_DISCONNECTED | cluster.HANDSHAKE_FAILED)
        cluster.connect(self.input, address, key)
        self.proc = None
        self.start_frame: bytes | None = None  # StartCore, as sent
        self.restarts, self.resend, self.why = 0, False, None

    def gone(self) -> str | None:
        while self.why is None and self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
            if event & cluster.HANDSHAKE_FAILED:
                self.why = f"at {self.address} refused this front end's key (each needs the same cluster key)"
            elif self.ready is None and self.start_frame is not None and self.restarts < self.RESTARTS:
                self.restarts, self.resend = self.restarts + 1, True
            else:
                self.why = f"at {self.address} went away (its connection dropped or stopped answering)"
        if self.resend and self.why is None:
            with contextlib.suppress(zmq.Again):  # until the fresh core's connection is up
                self.input.send(self.start_frame, flags=zmq.NOBLOCK)
                self.resend = False
        return self.why

    def kill(self) -> None:
        """Nothing to kill here: the core stops itself once its front end falls silent."""


class SharedCore(CoreProcess):
    """An engine core started for several API servers (engine/api_clients.py), reached at its input in
    the launcher's directory. The launcher (`clients` given) starts it; an API server finds it gone once
    its connection ends (the launcher then takes the whole server down)."""

    def __init__(
        self, ctx: zmq.Context, index: int, directory: str, clients: int | None, prepare: str
    ) -> None:
        self.index = index
        self.input = ctx.socket(zmq.PUSH)
        self.monitor = self.input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.input.connect(f"ipc://{directory}/in{index}")
        cmd = [sys.executable, "-m", "engine.core", "--shared", directory, str(index), str(clients), prepare]
        started = clients is not None
        self.proc = subprocess.Popen([*cmd, str(os.getpid())], stdin=subprocess.DEVNULL) if started else None

    why: str | None = None

    def gone(self) -> str | None:
        if self.proc is not None:
            return super().gone()
        if self.why is None and self.monitor.poll(0):
            self.why = "went away (its connection dropped)"
        return self.why

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    proc.kill()  # nothing if it has exited (Popen checks)
    proc.wait()


def release(
    procs: list[subprocess.Popen], heartbeats: cluster.Heartbeats | None, ctx: zmq.Context, ipc_dir: str
) -> None:
    """Kill the core processes still running (a clean stop is `shutdown`'s); close every socket at once."""
    for proc in procs:
        stop_process(proc)
    if heartbeats is not None:
        heartbeats.stop()  # before its sockets close under it
    if not ctx.closed:
        ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
