"""Models the benches write for kiln and its peers to load alike: random-weight models in the shapes of
larger open models, written once as safetensors directories (throughput past a 135M model without
downloading weights), and kiln's w8a8 weights as a checkpoint vLLM runs on its own int8 GEMM."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from engine.model_files import cache_root

# Llama-3.2-1B's config, its context (and so RoPE's original length) capped at 4,096 for the benches.
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
    ),
}


def random_model(shape: str, dest: str | None = None, **overrides: object) -> str:
    """The directory of a seeded random bfloat16 model of `shape` (written on first use, under the cache
    unless `dest` is given), with the default model's tokenizer, whose ids every shape's vocabulary holds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from server.bench.driver import model_dir

    target = Path(dest) if dest else cache_root() / "random" / shape
    if target.exists():
        return str(target)
    config = LlamaConfig(**{**SHAPES[shape], **overrides}, bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]  # vLLM picks its model class by this
    torch.manual_seed(0)
    partial = target.with_name(f"{target.name}.tmp{os.getpid()}")  # renamed once whole
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(partial)
    for f in Path(model_dir(None)).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, partial / f.name)
    partial.rename(target)
    return str(target)


# vLLM's dynamic W8A8: int8 weights, one scale per output channel; activations int8 per token at run time.
COMPRESSED_TENSORS_W8A8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def w8a8_checkpoint(model_dir: str, dtype: str, dest: str) -> str:
    """`model_dir` (a Llama-family safetensors directory) written to `dest` as a compressed-tensors W8A8
    checkpoint of the int8 weights `--quantization w8a8 --dtype dtype` computes with: q/k/v, gate/up and
    down as kiln's fields (int8 `weight`) and per-channel scales (`weight_scale`), the LM head in float.
    kiln multiplies W * s by x / s (SmoothQuant); the 1/s is folded into the op before each product: the
    RMSNorm weights (kept in float32) before q/k/v and gate/up, the up rows' scales before down. o_proj's
    input comes out of attention, where grouped query heads share their values, so no per-column factor
    folds there: its weight is re-quantized unsmoothed (per channel, kiln's bits), where kiln smooths it."""
    import torch
    from safetensors.torch import save_file

    from compiled.loader import load_model, read_safetensors
    from compiled.w8a8 import INT8_ISA, Int8Linear, quantize_weight, weight_max
    from server.bench.vllm_cpu import ARCHITECTURES

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"no W8A8 checkpoint for model_type {config.get('model_type')!r}")
    run_dtype = getattr(torch, dtype)
    model = load_model(model_dir, run_dtype, torch.device("cpu"), "w8a8")
    state = read_safetensors(model_dir)
    ignored: list[str] = []

    def fields(linear: object, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Int8 rows [N, K], their scales [N] and the 1/s the layer applies to its input, [K]."""
        if not isinstance(linear, Int8Linear):  # a shape w8a8 leaves in float
            ignored.append(name)
            return None
        scale = linear.gemm.scale
        q = torch.round(linear.tiled.dequantize() / scale[:, None]).to(torch.int8)
        return q, scale, linear.gemm.inverse

    def put(name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        state[f"{name}.weight"] = q.contiguous()
        state[f"{name}.weight_scale"] = scale.float()[:, None].contiguous()

    def fold_norm(name: str, inverse: torch.Tensor) -> None:
        state[name] = state[name].float() * inverse  # vLLM casts it to the run's dtype

    a = model.args
    for i, layer in enumerate(model.layers):
        hf = f"model.layers.{i}"
        if got := fields(layer.attention.wqkv, f"{hf}.self_attn.qkv"):
            q, scale, inverse = got
            sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
            for part, qs, ss in zip("qkv", q.split(sizes), scale.split(sizes)):
                put(f"{hf}.self_attn.{part}_proj", qs, ss)
            fold_norm(f"{hf}.input_layernorm.weight", inverse)
        o = f"{hf}.self_attn.o_proj"
        if isinstance(layer.attention.wo, Int8Linear):
            put(o, *quantize_weight(state[f"{o}.weight"].to(run_dtype), weight_max(INT8_ISA)))
        else:
            ignored.append(o)
        if got := fields(layer.feed_forward.w13, f"{hf}.mlp.gate_up"):
            q, scale, inverse = got
            (gate, up), (gate_scale, up_scale) = q.chunk(2), scale.chunk(2)
            fold_norm(f"{hf}.post_attention_layernorm.weight", inverse)
            if got := fields(layer.feed_forward.w2, f"{hf}.mlp.down_proj"):
                down, down_scale, down_inverse = got
                up_scale = up_scale * down_inverse
                put(f"{hf}.mlp.down_proj", down, down_scale)
            put(f"{hf}.mlp.gate_proj", gate, gate_scale)
            put(f"{hf}.mlp.up_proj", up, up_scale)
    if any(n.endswith(("qkv", "gate_up")) for n in ignored):
        raise ValueError(f"{model_dir}: kiln keeps some fused q/k/v or gate/up weights in float")
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    config["architectures"] = config.get("architectures") or [ARCHITECTURES[config["model_type"]]]
    config["quantization_config"] = {**COMPRESSED_TENSORS_W8A8, "ignore": ["lm_head", *ignored]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return str(out)
