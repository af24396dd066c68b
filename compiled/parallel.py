"""Tensor parallelism: the process group of one engine core's workers, the collectives the model calls,
and how a checkpoint's weights are split among the ranks.

One group per engine core, so the world is the group: gloo on CPU, NCCL on CUDA, rendezvous through
torch.distributed's environment (MASTER_ADDR, MASTER_PORT; the executor sets them, or torchrun does).
The all-reduces inside layers are functional collectives, which Dynamo traces into the compiled graphs;
the gathers and broadcasts around the LM head and sampler run eagerly, once per step.

Split (Megatron's): q/k/v and gate/up by output rows (whole heads, an equal share of the MLP), o and
down by input columns, their partial sums all-reduced; the token embedding and LM head by vocabulary
rows, padded to an equal share. With fewer KV heads than ranks, each rank keeps the one KV head its
query heads read (replicated), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

if TYPE_CHECKING:
    from compiled.quant import Quantized  # imports the model's Linear, which imports this module

_group: dist.ProcessGroup | None = None
# A rank that waits this long in a collective has lost its peers: the executor has failed the engine.
TIMEOUT = datetime.timedelta(minutes=10)


def init(rank: int, size: int, device: torch.device) -> None:
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=TIMEOUT)
    _group = dist.group.WORLD


def all_reduce(x: Tensor) -> Tensor:
    """The sum over ranks of each rank's partial `x`."""
    return funcol.all_reduce(x, "sum", _group)


def gather_vocab(local: Tensor, vocab_size: int) -> Tensor | None:
    """Every rank's vocabulary shard of the logits, [S, V / size] each, joined on rank 0 (None elsewhere)."""
    rank = dist.get_rank(_group)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(_group))] if rank == 0 else None
    dist.gather(local.contiguous(), parts, dst=0, group=_group)
    return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None


def broadcast(t: Tensor) -> Tensor:
    """Rank 0's `t` on every rank (the others pass a tensor of the same shape and dtype to fill)."""
    dist.broadcast(t, src=0, group=_group)
    return t


def barrier() -> None:
    dist.barrier(group=_group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Split:
    """Which part of each weight one rank holds."""

    rank: int
    size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, args: Any) -> Split:
        """The split a ModelArgs (compiled/models/llama.py) names with its tp_rank and tp_size."""
        return cls(
            args.tp_rank,
            args.tp_size,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            args.intermediate_size,
            args.vocab_size,
        )

    @property
    def heads(self) -> int:
        return self.n_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.n_kv_heads // self.size)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def first_kv_head(self) -> int:
        if self.n_kv_heads >= self.size:
            return self.rank * self.kv_heads
        return self.rank * self.heads // (self.n_heads // self.n_kv_heads)  # the one its queries read

    def state_dict(self, state: dict[str, Tensor | Quantized]) -> dict[str, Tensor | Quantized]:
        """This rank's part of a whole state dict under the model's names (compiled/loader.py)."""
        return {name: self._part(name, value) for name, value in state.items()}

    def _part(self, name: str, value: Tensor | Quantized) -> Tensor | Quantized:
        hd, r = self.head_dim, self.rank
        if ".wqkv." in name:
            q0, k0 = r * self.heads * hd, self.n_heads * hd + self.first_kv_head() * hd
            v0 = k0 + self.n_kv_heads * hd
            index = torch.cat(
                [
                    torch.arange(q0, q0 + self.heads * hd),
                    torch.arange(k0, k0 + self.kv_heads * hd),
                    torch.arange(v0, v0 + self.kv_heads * hd),
                ]
            )
            return _rows(value, index)
        if ".w13." in name:
            i, n = self.intermediate_size, self.intermediate
            return _rows(
                value, torch.cat([torch.arange(r * n, (r + 1) * n), torch.arange(i + r * n, i + (r + 1) * n)])
            )
        if name.endswith(("wo.weight", "w2.weight")):
            n = self.heads * hd if ".wo." in name else self.intermediate
            return _columns(name, value, r * n, (r + 1) * n)
        if name.endswith("wo.bias"):  # added once: the ranks' partial sums are added up after it
            return value if r == 0 else torch.zeros_like(value)
        if name in ("tok_embeddings.weight", "output.weight"):
            return _rows(
                value, torch.arange(self.vocab_start, self.vocab_start + self.vocab), self.vocab_size
            )
        return value  # norms: every rank needs them whole


def _rows(value: Tensor | Quantized, index: Tensor, limit: int | None = None) -> Tensor | Quantized:
    """Rows `index` of a weight; indices at or past `limit` are padding rows of zeros."""
    valid = None if limit is None else index < limit
    if valid is not None:
        index = index.clamp(max=limit - 1)
    if not isinstance(value, Tensor):
        part = value.rows(index)
        if valid is not None:
            part.scale[~valid], part.min[~valid] = 0.0, 0.0
        return part
    part = value[index]
    if valid is not None:
        part[~valid] = 0
    return part


def _columns(name: str, value: Tensor | Quantized, start: int, end: int) -> Tensor | Quantized:
    if isinstance(value, Tensor):
        return value[:, start:end].contiguous()
    g = value.group
    if start % g or end % g:
        raise ValueError(
            f"{name} is quantized in groups of {g} columns, which a split into {end - start} columns "
            "per rank would cut"
        )
    return dataclasses.replace(
        value,
        q=value.q[:, start:end].contiguous(),
        scale=value.scale[:, start // g : end // g].contiguous(),
        min=value.min[:, start // g : end // g].contiguous(),
    )
