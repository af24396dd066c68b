"""Gemma 2: Llama's modules with Gemma's switches on (`ModelArgs.gemma`: scaled embeddings, norms of
1 + weight before and after each sublayer, a tanh GELU, soft-capped scores and logits), local and
global attention alternating layer by layer (`layer_types`), under Gemma's weight names."""

from __future__ import annotations

from compiled.models import llama
from compiled.models.family import ModelFamily

FAMILY = ModelFamily(
    model_types=("gemma2",),
    hf_names=(  # ahead of Llama's, whose post_attention_layernorm is the MLP's norm
        (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_attention_norm."),
        (r"^model\.layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.ffn_norm."),
        (r"^model\.layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.post_ffn_norm."),
        *llama.FAMILY.hf_names,
    ),
    hf_fused=llama.FAMILY.hf_fused,
    gguf_names=None,
    build=llama.Transformer,
)
