"""GGUF files read directly: their tensors under HF names (Q4_0, Q4_1 and Q8_0 blocks as they are, for
quantization "gguf"), and a file's one-time conversion into an HF directory under the cache.

The header is parsed here rather than by the gguf package, which decodes every metadata string, and the
conversion reads the tensors itself rather than through transformers' GGUF loader, which parses the file
again for each of config, tokenizer and model and maps tensor names by building a model.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from compiled.models.family import ModelFamily, family_of, renamed
from compiled.models.llama import ModelArgs
from compiled.quant import GGUF_BLOCK, Quantized, from_gguf

logger = logging.getLogger("kiln.loader")

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
_FLOATS = ("F32", "F16", "BF16")


def gguf_tensors(path: str) -> tuple[dict, list[tuple[str, str, int, list[int], np.ndarray]]]:
    """(metadata, [(name, type, type id, ggml shape, raw bytes)]) of a GGUF file; numeric arrays in the
    metadata (token scores) are left unread, as None."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf, pos = memoryview(data), 0

    def read(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = read("Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode()

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, n = read("I"), read("Q")
            if item in (8, 9):
                return [value(item) for _ in range(n)]
            pos += n * struct.calcsize(_GGUF_SCALARS[item])
            return None
        return read(_GGUF_SCALARS[kind])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = read("I"), read("Q"), read("Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    meta = {string(): value(read("I")) for _ in range(n_kv)}  # a key is read before its value
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), read("I")
        infos.append((name, [read("Q") for _ in range(dims)], read("I"), read("Q")))
    align = meta.get("general.alignment", 32)
    start = -(-pos // align) * align
    ends = sorted([off for *_, off in infos] + [len(data) - start])
    tensors = []
    for name, shape, kind, off in infos:
        type_name, end = _GGUF_TYPES.get(kind, f"type {kind}"), ends[ends.index(off) + 1]
        tensors.append((name, type_name, kind, shape, data[start + off : start + end]))
    return meta, tensors


def own_blocks(path: str) -> bool:
    """Whether a GGUF file's layers' matrices are all float or of block types kiln computes on as they
    are, with some of the latter."""
    tensors = gguf_tensors(path)[1]
    kinds = {kind for name, kind, _, shape, _ in tensors if name.startswith("blk.") and len(shape) == 2}
    return bool(kinds & GGUF_BLOCK.keys()) and kinds <= GGUF_BLOCK.keys() | set(_FLOATS)


def _weights(
    arch: str, tensors: Iterable, args: ModelArgs, family: ModelFamily
) -> Iterator[tuple[str, str, torch.Tensor | Quantized]]:
    """(HF name, GGUF type, value) of each tensor: Q4_0, Q4_1 and Q8_0 blocks as they are, other block
    types de-quantized, float tensors as float32."""
    if family.gguf_names is None:
        raise ValueError(
            f"kiln reads no GGUF file of {family.model_types[0]} models; convert it to safetensors"
        )
    for gguf_name, kind, kind_id, shape, raw in tensors:
        if gguf_name == "rope_freqs.weight":  # Llama 3's RoPE scaling, which the config also gives
            continue
        name = renamed(gguf_name, family.gguf_names) or gguf_name
        cols, rows = int(shape[0]), int(np.prod(shape[1:]))
        if kind in GGUF_BLOCK and len(shape) == 2:
            value: torch.Tensor | Quantized = from_gguf(
                kind, raw[: rows * cols // 32 * GGUF_BLOCK[kind]], rows, cols
            )
        else:
            value = torch.from_numpy(_dequantize(gguf_name, kind, kind_id, raw, rows * cols))
            value = value.view(rows, cols) if len(shape) > 1 else value
        if arch == "llama" and re.search(r"self_attn\.(q|k)_proj\.", name):
            # llama.cpp stores Llama's q/k rows interleaved for its RoPE; HF's order is rotate-half.
            heads = args.n_heads if ".q_proj." in name else args.n_kv_heads
            perm = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
            value = value.rows(perm) if isinstance(value, Quantized) else value[perm]
        yield name, kind, value


def read_gguf(path: str, args: ModelArgs, family: ModelFamily) -> dict[str, torch.Tensor | Quantized]:
    """A GGUF file's tensors under HF names, as `_weights` gives them; de-quantized block types are logged."""
    meta, tensors = gguf_tensors(path)
    state: dict[str, torch.Tensor | Quantized] = {}
    fallback: dict[str, list[str]] = {}
    for name, kind, value in _weights(str(meta.get("general.architecture", "")), tensors, args, family):
        state[name] = value
        if not isinstance(value, Quantized) and kind not in _FLOATS:
            fallback.setdefault(kind, []).append(name)
    for kind, names in fallback.items():
        logger.warning("%d %s tensors (%s, ...) are computed de-quantized", len(names), kind, names[0])
    return state


def _dequantize(name: str, kind: str, kind_id: int, raw: np.ndarray, count: int) -> np.ndarray:
    """float32 values of a tensor kiln does not compute on in its stored form."""
    if kind == "F32":
        return raw[: count * 4].view(np.float32).copy()
    if kind == "F16":
        return raw[: count * 2].view(np.float16).astype(np.float32)
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(kind_id)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return gguf.quants.dequantize(raw[: count // block * size], qtype).astype(np.float32).reshape(-1)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"GGUF tensor {name} has block type {kind}, which kiln cannot read ({e})") from None


def _hf_config(meta: dict, tensor_names: list[str]):
    """The config transformers' GGUF loader builds from this metadata, through its own key table."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    # llama.cpp writes the output projection only when it is not the embedding matrix; the weights are
    # saved in float32.
    fields = {"tie_word_embeddings": "output.weight" not in tensor_names, "dtype": "float32"}
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        field = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if field not in (None, -1) and value is not None:
            fields[field] = value
    fields.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens") or ()))
    return AutoConfig.for_model(**fields)


def _tokenizer(path: str, config):
    """The tokenizer class AutoTokenizer picks for `config`, built from the GGUF file: AutoTokenizer itself
    would build the config again, through transformers' slow GGUF loader."""
    from transformers import TOKENIZER_MAPPING, TokenizersBackend

    cls = TOKENIZER_MAPPING.get(type(config), None) or TokenizersBackend
    folder, name = os.path.split(os.path.abspath(path))
    return cls.from_pretrained(folder, gguf_file=name)


def convert_gguf(path: str, target: str) -> None:
    """De-quantize a GGUF file into an HF directory at `target`: config.json, tokenizer files and float32
    weights (a tied LM head left out), as transformers' GGUF support would give them.

    One process converts a file at a time: the data-parallel engine cores of one server all start on the
    same file, and those that waited load what the first wrote. The lock is the kernel's, so a converter
    that dies releases it; what such a one left half written is removed by the next."""
    target_dir = Path(target)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(target_dir.with_name(target_dir.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target_dir / "model.safetensors").exists():
            return
        _remove_abandoned(target_dir)
        _convert(path, target_dir)


def _remove_abandoned(target: Path) -> None:
    """`target`'s temporary directories (`NAME.tmpPID`, a float32 copy of the model each) whose process is
    gone; called under the conversion lock, so no live converter of this version is writing one."""
    pattern = re.compile(re.escape(target.name) + r"\.tmp([0-9]+)")
    for tmp in target.parent.iterdir():
        m = pattern.fullmatch(tmp.name)
        if m and tmp.is_dir() and not tmp.is_symlink() and not _alive(int(m.group(1))):
            logger.info("removing %s, left by a conversion that did not finish", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _convert(path: str, target: Path) -> None:
    from safetensors.torch import save_file

    start = time.perf_counter()
    logger.info("de-quantizing %s (first start only)", path)
    meta, tensors = gguf_tensors(path)
    config = _hf_config(meta, [t[0] for t in tensors])
    family, args = family_of(config), ModelArgs.from_hf_config(config)
    bar = tqdm(tensors, desc=f"de-quantizing {os.path.basename(path)}", unit="tensor", disable=None)
    state = {
        name: value.dequantize() if isinstance(value, Quantized) else value
        for name, _, value in _weights(str(meta["general.architecture"]), bar, args, family)
    }
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"))
    _tokenizer(path, config).save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent or interrupted conversion never leaves a half directory
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    logger.info("cached de-quantized weights in %s (%.1f s)", target, time.perf_counter() - start)
