"""The Llama family as plain modules: Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3.

One forward over a packed step: all scheduled tokens of all sequences, flattened to [T]. The
differences between the family members are config switches: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings (SmolLM2), RoPE scaling (Llama 3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor import inductor_prims

from compiled import parallel
from compiled.attention import (
    AttentionMetadata,
    DecodeAttention,
    decode_attention_matmul,
    decode_attention_reduction,
    new_kv_cache,
    paged_attention,
    write_kv,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Mistral-style local attention; sequences no longer than the window attend fully, so the runner
    # caps the context there rather than implementing the window.
    sliding_window: int | None = None
    tp_rank: int = 0  # tensor parallelism: this process's part of every weight (compiled/parallel.py)
    tp_size: int = 1

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; kiln runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
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
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=config.max_position_embeddings,
            rope_scaling=rope or None,
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=window
            if (window := getattr(config, "sliding_window", None))
            and (model_type == "mistral" or getattr(config, "use_sliding_window", False))
            else None,
        )


def rope_inv_freq(args: ModelArgs) -> Tensor:
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim)
    )
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
    """Rotate-half RoPE (the HF layout); x is [T, heads, head_dim], cos/sin are [T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(amx_bf16|avx512_bf16)\b", flags))


# AMX or AVX-512-BF16: this CPU computes bfloat16 natively. A constant, so that traced code reads a bool.
CPU_HAS_FAST_BF16 = _cpu_has_fast_bf16()


def cpu_matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU matmul of `dtype` operands runs in: float32 without bfloat16 arithmetic."""
    return dtype if dtype == torch.float32 or CPU_HAS_FAST_BF16 else torch.float32


class Linear(nn.Linear):
    """nn.Linear with a faster path for one row or a few, and for CPUs without bfloat16 arithmetic
    (BENCHMARKS.md).

    - `row_blocks` > 0 (set by the compile policy for compiled graphs): one row, or each row of a decode
      step of a few (`few_rows`, set while the policy traces one), is a matrix-vector reduction, pure
      weight streaming that Inductor vectorises faster than BLAS, the weight's rows reduced in
      `row_blocks` blocks side by side so that each thread streams several places of the weight at once.
      The input is materialised once in float32 first: left to fuse, Inductor would recompute the
      RMSNorm for every weight row.
    - `weight_left` marks a decode batch. On CPU its rows run through oneDNN on a copy of the weight packed
      for it (`prepacked`, set by `pack`); unpacked, MKL's sgemm is much faster with the weight as its
      left operand, (W @ xᵀ)ᵀ. Prefill takes a bfloat16 packed copy too (`PACKED_PREFILL_DTYPES`), except
      where the output is added to the residual stream (`into_residual`): there F.linear lets Inductor
      fuse the add into the matmul (`addmm`), rounding the sum to bfloat16 once where the packed product
      and a separate add would round twice.
    - Half-precision weights on a CPU without bfloat16 arithmetic: the matmul runs in float32 (products
      of bfloat16 values are exact there), since BLAS emulates bfloat16 several times slower.
    """

    row_blocks = 0
    few_rows = False
    packed_rows = True  # False while the policy traces a step whose rows run on the weight as stored

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, into_residual: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.into_residual = into_residual  # its output is added to the residual stream
        self.register_buffer("prepacked", None, persistent=False)  # see pack

    def forward(self, x: Tensor, weight_left: bool = False) -> Tensor:
        if self.row_blocks and (x.shape[0] == 1 or self.few_rows):
            return self.matvec(x)
        w = self.prepacked
        prefill_packed = w is not None and w.dtype in PACKED_PREFILL_DTYPES and not self.into_residual
        if w is not None and self.packed_rows and (weight_left or prefill_packed):
            b = None if self.bias is None else self.bias.to(w.dtype)
            return torch.ops.kiln.packed_linear(x.to(w.dtype), w, b).to(x.dtype)
        w, b, dtype = self.weight, self.bias, x.dtype
        if x.device.type == "cpu" and cpu_matmul_dtype(dtype) != dtype:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
        if weight_left and x.device.type == "cpu":  # an MKL finding; cuBLAS is not measured
            y = (w @ x.T).T
            return (y if b is None else y + b).to(dtype)
        return F.linear(x, w, b).to(dtype)

    def matvec(self, x: Tensor) -> Tensor:
        """Rows [M, K] -> [M, N] as `row_blocks` reductions over blocks of the weight's rows."""
        w, b, dtype = self.weight, self.bias, x.dtype
        x = inductor_prims.force_stride_order(x.float(), x.stride())
        n = -(-w.shape[0] // self.row_blocks)
        y = torch.cat(
            [(x[:, None, :] * w[None, i : i + n].float()).sum(-1) for i in range(0, w.shape[0], n)], -1
        )
        y = y.to(dtype)
        return y if b is None else y + b

    def pack(self) -> None:
        """On CPU, decode matmuls of several rows run through oneDNN on a copy of the weight packed once for
        it, in the dtype the matmul runs in (float32 on CPUs without bfloat16 arithmetic). 1.4x faster than
        the unpacked matmul at 16 rows, ~4 % at 128 (BENCHMARKS.md), for a second copy of the weight: one
        row (and a few, where `few_rows`) keeps the compiled reduction over the original."""
        w = self.weight
        dtype = cpu_matmul_dtype(w.dtype)
        if w.device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES:
            # The row-count hint hardly matters: packed for 8, 32 or 64 rows, every count ran alike.
            self.prepacked = torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype), 64)


PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Prefill's row counts change step by step, where decode's are bucketed. In bfloat16 oneDNN's packed product
# costs no more memory over many row counts than F.linear does, and its results are the same bits, 4 %
# sooner in a 2,048-token step; in float32 it grew a process several times more than F.linear did
# (BENCHMARKS.md).
PACKED_PREFILL_DTYPES = (torch.bfloat16,)

# oneDNN's linear over a packed weight, as an op Inductor calls as it is: its own lowering of the op
# takes the weight for a constant, and kiln's layer graphs take weights as inputs.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


for _key in ("CPU", "MkldnnCPU"):  # a packed bfloat16 weight is an oneDNN tensor
    _lib.impl("packed_linear", _packed_linear, _key)


@torch.library.register_fake("kiln::packed_linear")
def _(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 and cast back before scaling, as the reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        split = parallel.Split.of(args)
        self.n_heads, self.n_kv_heads, self.head_dim = split.heads, split.kv_heads, args.head_dim
        self.tensor_parallel = args.tp_size > 1
        q_size, kv_size = self.n_heads * args.head_dim, self.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.wo = Linear(q_size, args.dim, bias=args.o_bias, into_residual=True)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        # This layer's paged KV cache (layouts in compiled/attention.py), attached by the runner.
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.decode_attention: DecodeAttention = decode_attention_matmul

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        T, decode = x.shape[0], meta.decode_only
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x, decode).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.head_dim**-0.5, self.decode_attention)
        out = self.wo(out.reshape(T, q_size), decode)
        return parallel.all_reduce(out) if self.tensor_parallel else out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = parallel.Split.of(args).intermediate
        self.w13 = Linear(args.dim, 2 * width, bias=False)  # gate and up, fused
        self.w2 = Linear(width, args.dim, bias=False, into_residual=True)
        self.tensor_parallel = args.tp_size > 1

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        gate, up = self.w13(x, decode).chunk(2, dim=-1)
        out = self.w2(F.silu(gate) * up, decode)
        return parallel.all_reduce(out) if self.tensor_parallel else out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin, meta)
        return h + self.feed_forward(self.ffn_norm(h), meta.decode_only)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.split = parallel.Split.of(args)
        self.tok_embeddings = nn.Embedding(self.split.vocab, args.dim)  # this rank's rows of the vocabulary
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, self.split.vocab, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)  # made by cache_rope
        self.register_buffer("rope_sin", None, persistent=False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        block: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """Hidden states of every token of a packed step: input_ids and positions are [T].

        `block(layer, h, cos, sin, meta)`, when given, runs each layer in place of `layer(h, cos, sin, meta)`.
        """
        h = self.embed(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers:
            h = layer(h, cos, sin, meta) if block is None else block(layer, h, cos, sin, meta)
        return self.norm(h)

    def cache_rope(self, max_len: int, dtype: torch.dtype) -> None:
        """cos and sin of every position below max_len, made once before the first step: a step gathers its
        rows, where computing them took seven eager ops (~0.1 ms of a one-row CPU step)."""
        positions = torch.arange(max_len, device=self.inv_freq.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.args.tp_size == 1:
            return self.tok_embeddings(input_ids)
        # Each rank looks up the tokens its rows hold; the others' rows add zeros.
        local = input_ids - self.split.vocab_start
        mine = (local >= 0) & (local < self.split.vocab)
        h = self.tok_embeddings(torch.where(mine, local, 0)).masked_fill(~mine[:, None], 0)
        return parallel.all_reduce(h)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """Logits of the sampled rows: at most one per sequence, a decode batch's worth. Under tensor
        parallelism every rank computes its vocabulary shard and rank 0 gets them all (None elsewhere)."""
        logits = self.output(hidden, weight_left=True).float()
        return logits if self.args.tp_size == 1 else parallel.gather_vocab(logits, self.args.vocab_size)

    def pack_weights(self) -> None:
        """Every plain Linear's weight packed for oneDNN (`Linear.pack`), the LM head's included: the
        largest matmul of a decode step, whose logits then come out row-major, which the sampler's row
        maxima read several times faster than the transposed product. Quantized layers keep their own."""
        for module in self.modules():
            if type(module) is Linear:
                module.pack()
        if getattr(self.output, "prepacked", None) is not None:  # a quantized head has none
            self.output.few_rows = False  # one weight read for all rows beats one a row from 2 rows on

    def use_fused_kernels(self, row_blocks: int) -> None:
        """The formulations that are fast once Inductor fuses them (eagerly they would materialise large
        products): matrix-vector reductions for one row, decode attention as reductions over the pages."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.row_blocks = row_blocks
            elif isinstance(module, Attention):
                module.decode_attention = decode_attention_reduction

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        for layer in self.layers:
            layer.attention.k_cache, layer.attention.v_cache = new_kv_cache(
                num_blocks, block_size, self.split.kv_heads, self.args.head_dim, device, dtype
            )
