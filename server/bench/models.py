"""Random-weight models in the shapes of larger open models, written once as safetensors directories
that kiln and the peers load alike: throughput past a 135M model without downloading weights."""

from __future__ import annotations

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
