"""What the processes kiln starts share: each dies with the process that started it."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading


def lower_thread_priority() -> None:
    """The calling thread at nice 19 (Linux sets niceness per thread; elsewhere nothing changes): work
    that can wait, off the cores the model's threads need."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL us when our starter (pid `parent`) exits, however it exits: no orphans."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Reparented: the starter died before prctl took effect. (A front end may itself be pid 1.)
    if os.getppid() != parent:
        sys.exit(1)


def end_process() -> None:
    """Exit 0 now, once logs and stdio are flushed, skipping the interpreter's teardown: after torch it
    takes half a second that a front end stopping the process waits out, and what it would release (the
    process's memory, sockets, OpenMP threads) goes with the process anyway. For a main that has released
    what outlives it (children, files, shared memory) itself."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


WORKER_TOPIC = b"kiln worker "  # a worker subscribes to its name too: this, then "RANK on HOST"


def worker_sockets(address: str) -> tuple[str, str]:
    """The engine core's two sockets for workers at `address` (tcp://HOST:PORT): calls on PORT, answers
    on PORT + 1."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a rendezvous the caller starts right after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
