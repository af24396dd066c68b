"""Tensor parallelism: the process group of one engine core's workers (of one pipeline stage's), the
collectives the model calls, and how a checkpoint's weights are split among the ranks.

One world per engine core, its tp_size × pp_size workers (compiled/pipeline.py): gloo on CPU, NCCL on
CUDA, rendezvous through torch.distributed's environment (MASTER_ADDR, MASTER_PORT; the executor sets
them, or torchrun does).
CPU ranks on one host exchange tensors through shared memory instead (compiled/shm.py), many times faster
than gloo. The all-reduces inside layers are one op in the compiled graphs (a functional collective, or
the shared-memory custom op); the gathers and broadcasts around the LM head and sampler run eagerly,
once per step.

Split (Megatron's): q/k/v and gate/up by output rows (whole heads, an equal share of the MLP), o and
down by input columns, their partial sums all-reduced; the token embedding and LM head by vocabulary
rows, padded to an equal share. With fewer KV heads than ranks, each rank keeps the one KV head its
query heads read (replicated), as vLLM does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from compiled import shm
from compiled.shm import ShmExchange

if TYPE_CHECKING:
    from compiled.quant import Quantized  # imports the model's Linear, which imports this module

logger = logging.getLogger("kiln.worker")
_group: dist.ProcessGroup | None = None
_shm: ShmExchange | None = None  # CPU ranks on one host: collectives through shared memory
# A rank that waits this long in a collective has lost its peers: the executor has failed the engine.
TIMEOUT = datetime.timedelta(minutes=10)


def init(rank: int, tp_size: int, pp_size: int, device: torch.device) -> None:
    """Join the world of one engine core's tp_size × pp_size ranks; each pipeline stage's ranks form its
    tensor-parallel group (compiled/pipeline.py)."""
    global _group, _shm
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=tp_size * pp_size, timeout=TIMEOUT)
    if tp_size == 1:
        return
    _group = dist.group.WORLD
    if pp_size > 1:  # every rank makes every stage's group, in the same order, as torch.distributed requires
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        _group = groups[rank // tp_size]
    if device.type == "cpu" and shm.supported():
        _shm = _open_shm(rank % tp_size, tp_size)
    if rank == 0:
        logger.info(
            "tensor parallel: %d ranks, collectives through %s", tp_size, "shared memory" if _shm else backend
        )


def _open_shm(rank: int, size: int) -> ShmExchange | None:
    """The group's first rank's shared-memory file, mapped by each of its ranks, or None (gloo) unless every
    rank could map it (ranks on other hosts cannot); `rank` and `size` are within the group. The file is
    unlinked once mapped: nothing is left behind, however the ranks end."""
    token = torch.zeros(16, dtype=torch.uint8)  # the file's name; zeros: rank 0 could not make one
    path = None
    if rank == 0:
        name = uuid.uuid4().hex[:16]
        path = f"/dev/shm/kiln-tp-{name}"
        try:
            free = os.statvfs("/dev/shm")
            if free.f_bavail * free.f_frsize < 2 * shm.file_bytes(size):
                raise OSError("/dev/shm is too small")
            shm.create(path, size)
            token[:] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        except OSError:
            path = None
    dist.broadcast(token, group_src=0, group=_group)
    exchange = None
    if token.any():
        with contextlib.suppress(OSError, ValueError):
            exchange = ShmExchange(rank, size, f"/dev/shm/kiln-tp-{bytes(token.tolist()).decode()}")
    ok = torch.tensor([exchange is not None], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=_group)
    if path is not None:
        os.unlink(path)
    return exchange if ok.item() else None


# A plain dispatcher op rather than torch.library.custom_op, whose Python wrapper adds a cost to every
# call: a decode step makes two all-reduces a layer.
_lib = torch.library.Library("kiln", "DEF")
_lib.define("shm_all_reduce(Tensor x) -> Tensor")


def _shm_all_reduce(x: Tensor) -> Tensor:
    if _shm.fits(x):
        return _shm.all_reduce(x)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=_group)
    return out


_lib.impl("shm_all_reduce", _shm_all_reduce, "CPU")


@torch.library.register_fake("kiln::shm_all_reduce")
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)  # contiguous, as the sum is


def through_gloo() -> bool:
    """Whether the all-reduces are functional collectives (gloo or NCCL) rather than shared memory."""
    return _shm is None


def all_reduce(x: Tensor) -> Tensor:
    """The sum over ranks of each rank's partial `x`; traced into compiled graphs as one op either way."""
    if _shm is not None:
        return torch.ops.kiln.shm_all_reduce(x)
    return funcol.all_reduce(x, "sum", _group)


def gather_vocab(local: Tensor, vocab_size: int) -> Tensor | None:
    """Every rank's vocabulary shard of the logits, [S, V / size] each, joined on the group's first rank
    (None elsewhere)."""
    first = dist.get_rank(_group) == 0
    if _shm is not None and _shm.fits(local):
        parts = list(_shm.all_gather(local))
    else:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(_group))] if first else None
        dist.gather(local.contiguous(), parts, group_dst=0, group=_group)
    return torch.cat(parts, dim=-1)[:, :vocab_size] if first else None


def broadcast(t: Tensor) -> Tensor:
    """The group's first rank's `t` on each of its ranks (the others pass a tensor of the same shape and
    dtype to fill)."""
    if _shm is not None and _shm.fits(t):
        return t.copy_(_shm.all_gather(t)[0])
    dist.broadcast(t, group_src=0, group=_group)
    return t


def barrier() -> None:
    """Every rank of the engine core's world, every stage's."""
    dist.barrier()


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
        names = ("n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size")
        return cls(args.tp_rank, args.tp_size, *(getattr(args, n) for n in names))

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
            q, kv = self.heads * hd, self.kv_heads * hd
            k0 = self.n_heads * hd + self.first_kv_head() * hd
            return _rows(value, (r * q, q), (k0, kv), (k0 + self.n_kv_heads * hd, kv))
        if ".w13." in name:
            n = self.intermediate
            return _rows(value, (r * n, n), (self.intermediate_size + r * n, n))
        if name.endswith(("wo.weight", "w2.weight")):
            n = self.heads * hd if ".wo." in name else self.intermediate
            return _columns(name, value, r * n, (r + 1) * n)
        if name.endswith("wo.bias"):  # added once: the ranks' partial sums are added up after it
            return value if r == 0 else torch.zeros_like(value)
        if name in ("tok_embeddings.weight", "output.weight"):
            return _rows(value, (self.vocab_start, self.vocab), limit=self.vocab_size)
        return value  # norms: every rank needs them whole


def _rows(value: Tensor | Quantized, *spans: tuple[int, int], limit: int | None = None) -> Tensor | Quantized:
    """The rows of a weight in spans of (start, count); rows at or past `limit` are padding rows of zeros."""
    index = torch.cat([torch.arange(start, start + n) for start, n in spans])
    if limit is not None:
        pad, index = index >= limit, index.clamp(max=limit - 1)
    part = value[index] if isinstance(value, Tensor) else value.rows(index)
    if limit is not None and isinstance(part, Tensor):
        part[pad] = 0
    elif limit is not None:
        part.scale[pad], part.min[pad] = 0.0, 0.0
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
