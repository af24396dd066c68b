"""Weights onto our modules: an HF directory's safetensors, or a GGUF file's own blocks (compiled/gguf.py).

Where a model's files are is decided without torch, in engine/model_files.py; a GGUF file is converted
once into an HF directory (compiled/gguf.py), which later starts load like any other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from compiled.attention import backend_for
from compiled.gguf import own_blocks, read_gguf
from compiled.models.family import ModelFamily, family_of, renamed
from compiled.models.linear import CPU_HAS_FAST_BF16, Linear
from compiled.models.llama import ModelArgs, Transformer, rope_inv_freq
from compiled.parallel import Split
from compiled.pipeline import Stage
from compiled.quant import TILE, PackedWeight, QuantEmbedding, Quantized, QuantLinear, quantizable, quantize
from compiled.w8a8 import INT8_ISA, add_int8_gemms, calibrate, int8_gemm, quantize_layers, weight_max
from engine.config import pipeline_partition, tensor_parallel_error
from engine.model_files import kept

logger = logging.getLogger("kiln.loader")


def load_config(model_dir: str) -> SimpleNamespace:
    """`model_dir`'s config as transformers resolves it (its class's defaults and derived fields, such as
    `layer_types`), kept by the bytes of config.json (`kept`): importing transformers would cost every
    later start a second."""

    def resolve() -> dict:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir).to_dict()

    try:
        raw = (Path(model_dir) / "config.json").read_bytes()
    except OSError:
        return SimpleNamespace(**resolve())  # transformers' own error names what is missing
    return SimpleNamespace(**kept("configs", raw, resolve))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware computes it fast (CUDA, AMX or AVX-512-BF16 CPUs), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if name in ("float32", "bfloat16", "float16"):
        return getattr(torch, name)
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if CPU_HAS_FAST_BF16 else torch.float32


def _cat(name: str, pieces: list) -> torch.Tensor | Quantized:
    """Parts of a fused weight stacked; quantized parts of different formats are de-quantized."""
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return torch.cat(pieces, dim=0)
    if all(isinstance(p, Quantized) for p in pieces) and (fused := Quantized.cat(pieces)) is not None:
        return fused
    logger.warning("%s: its parts are stored in different formats; computing it de-quantized", name)
    return torch.cat([p.dequantize() if isinstance(p, Quantized) else p.float() for p in pieces], dim=0)


def convert_state_dict(hf: dict[str, torch.Tensor], family: ModelFamily) -> dict[str, torch.Tensor]:
    """Map an HF state dict of `family` onto its model's names, fusing the parts the model keeps fused.
    Unknown names are kept as they are, so that `load_model` reports them as unexpected."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple[tuple[str, ...], dict[str, torch.Tensor]]] = {}
    for name, tensor in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for ours, pattern, order in family.hf_fused:
            if m := re.match(pattern, name):
                key = m.expand(ours) + name[m.end() :]
                parts.setdefault(key, (order, {}))[1][m.group(2)] = tensor
                break
        else:
            out[renamed(name, family.hf_names) or name] = tensor
    for key, (order, pieces) in parts.items():
        if missing := [p for p in order if p not in pieces]:
            raise ValueError(f"checkpoint has an incomplete fused weight {key}: missing {missing}")
        out[key] = _cat(key, [pieces[p] for p in order])
    return out


def read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [Path(model_dir) / n for n in names]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _set(model: nn.Module, name: str, value: nn.Module | nn.Parameter) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, value)


def _place(model: Transformer, name: str, value: torch.Tensor | Quantized, dtype, device) -> None:
    module_name = name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    if isinstance(value, Quantized) and value.q.shape[0] % TILE:
        rows = len(value.q)
        logger.warning("%s: %d rows do not fill tiles of %d; computing it de-quantized", name, rows, TILE)
        value = value.dequantize()
    if not isinstance(value, Quantized):
        _set(model, name, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))
        return
    packed = PackedWeight(value).to(device)
    if isinstance(module, nn.Embedding):
        _set(model, module_name, QuantEmbedding(packed, dtype))
        if model.args.tie_word_embeddings and model.output is not None:
            model.output = QuantLinear(packed, None)
    else:  # its bias, if any, is placed after it
        _set(model, module_name, QuantLinear(packed, None))


# Steps of several rows on int8, int4 and GGUF weights multiply through oneDNN's int8 GEMM on an int8 copy
# of each weight (compiled/w8a8.py), activations quantized per token as llama.cpp's are: faster than
# de-quantizing the weights for a float product where measured. Where products sum in 32 bits (VNNI, AMX):
# AVX2's int8 path takes 7-bit weights, which cost w8a8 3 % perplexity. One process only: a pipeline stage
# cannot calibrate alone, and a tensor-parallel rank would round and smooth its shard apart from the rest.
# Layers without an int8 copy get a float one (Transformer.pack_weights); KILN_INT8_GEMMS=0 makes none.
INT8_GEMMS = weight_max(INT8_ISA) == 127 and os.environ.get("KILN_INT8_GEMMS", "1") != "0"


