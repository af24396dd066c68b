"""`kiln bench startup`: wall time from process start to the first generated token, with an empty
compile cache (cold) and again with the cache it left (warm)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def time_to_first_token(args: list[str], env: dict[str, str], timeout: float = 900.0) -> float:
    """Seconds until `kiln generate ARGS` writes its first byte of output text."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        if not proc.stdout.read(1):
            raise RuntimeError(f"kiln generate exited with code {proc.wait()} before any output")
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait(timeout=timeout)


def run(model: str | None = None, dtype: str = "auto", extra_args: tuple[str, ...] = ()) -> dict:
    args = ["A", "--raw", "--max-tokens", "4", "--temperature", "0", "--dtype", dtype, *extra_args]
    if model:
        args += ["--model", model]
    with tempfile.TemporaryDirectory(prefix="kiln-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cold = time_to_first_token(args, env)
        warm = time_to_first_token(args, env)
    return {"model": model or "default", "dtype": dtype, "cold_s": cold, "warm_s": warm}
