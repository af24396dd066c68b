"""CUDA attention: a step's multi-token chunks as one padded SDPA batch with a mask, each KV head repeated
for its query heads."""

from __future__ import annotations

import torch
from torch import Tensor

from compiled.attention import (
    AttentionBackend,
    AttentionMetadata,
    Scoring,
    attend,
    gather_keys,
    gather_values,
)


class CudaAttention(AttentionBackend):
    vector_bytes = 64  # as AVX-512's: a choice not measured on a GPU

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=dtype)

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scoring: Scoring,
    ) -> Tensor:
        return prefill_attention(q, k_cache, v_cache, meta, scoring, expand_kv=True)


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scoring: Scoring,
    expand_kv: bool,
) -> Tensor:
    """Multi-token chunks as one padded batch: q [T, H, D] (the whole step) -> [T - Bd, H, D] for the chunk
    tokens.

    `expand_kv` repeats each KV head for its query heads: CUDA's fused SDPA kernels take a mask but no GQA,
    and SDPA's math fallback would materialise every score."""
    k = gather_keys(k_cache, meta.prefill_block_tables)  # [P, Hkv, L, D]
    v = gather_values(v_cache, meta.prefill_block_tables)
    qp = q[meta.prefill_query_index].transpose(1, 2)  # [P, H, Qp, D]
    key_pos = torch.arange(k.shape[2], device=q.device)
    query_pos = meta.prefill_query_pos[:, None, :, None]
    mask = key_pos <= query_pos  # [P, 1, Qp, L]
    if scoring.window:  # each query attends to the `window` keys up to its own
        mask &= key_pos > query_pos - scoring.window
    # Unwritten slots may hold anything, NaN included: a masked score still meets them.
    written = (key_pos[None, :] <= meta.prefill_query_pos.amax(1)[:, None])[:, None, :, None]  # [P, 1, L, 1]
    k, v = torch.where(written, k, 0.0), torch.where(written, v, 0.0)
    if expand_kv:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = attend(qp, k, v, mask, scoring)
    P, H, Qp, D = out.shape
    return out.transpose(1, 2).reshape(P * Qp, H, D)[meta.prefill_out_index]
