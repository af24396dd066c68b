"""The Llama family as plain modules: Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3 (and, by their own
weight names, Phi-3 and Gemma 2: compiled/models/phi3.py, gemma.py).

One forward over a packed step: all scheduled tokens of all sequences, flattened to [T]. The
differences between the family members are config switches: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings (SmolLM2), RoPE scaling (Llama 3), RoPE over part of each head
(Phi-3's configs), sliding windows (Mistral, Phi-3, Gemma 2's local layers), Gemma's norms, GELU and
soft-caps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiled import parallel, pipeline
from compiled.attention import (
    AttentionBackend,
    AttentionMetadata,
    Scoring,
    paged_attention,
    softcapped,
    write_kv,
)
from compiled.models.family import ModelFamily
from compiled.models.linear import Linear, cpu_matmul_dtype
from compiled.plan import OWN_CALLS, MatmulPlan, PartCalls, StepPlan, call_module
from compiled.quant import QuantLinear


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # the leading part of each head that RoPE rotates
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Gemma's: embeddings scaled by sqrt(dim), norms by (1 + weight) in float32 and also after attention
    # and the MLP, a tanh-approximated GELU, queries scaled by its own scalar, scores and logits soft-capped.
    gemma: bool = False
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # Each layer's sliding window: the keys a query attends to, itself included (0: the whole context).
    windows: tuple[int, ...] = ()
    tp_rank: int = 0  # tensor parallelism: this process's part of every weight (compiled/parallel.py)
    tp_size: int = 1
    pp_rank: int = 0  # pipeline parallelism: this stage's layers, [first_layer, end_layer or n_layers)
    pp_size: int = 1
    first_layer: int = 0
    end_layer: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        rotary = rope.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            intermediate_size=config.intermediate_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rope_dim=int(head_dim * rotary),
            norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=config.max_position_embeddings,
            rope_scaling=rope or None,
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias,
            qk_norm=model_type == "qwen3",
            gemma=model_type == "gemma2",
            attn_scale=(getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) or 0.0,
            logit_softcap=getattr(config, "final_logit_softcapping", None) or 0.0,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            windows=_windows(config),
        )


def _windows(config: Any) -> tuple[int, ...]:
    """Each layer's sliding window as the config names it: every layer's (Mistral, Phi-3) unless it lists
    which layers slide (`layer_types`: Qwen2's `use_sliding_window`, Gemma's alternation)."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * config.num_hidden_layers


def rope_inv_freq(args: ModelArgs) -> Tensor:
    d = args.rope_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"RoPE scaling type {kind!r} is not supported")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (the HF layout) over the first 2 · cos.shape[-1] of each head's dims, the rest
    passed through; x is [T, heads, head_dim], cos/sin are [T, rope_dim / 2] (the reference repeats them
    for both halves). Each half in one expression: the same bits as x·cos + rotate_half(x)·sin, where
    Inductor wrote rotate_half out first."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos[:, None], sin[:, None]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat((*rotated, rest) if rest.shape[-1] else rotated, dim=-1)


