"""Weights from an HF directory (safetensors) onto our modules, and a GGUF file's one-time conversion.

Where a model's files are is decided without torch, in engine/model_files.py; a GGUF file's conversion
(config, tokenizer, safetensors) then loads in about a second instead of half a minute at later starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from compiled.models.llama import CPU_HAS_FAST_BF16, ModelArgs, Transformer, rope_inv_freq

logger = logging.getLogger("kiln.loader")


def convert_gguf(path: str, target: str) -> None:
    """De-quantize a GGUF file through transformers' GGUF support into an HF directory at `target`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start, target = time.perf_counter(), Path(target)
    folder, name = os.path.split(os.path.abspath(path))
    logger.info("de-quantizing %s (first start only)", path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent or interrupted conversion never leaves a half directory
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    logger.info("cached de-quantized weights in %s (%.1f s)", target, time.perf_counter() - start)


def load_config(model_dir: str):
    return AutoConfig.from_pretrained(model_dir)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware computes it fast (CUDA, AMX or AVX-512-BF16 CPUs), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if CPU_HAS_FAST_BF16 else torch.float32


# HF parameter name -> ours; q/k/v and gate/up are fused on load.
_RENAMES = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.", r"layers.\1.attention.\2_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
]
_FUSED = {  # ours <- the HF parts, concatenated in this order along dim 0
    r"layers.\1.attention.wqkv.": (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.", "qkv"),
    r"layers.\1.feed_forward.w13.": (r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.", ("gate", "up")),
}


def convert_state_dict(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map an HF Llama-family state dict onto `Transformer`'s names. Unknown names are kept as is,
    so that `load_weights` reports them as unexpected."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for ours, (pattern, _) in _FUSED.items():
            m = re.match(pattern, name)
            if m:
                key = m.expand(ours) + name[m.end() :]
                parts.setdefault(key, {})[m.group(2)] = tensor
                break
        else:
            for pattern, repl in _RENAMES:
                new, n = re.subn(pattern, repl, name)
                if n:
                    out[new] = tensor
                    break
            else:
                out[name] = tensor
    for key, pieces in parts.items():
        order = "qkv" if "wqkv" in key else ("gate", "up")
        missing = [p for p in order if p not in pieces]
        if missing:
            raise ValueError(f"checkpoint has an incomplete fused weight {key}: missing {missing}")
        out[key] = torch.cat([pieces[p] for p in order], dim=0)
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


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Transformer:
    """Build the model from `model_dir`'s config and weights; a missing or unexpected tensor is an error."""
    args = ModelArgs.from_hf_config(load_config(model_dir))
    with torch.device("meta"):
        model = Transformer(args)
    state = convert_state_dict(read_safetensors(model_dir))
    if args.tie_word_embeddings:
        state.pop("output.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not match the model: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        expected_shape = getattr(module, attr).shape
        if tuple(tensor.shape) != tuple(expected_shape):
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected_shape)}"
            )
        setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(args).to(device)  # built on the meta device above
    return model.eval()
