"""Paged KV cache writes and paged attention in plain PyTorch, for Inductor to turn into kernels.

Layout: one K and one V tensor per layer; a token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. V is `[num_blocks, block_size,
n_kv_heads, head_dim]`; K is `[num_blocks, n_kv_heads, head_dim, block_size]`, each page's keys
transposed, so that decode scores are a vertical reduction over head_dim with a page's positions
in the vector lanes: no horizontal sum per key. Decode attention alone, 2 threads, float32, page 16,
batch×context, token-major K → transposed K: 1×512 186 → 142 µs, 1×2048 331 → 243, 8×128 201 →
173, 32×512 2.2 → 1.8 ms, 64×512 4.8 → 4.1 ms, 16×2048 5.3 → 4.7 ms. (Transposing V as well
gained nothing.)
Block 0 is the null block: padding tokens write there and padded block-table entries point there.
The cache is allocated uninitialised (no start-up pass over gigabytes), so every read masks the
slots a sequence has not written.

A packed step is split by shape, not by phase: the first `Bd` tokens are sequences with exactly
one query (decodes, and a prefill whose last token is all that is left), the rest are the query
tokens of `P` multi-token chunks (fresh prefills, or chunks continuing after cached context).

- Single-query rows use a gather + reduction formulation: scores are `(q * K).sum(head_dim)` and
  the output `(p * V).sum(keys)` over `k_cache[block_tables]`. Compiled, Inductor fuses the indirect
  loads into the reductions and never materialises the gathered K/V. Measured on this project's
  2-core CPU (1 thread, float32, page 16, decode attention alone, ms/call): batch×context
  1×512: 0.12 vs FlexAttention 0.15 (GQA folded) and 0.30 for SDPA over gathered K/V;
  16×2048: 8.4 vs 5.0 vs 20.1; 64×512: 8.2 vs 4.6 vs 31.6; whole-model decode float32 batch 32:
  173–194 tok/s vs 131 tok/s with FlexAttention, which also took ~5× longer to compile
  (~200 s vs ~35 s) and failed to build with dynamic shapes on CPU. Eagerly the same reduction
  would materialise a [Bd, L, heads, head_dim] product, so eager mode uses matmuls instead.
  The P·V reduction runs block by block (a page of V, 12 KiB, stays in L1 while every query
  head of its group and every 8-wide slice of head_dim passes over it) on unnormalised
  exponentials, then sums the per-block partials and divides once. Over all keys at once the
  same reduction streamed each sequence's V from L2 24 times: 2 threads, batch×context 64×512,
  5.6–5.9 → 4.1–4.4 ms; 32×512 2.9 → 2.2; 1×2048 0.43 → 0.30.
- Multi-token chunks gather their sequence's K/V (context and the chunk itself, already written)
  into a padded [P, L] batch and run SDPA with a causal-by-position mask: prefill is compute-bound
  and SDPA's matmuls beat any reduction there; the few chunks per step keep the padding small.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionMetadata(NamedTuple):
    """Where each token of a packed step reads and writes KV. All int64 tensors on the model's device."""

    slot_mapping: Tensor  # [T] cache slot each token's K/V is written to
    decode_block_tables: Tensor  # [Bd, Wd] for the first Bd tokens (one query each)
    decode_seq_lens: Tensor  # [Bd] keys each single-query row attends to (its position + 1)
    prefill_block_tables: Tensor  # [P, Wp]
    prefill_query_index: Tensor  # [P, Qp] step-token index of each chunk's queries (padding: any valid index)
    prefill_query_pos: Tensor  # [P, Qp] position of each query (padding: 0)
    prefill_out_index: Tensor  # [T - Bd] row of each chunk token in the flattened [P * Qp] output

    @property
    def decode_only(self) -> bool:
        """Every token is its sequence's single query (no multi-token chunk): a decode batch."""
        return self.prefill_block_tables.shape[0] == 0


