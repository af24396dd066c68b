"""Phi-3: Llama's architecture with q/k/v and gate/up stored fused, as kiln keeps them, and RoPE over the
part of each head its config names (`partial_rotary_factor`)."""

from __future__ import annotations

from compiled.models import llama
from compiled.models.family import ModelFamily

FAMILY = ModelFamily(
    model_types=("phi3",),
    hf_names=(
        (r"^model\.layers\.(\d+)\.self_attn\.qkv_proj\.", r"layers.\1.attention.wqkv."),
        (r"^model\.layers\.(\d+)\.mlp\.gate_up_proj\.", r"layers.\1.feed_forward.w13."),
        *llama.FAMILY.hf_names,
    ),
    hf_fused=(),
    gguf_names=None,
    build=llama.Transformer,
)
