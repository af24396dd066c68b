"""`kiln serve --headless`: the host of an engine core that front ends on other hosts connect to.

It keeps one core process listening (`python -m engine.core --listen`, engine/core.py) and starts a
fresh one whenever the last one ends: its front end left, another took over, or the core failed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from engine import cluster

HOST_FAILED = 3  # a headless core's exit code when it cannot listen or import its worker
STOP_S = 10.0  # how long a stopped host waits for its core to exit before killing it

logger = logging.getLogger("kiln.core")


def serve_headless(address: str, key_file: str | None = None) -> int:
    """`kiln serve --headless`: keep an engine core listening at `address` for a front end, a fresh one
    after each front end leaves (or its core fails), until stopped. A core that cannot listen or import
    its worker (HOST_FAILED) ends it: no other would fare better. Stopped (SIGTERM, Ctrl-C), it stops its
    core and waits for it: the kernel's parent-death signal misses a core still starting up."""
    cluster.check_listen(address, cluster.load_key(key_file))  # here, not in each core
    logger.info("headless engine core at %s and the port after it; waiting for a front end", address)
    key = ["--cluster-key-file", key_file] if key_file else []

    def stop(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut stopping the core short
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        # Our pid to watch: stopped before it looks, its parent by then is another, and it would stay.
        argv = ["--listen", address, str(os.getpid()), *key]
        core = subprocess.Popen([sys.executable, "-m", "engine.core", *argv])
        try:
            code = core.wait()
        finally:
            if core.poll() is None:
                core.terminate()
                try:
                    core.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    core.kill()
                    core.wait()
        if code == HOST_FAILED:
            logger.error("the engine core cannot run on this host (exit code %d)", code)
            return code
        if code != 0:
            logger.warning("the engine core exited with code %d: starting a fresh one", code)
            time.sleep(1.0)  # a core that keeps failing does not spin