def new_kv_cache(num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One layer's K [blocks, n_kv_heads, head_dim, block_size] and V [blocks, block_size, n_kv_heads, head_dim].

    Uninitialised but for the null block: every read masks the slots a sequence has not written, so
    nothing has to touch gigabytes at start. The null block starts zeroed because the warm-up's
    throw-away rows read all of it as context, and float math on leftover garbage (denormals) is slow.
    """
    k = torch.empty(num_blocks, n_kv_heads, head_dim, block_size, device=device, dtype=dtype)
    v = torch.empty(num_blocks, block_size, n_kv_heads, head_dim, device=device, dtype=dtype)
    k[0], v[0] = 0, 0
    return k, v


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's K/V [T, n_kv_heads, head_dim] in place; nothing copies the cache."""
    bs = k_cache.shape[-1]
    k_cache[slot_mapping // bs, :, :, slot_mapping % bs] = k
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _gather(v_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, W * block_size, n_kv_heads, head_dim] values in position order."""
    B, W = block_tables.shape
    return v_cache[block_tables].reshape(B, W * v_cache.shape[1], v_cache.shape[2], v_cache.shape[3])


def _gather_keys(k_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, n_kv_heads, W * block_size, head_dim] keys in position order."""
    B, W = block_tables.shape
    _, Hkv, D, bs = k_cache.shape
    return k_cache[block_tables].permute(0, 2, 1, 4, 3).reshape(B, Hkv, W * bs, D)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """One query per row: q [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    W, (bs, Hkv) = block_tables.shape[1], v_cache.shape[1:3]
    q = q.view(B, Hkv, H // Hkv, D)  # fold the GQA group next to its KV head
    valid = (torch.arange(W * bs, device=q.device)[None, :] < seq_lens[:, None]).view(B, W, bs)
    v = v_cache[block_tables]  # [B, W, bs, Hkv, D]
    v = torch.where(valid[..., None, None], v, 0.0)  # unwritten slots may hold anything, NaN included
    if torch.compiler.is_compiling():
        k = k_cache[block_tables]  # [B, W, Hkv, D, bs]
        scores = (q.view(B, 1, Hkv, -1, D, 1).float() * k[:, :, :, None].float()).sum(4) * scale  # [B, W, Hkv, G, bs]
        scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
        e = (scores - scores.amax(dim=(1, 4), keepdim=True)).exp()
        blocks = e[..., None] * v.permute(0, 1, 3, 2, 4)[:, :, :, None].float()  # [B, W, Hkv, G, bs, D]
        out = blocks.sum(4).sum(1) / e.sum(dim=(1, 4))[..., None]  # [B, Hkv, G, D]
    else:
        k = _gather_keys(k_cache, block_tables)  # [B, Hkv, L, D]
        scores = torch.einsum("bhgd,bhld->bhgl", q.float(), k.float()) * scale
        scores = scores.masked_fill(~valid.view(B, 1, 1, -1), float("-inf"))
        out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), v.reshape(B, W * bs, Hkv, D).float())
    return out.to(q.dtype).reshape(B, H, D)


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Multi-token chunks: q [T, H, D] (the whole step) -> [T - Bd, H, D] for the chunk tokens."""
    k = _gather_keys(k_cache, meta.prefill_block_tables)  # [P, Hkv, L, D]
    v = _gather(v_cache, meta.prefill_block_tables).transpose(1, 2)
    qp = q[meta.prefill_query_index].transpose(1, 2)  # [P, H, Qp, D]
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = key_pos[None, None, None, :] <= meta.prefill_query_pos[:, None, :, None]  # [P, 1, Qp, L]
    # Unwritten slots may hold anything, NaN included: a masked score still meets them.
    written = (key_pos[None, :] <= meta.prefill_query_pos.amax(1)[:, None])[:, None, :, None]  # [P, 1, L, 1]
    k, v = torch.where(written, k, 0.0), torch.where(written, v, 0.0)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    P, H, Qp, D = out.shape
    return out.transpose(1, 2).reshape(P * Qp, H, D)[meta.prefill_out_index]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Attention for a packed step, after its K/V were written: q [T, H, D] -> [T, H, D]."""
    Bd = meta.decode_block_tables.shape[0]
    parts = []
    if Bd > 0:
        parts.append(decode_attention(q[:Bd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale))
    if meta.prefill_block_tables.shape[0] > 0:
        parts.append(prefill_attention(q, k_cache, v_cache, meta, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
