"""vLLM's CPU backend as the peer of `kiln bench throughput --compare vllm` and `kiln bench serve
--compare vllm`: it lives in a venv of its own (../shared/peers/setup-vllm-cpu.sh) and runs in its own
processes, on kiln's weights, dtype, context length and CPU threads. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

VLLM_PYTHON = str(Path.home() / ".cache" / "kiln-peers" / "vllm" / "bin" / "python")
# vLLM reads the architecture from config.json; a de-quantized GGUF's config names none.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def python(given: str | None) -> str:
    path = given or os.environ.get("KILN_VLLM_PYTHON") or VLLM_PYTHON
    if not Path(path).exists():
        raise ValueError(
            f"no vLLM peer at {path}: run ../shared/peers/setup-vllm-cpu.sh, or pass --vllm-python"
        )
    return path


def command(python_path: str, args: list[str], threads: int) -> list[str]:
    """`args` run by the peer's Python with its environment (the venv's vllm-env.sh: KV cache size,
    TCMalloc, offline), its OpenMP threads bound to the first `threads` CPUs kiln may use."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env_script = Path(python_path).parent.parent / "vllm-env.sh"
    setup = f"export VLLM_CPU_OMP_THREADS_BIND={','.join(map(str, cpus))}; "
    if env_script.exists():
        setup += f'source "{env_script}"; '
    return ["bash", "-c", setup + 'exec "$@"', "vllm-peer", python_path, *args]


@contextlib.contextmanager
def model_dir(kiln_model_dir: str) -> Iterator[str]:
    """kiln's model directory as vLLM reads it: the same files, and a config that names its architecture."""
    config = json.loads((Path(kiln_model_dir) / "config.json").read_text())
    if config.get("architectures"):
        yield kiln_model_dir
        return
    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"the vLLM peer does not know model_type {config.get('model_type')!r}")
    with tempfile.TemporaryDirectory(prefix="kiln-vllm-model-") as tmp:
        for f in Path(kiln_model_dir).iterdir():
            if f.name != "config.json":
                (Path(tmp) / f.name).symlink_to(f.resolve())
        config["architectures"] = [ARCHITECTURES[config["model_type"]]]
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        yield tmp


def offline(
    python_path: str,
    kiln_model_dir: str,
    dtype: str,
    max_model_len: int,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
) -> dict:
    """vLLM's `LLM.generate` over the same token prompts (server/bench/vllm_peer.py): its elapsed time
    and token counts, or {"unavailable": why}."""
    script = str(Path(__file__).with_name("vllm_peer.py"))
    with model_dir(kiln_model_dir) as d, tempfile.TemporaryDirectory(prefix="kiln-vllm-run-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(
            json.dumps(
                dict(
                    model=d, dtype=dtype, max_model_len=max_model_len, prompts=prompts, output_len=output_len
                )
            )
        )
        # -P: the script's folder stays off sys.path, so no module of kiln's shadows one of vLLM's.
        proc = subprocess.run(
            command(python_path, ["-P", script, str(request), str(result)], threads),
            stdin=subprocess.DEVNULL,
        )
        if not result.exists():
            return {"unavailable": f"the vLLM peer exited with code {proc.returncode} and no result"}
        out = json.loads(result.read_text())
    if "error" in out:
        return {"unavailable": out["error"]}
    return out


def serve_command(
    python_path: str, kiln_model_dir: str, port: int, name: str, dtype: str, max_model_len: int, threads: int
) -> list[str]:
    """`vllm serve` on 127.0.0.1:`port` as the peers' README runs it, by the peer's own Python."""
    args = [
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        kiln_model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--generation-config",
        "vllm",
    ]
    return command(python_path, args, threads)