def resolve_quantization(
    quantization: str, dtype: str, gguf_path: str | None, device: torch.device, ranks: int
) -> str:
    """What "auto" means here: a GGUF file's own blocks on an x86 CPU with AVX2 (INT8_ISA), in one
    process, where the layers' blocks are all of a type kiln reads as it is and `dtype` does not name the
    weights' dtype ("auto"): one-row steps run much faster on the blocks, and larger ones no slower, on
    an int8 GEMM's copy where products sum in 32 bits (INT8_GEMMS), else on a float copy where RAM holds
    it (`Transformer.pack_weights`). Else "none", the weights de-quantized."""
    if quantization != "auto":
        return quantization
    fast = dtype == "auto" and device.type == "cpu" and INT8_ISA is not None and ranks == 1
    return "gguf" if fast and gguf_path is not None and own_blocks(gguf_path) else "none"


def quantize_model(model: Transformer, method: str, maxima: dict[str, Tensor] | None = None) -> None:
    """Weight-only int8 or int4 of every linear. The input embedding keeps its values: a step reads
    only its own tokens' rows, and rounding them cost more perplexity than all the layers together.
    With `maxima`, each linear of the layers also gets an int8 GEMM's copy made from the float weight
    (`INT8_GEMMS`)."""
    for name, module in list(model.named_modules()):
        if type(module) is Linear and quantizable(method, module.weight):
            packed = PackedWeight(quantize(module.weight, method)).to(module.weight.device)
            linear = QuantLinear(packed, None if module.bias is None else module.bias.detach())
            # As add_int8_gemms, but from the float weight: from int8's groups it would round twice.
            if maxima is not None and name.startswith("layers."):
                linear.gemm = int8_gemm(module.weight, maxima.get(name))
            _set(model, name, linear)


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    gguf_path: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    layer_partition: str | None = None,
) -> Transformer:
    """Build the model, or tensor-parallel rank `tp_rank`'s part of pipeline stage `pp_rank`'s layers (split
    as `layer_partition` says: compiled/pipeline.py), from `model_dir`'s config and weights (a GGUF file's
    own blocks with quantization "gguf"); a missing or unexpected tensor is an error."""
    config = load_config(model_dir)
    family, args = family_of(config), ModelArgs.from_hf_config(config)
    if error := tensor_parallel_error(args.n_heads, args.n_kv_heads, args.intermediate_size, tp_size):
        raise ValueError(f"{model_dir} cannot run tensor-parallel: {error}")
    args = dataclasses.replace(args, tp_rank=tp_rank, tp_size=tp_size)
    if pp_size > 1:
        if quantization == "w8a8":  # its calibration runs the whole model in one process
            raise ValueError("quantization w8a8 does not run pipeline-parallel")
        parts = pipeline_partition(args.n_layers, pp_size, layer_partition)
        start = sum(parts[:pp_rank])
        args = dataclasses.replace(
            args, pp_rank=pp_rank, pp_size=pp_size, first_layer=start, end_layer=start + parts[pp_rank]
        )
    with torch.device("meta"):
        model = family.build(args, backend_for(device))
    if quantization == "gguf" and gguf_path is None:
        raise ValueError("quantization gguf needs a .gguf model file")
    if quantization == "w8a8" and (device.type != "cpu" or INT8_ISA is None):
        raise ValueError("quantization w8a8 runs on x86 CPUs with AVX2 or better (oneDNN's int8 GEMM)")
    hf = read_gguf(gguf_path, args, family) if quantization == "gguf" else read_safetensors(model_dir)
    state = convert_state_dict(hf, family)
    if args.tie_word_embeddings:
        state.pop("output.weight", None)
    if pp_size > 1:
        state = Stage.of(args).state_dict(state)
    if tp_size > 1:
        state = Split.of(args).state_dict(state)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not match the model: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        expected_shape = model.get_parameter(name).shape
        shape = tensor.q.shape if isinstance(tensor, Quantized) else tensor.shape
        if tuple(shape) != tuple(expected_shape):
            raise ValueError(
                f"weight {name} has shape {tuple(shape)}, the config implies {tuple(expected_shape)}"
            )
    # Weights first, biases after: a linear replaced by its quantized form keeps its bias.
    for name in sorted(state, key=lambda n: n.endswith(".bias")):
        _place(model, name, state[name], dtype, device)
    tied = args.tie_word_embeddings and model.output is not None
    if tied and isinstance(model.tok_embeddings, nn.Embedding):
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(args).to(device)
    gemms = quantization in ("int8", "int4", "gguf") and device.type == "cpu" and INT8_GEMMS
    gemms = gemms and tp_size == pp_size == 1
    if quantization == "gguf":  # a file of other block types holds its layers de-quantized
        gemms = gemms and any(isinstance(m, QuantLinear) for m in model.layers.modules())
    maxima = calibrate(model, model_dir) if gemms or quantization == "w8a8" else None
    if quantization == "w8a8" and not maxima:
        raise ValueError(f"quantization w8a8 calibrates on chats its tokenizer writes: {model_dir} has none")
    if gemms:
        logger.info("steps of several rows: oneDNN's int8 GEMM on %s, on a copy of the weights", INT8_ISA)
    if quantization in ("int8", "int4"):
        quantize_model(model, quantization, maxima)
    elif gemms:
        add_int8_gemms(model, maxima)
    elif quantization == "w8a8":
        quantize_layers(model, maxima)
    return model.eval()