class RMSNorm(nn.Module):
    """Normalised in float32, then scaled as the reference does: by the weight after the cast back, or
    (Gemma, `unit_offset`) by 1 + the weight before it."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def _projected(
    linear: nn.Module, h: Tensor | None, x: Tensor, how: MatmulPlan, tensor_parallel: bool
) -> Tensor:
    """h + linear(x), or linear(x) alone where h is None; under tensor parallelism the ranks' partial sums
    are added up first."""
    if tensor_parallel:
        y = parallel.all_reduce(linear(x, how))
        return y if h is None else h + y
    return linear(x, how) if h is None else linear.add_to(h, x, how)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, window: int) -> None:
        super().__init__()
        self.backend = backend
        self.scoring = Scoring(args.attn_scale or args.head_dim**-0.5, window, args.attn_softcap)
        split = parallel.Split.of(args)
        self.n_heads, self.n_kv_heads, self.head_dim = split.heads, split.kv_heads, args.head_dim
        self.tensor_parallel = args.tp_size > 1
        q_size, kv_size = self.n_heads * args.head_dim, self.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.wo = Linear(q_size, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        # This layer's paged KV cache (layouts in compiled/attention.py), attached by the runner.
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def forward(
        self, h: Tensor | None, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, plan: StepPlan
    ) -> Tensor:
        """The residual stream `h` with this layer's attention over `x` (its normalised `h`) added (None:
        the attention's output alone)."""
        T, how = x.shape[0], plan.linear
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x, how).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        out = paged_attention(
            q, k, v, self.k_cache, self.v_cache, meta, self.scoring, self.backend, plan.decode_attention
        )
        return _projected(self.wo, h, out.reshape(T, q_size), how, self.tensor_parallel)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = parallel.Split.of(args).intermediate
        self.w13 = Linear(args.dim, 2 * width, bias=False)  # gate and up, fused
        self.w2 = Linear(width, args.dim, bias=False)
        self.tensor_parallel, self.gelu = args.tp_size > 1, args.gemma

    def forward(self, h: Tensor | None, x: Tensor, how: MatmulPlan) -> Tensor:
        """The residual stream `h` with the feed-forward of `x` (its normalised `h`) added (None: the
        feed-forward's output alone)."""
        gate, up = self.w13(x, how).chunk(2, dim=-1)
        act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return _projected(self.w2, h, act, how, self.tensor_parallel)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention: AttentionBackend, window: int = 0) -> None:
        super().__init__()
        norm = functools.partial(RMSNorm, args.dim, args.norm_eps, args.gemma)
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.attention = Attention(args, attention, window)
        self.feed_forward = FeedForward(args)
        # Gemma normalises each sublayer's output too, before its residual add.
        self.post_attention_norm, self.post_ffn_norm = (norm(), norm()) if args.gemma else (None, None)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, plan: StepPlan) -> Tensor:
        x = self.attention_norm(h)
        if self.post_attention_norm is None:
            h = self.attention(h, x, cos, sin, meta, plan)
            return self.feed_forward(h, self.ffn_norm(h), plan.linear)
        h = h + self.post_attention_norm(self.attention(None, x, cos, sin, meta, plan))
        return h + self.post_ffn_norm(self.feed_forward(None, self.ffn_norm(h), plan.linear))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, attention: AttentionBackend) -> None:
        """`attention`: the device's attention backend (compiled/attention.py)."""
        super().__init__()
        self.args = args
        self.split, self.stage = parallel.Split.of(args), pipeline.Stage.of(args)
        # A pipeline stage holds its own layers, the first the embedding, the last the final norm and head.
        stage = self.stage
        # Given its weight, an embedding draws none (the checkpoint's comes later; see Linear).
        table = torch.empty(self.split.vocab, args.dim)
        self.tok_embeddings = nn.Embedding(*table.shape, _weight=table) if stage.has_embedding else None
        windows = (args.windows or (0,) * args.n_layers)[stage.start : stage.end]
        self.layers = nn.ModuleList(TransformerBlock(args, attention, w) for w in windows)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.gemma) if stage.last else None
        self.output = Linear(args.dim, self.split.vocab, bias=False) if stage.last else None
        if args.tie_word_embeddings and stage.last:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", None, persistent=False)  # rope_inv_freq's, once off the meta device
        self.register_buffer("rope_cos", None, persistent=False)  # made by cache_rope
        self.register_buffer("rope_sin", None, persistent=False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        plan: StepPlan,
        calls: PartCalls = OWN_CALLS,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """Hidden states of every token of a packed step (input_ids and positions are [T]), computed as
        `plan` says, each part run through `calls`. A pipeline stage past the first starts from `hidden`,
        the previous stage's; one before the last returns its layers' output, not normalised."""
        h = self.embed(input_ids, calls.embed) if hidden is None else hidden
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers:
            h = calls.block(layer, h, cos, sin, meta, plan)
        return h if self.norm is None else calls.norm(self.norm, h)

    def cache_rope(self, max_len: int, dtype: torch.dtype) -> None:
        """cos and sin of every position below max_len, made once before the first step: a step gathers its
        rows, where computing them took seven eager ops, a share of a one-row CPU step."""
        positions = torch.arange(max_len, device=self.inv_freq.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        self.rope_cos, self.rope_sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def embed(self, input_ids: Tensor, call: Callable = call_module) -> Tensor:
        if self.args.tp_size == 1:
            h = call(self.tok_embeddings, input_ids)
        else:  # each rank looks up the tokens its rows hold; the others' rows add zeros
            local = input_ids - self.split.vocab_start
            mine = (local >= 0) & (local < self.split.vocab)
            h = call(self.tok_embeddings, torch.where(mine, local, 0)).masked_fill(~mine[:, None], 0)
            h = parallel.all_reduce(h)
        return h * h.new_tensor(self.args.dim**0.5) if self.args.gemma else h  # the scale in h's dtype

    def compute_logits(self, hidden: Tensor, how: MatmulPlan, head: Callable = call_module) -> Tensor | None:
        """Logits of the sampled rows (`head` runs the LM head): at most one per sequence, a decode batch's
        worth. Under tensor parallelism every rank computes its vocabulary shard and rank 0 gets them all
        (None elsewhere)."""
        logits = softcapped(head(self.output, hidden, how).float(), self.args.logit_softcap)
        return logits if self.args.tp_size == 1 else parallel.gather_vocab(logits, self.args.vocab_size)

    def pack_weights(self, dtype: torch.dtype, dense: bool = True) -> None:
        """Every plain Linear's weight packed for oneDNN (`Linear.pack`), the LM head's included: the
        largest matmul of a decode step, whose logits then come out row-major, which the sampler's row
        maxima read several times faster than the transposed product. A quantized head gets a float copy
        packed for products of `dtype` rows (`QuantLinear.pack`); with `dense`, quantized layers without an
        int8 GEMM's copy get a float one (`QuantLinear.copy_dense`), which `dense_bytes` sizes."""
        for module in self.modules():
            if type(module) is Linear:
                module.pack()
        for module in self.dense_copied() if dense else ():
            module.copy_dense(dtype)
        if isinstance(self.output, QuantLinear):
            self.output.pack(dtype)

    def dense_copied(self) -> list[QuantLinear]:
        """The quantized layers with no copy for several rows yet, which `pack_weights` copies in float."""
        return [m for m in self.layers.modules() if isinstance(m, QuantLinear) and m.gemm is None]

    def dense_bytes(self, dtype: torch.dtype) -> int:
        """The float copies of `pack_weights(dtype, dense=True)`: each weight in `dtype` and packed in the
        dtype its product runs in."""
        size = dtype.itemsize + cpu_matmul_dtype(dtype).itemsize
        return sum(m.in_features * m.out_features * size for m in self.dense_copied())

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        for layer in self.layers:
            layer.attention.k_cache, layer.attention.v_cache = layer.attention.backend.new_kv_cache(
                num_blocks, block_size, self.split.kv_heads, self.args.head_dim, dtype
            )


FAMILY = ModelFamily(
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    hf_names=(
        (r"^model\.embed_tokens\.", "tok_embeddings."),
        (r"^model\.norm\.", "norm."),
        (r"^lm_head\.", "output."),
        (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
        (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
        (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
        (r"^model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.", r"layers.\1.attention.\2_norm."),
        (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    ),
    hf_fused=(
        (r"layers.\1.attention.wqkv.", r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.", ("q", "k", "v")),
        (r"layers.\1.feed_forward.w13.", r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.", ("gate", "up")),
    ),
    gguf_names=(
        (r"^token_embd\.", "model.embed_tokens."),
        (r"^output_norm\.", "model.norm."),
        (r"^output\.", "lm_head."),
        (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
        (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
        (r"^blk\.(\d+)\.attn_(q|k|v)\.", r"model.layers.\1.self_attn.\2_proj."),
        (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
        (r"^blk\.(\d+)\.attn_(q|k)_norm\.", r"model.layers.\1.self_attn.\2_norm."),
        (r"^blk\.(\d+)\.ffn_(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
    ),
    build=Transformer,
)
