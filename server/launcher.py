"""`kiln serve --api-server-count N`: N HTTP server processes on one port, each with its own tokenizer and
detokenizer, all reaching every engine core (engine/api_clients.py).

This process binds the port, starts the engine cores and the DP coordinator (engine/coordinator.py) as
client 0 of the cores, and, once they are ready, the API servers, each `kiln serve` again with the
listening socket inherited: the kernel hands each new connection to one of them. Prometheus metrics are
shared through a directory (prometheus_client's multiprocess mode), so that a scrape of any server counts
the requests of all. An API server that dies leaves the others serving; SIGTERM or Ctrl-C drains them all,
then stops the cores.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from engine.core_client import SyncCoreClient
from engine.errors import EngineDeadError
from engine.front_end import FrontEnd

logger = logging.getLogger("kiln.server")


class _LauncherClient(SyncCoreClient):
    fail_together = False  # a core that dies fails its own requests, in the API servers


def launch(
    model: str | None, sock, count: int, engine_args: dict[str, Any], argv: list[str], shutdown_timeout: float
) -> int:
    """Serve with `count` API servers on the bound `sock`; `argv` is this `kiln serve` command's arguments,
    which each API server runs again as one of them. Returns the exit code."""
    directory = tempfile.mkdtemp(prefix="kiln-api-")  # mode 0700: only this user reaches the sockets
    metrics = os.path.join(directory, "metrics")
    os.mkdir(metrics)
    front, servers = None, []
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        api_server = f"{directory}:0:{count + 1}"
        front = FrontEnd(model, _LauncherClient, {**engine_args, "api_server": api_server})
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics}
        fd = sock.fileno()
        for j in range(1, count + 1):
            attach = f"{directory}:{j}:{count + 1}:{fd}:{os.getpid()}"
            cmd = [sys.executable, "-m", "server.cli", *argv, "--api-server", attach]
            servers.append(subprocess.Popen(cmd, env=env, pass_fds=[fd], stdin=subprocess.DEVNULL))
        logger.info("%d API servers, %d engine cores", count, len(front.client.cores))
        running = set(range(len(servers)))
        while not stop and running:
            for j in [j for j in running if servers[j].poll() is not None]:
                running.discard(j)
                code = servers[j].returncode
                logger.error("API server %d exited (code %d); %d go on serving", j + 1, code, len(running))
            front.client.check_alive()
            time.sleep(0.2)
        if not stop:  # every API server is gone, none asked to
            logger.error("every API server has exited: stopping")
            return 1
    except EngineDeadError as e:
        logger.error("the engine failed: %s", e)
        return 1
    finally:
        for p in servers:  # each drains its requests, as on its own
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_timeout + 10
        for p in servers:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if front is not None:
            front.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    return 0
