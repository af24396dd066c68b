"""The front end's handles on its engine cores: a process it started here, or a headless core elsewhere.

A local core runs as a fresh `python -m engine.core` process (not a fork); it dies with its parent.
"""

from __future__ import annotations

import os
import subprocess
import sys

import zmq

from engine import cluster
from engine import messages as m


class CoreProcess:
    """One engine core as the front end sees it: the process it started, its input socket, ready or dead."""

    ready: m.CoreReady | None = None
    dead: str | None = None

    def __init__(self, ctx: zmq.Context, index: int, in_addr: str, out_addr: str) -> None:
        self.index = index
        self.input = ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "engine.core", in_addr, out_addr, str(os.getpid())],
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
    (inputs) and the port after it (outputs); it is gone once its connection drops or stops answering
    heartbeats (engine/cluster.py)."""

    def __init__(self, ctx: zmq.Context, index: int, address: str, key: cluster.ClusterKey | None) -> None:
        self.index, self.address = index, address
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.output_address = f"tcp://{host}:{int(port) + 1}"
        self.input = ctx.socket(zmq.PUSH)
        self.monitor = self.input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        cluster.connect(self.input, address, key)
        self.proc = None
        self.lost = False

    def gone(self) -> str | None:
        self.lost = self.lost or bool(self.monitor.poll(0))
        if not self.lost:
            return None
        if self.ready is None:
            return f"at {self.address} refused this front end (is its cluster key this one's?) or went away"
        return f"at {self.address} went away (its connection dropped or stopped answering)"

    def kill(self) -> None:
        """Nothing to kill here: the core stops itself once its front end falls silent."""


def stop_process(proc: subprocess.Popen) -> None:
    proc.kill()  # nothing if it has exited (Popen checks)
    proc.wait()
