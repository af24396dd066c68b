"""The GPU check as it will run on a GPU machine: its verdict, and the device kit run on this CPU in an
environment like a bare torch image's."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from server.bench.gpu_check import verdict

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = [1, 2, 4]


def cuda_run() -> dict:
    """A CUDA run that proved everything: every bucket replayed, no kernel launched one by one."""
    return {
        "config": {"device": "cuda", "buckets": BUCKETS},
        "errors": {},
        "greedy_mismatches": [],
        "counters": {"graphs": 3, "graph_breaks": 0, "cudagraph_skips": 0, "graphs_after_warmup": 0},
        "graphs": {
            "compiled": {b: {"replays": 1, "kernels": 0} for b in BUCKETS},
            "eager": {b: {"replays": 0, "kernels": 420} for b in BUCKETS},
        },
    }


def test_the_verdict_passes_a_run_that_replayed_every_bucket():
    assert verdict(cuda_run()) == []


def _set(path: str, value) -> Callable[[dict], None]:
    def apply(r: dict) -> None:
        *keys, last = path.split("/")
        for k in keys:
            r = r[int(k) if k.isdigit() else k]
        r[int(last) if last.isdigit() else last] = value

    return apply


@pytest.mark.parametrize(
    "breakage, problem",
    [
        (
            _set("graphs/compiled/2", {"replays": 1, "kernels": 60}),
            "bucket 2: 60 kernels launched one by one",
        ),
        (_set("graphs/compiled/4", {"replays": 0, "kernels": 0}), "bucket 4: no CUDA graph replayed"),
        (_set("graphs/eager", {1: {"replays": 0, "kernels": 420}}), "bucket 2: launches not counted"),
        (_set("counters/cudagraph_skips", 2), "Inductor skipped 2 CUDA graphs"),
        (_set("counters/graphs_after_warmup", 1), "1 graphs compiled after warm-up"),
        (
            _set("errors/compiled", "Traceback ...\nRuntimeError: boom\n"),
            "phase compiled raised: RuntimeError",
        ),
        (_set("greedy_mismatches", ["prompt 3"]), "diverged from transformers: prompt 3"),
    ],
)
def test_the_verdict_rejects_a_run_that_did_not_prove_capture(breakage, problem):
    r = cuda_run()
    breakage(r)
    assert any(problem in p for p in verdict(r)), verdict(r)


def test_a_run_without_the_exactness_check_fails():
    r = cuda_run()
    del r["greedy_mismatches"]
    assert verdict(r) == ["greedy exactness was not checked"]


def test_the_device_kit_runs_gpu_check_in_a_bare_torch_environment(tmp_path):
    """`make device-dry-run`: the kit is built, then its script runs on this CPU in a venv that has torch
    and transformers but not msgspec (nor anything else of kiln's), installing from the kit alone."""
    done = subprocess.run(
        ["make", "-s", "device-dry-run", f"DRY_RUN_OUT={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    kit = json.loads((tmp_path / "kit.json").read_text())
    assert kit["missing_before_install"] == ["msgspec"]
    result = json.loads((tmp_path / "gpu-check-quick.json").read_text())
    assert result["ok"] and result["greedy_mismatches"] == [] and result["problems"] == []
    assert set(result["phase_s"]) == {"compiled", "eager", "roofline"}
    assert result["counters"]["graphs_after_warmup"] == 0
    assert "token-exact" in done.stdout
    size = sum(f.stat().st_size for f in (ROOT / ".device").rglob("*") if f.is_file())
    assert size < 64 << 20
