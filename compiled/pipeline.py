"""Pipeline parallelism: the layers split into stages of worker processes, each stage tensor_parallel_size
ranks wide (global rank = stage × tp_size + tp_rank), a step's hidden states handed from each rank to
the same tensor-parallel rank of the next stage with torch.distributed's point-to-point calls (gloo on
CPU, NCCL on CUDA).

The first stage embeds the tokens; the last normalises, computes the logits and samples. Each stage
holds its own layers' weights and KV cache only. Every rank is sent every step and lays its inputs out
alike, so a stage knows the shape of what it receives without being told.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Stage:
    """Which layers one stage runs: [start, end) of the model's `n_layers`."""

    rank: int
    size: int
    start: int
    end: int
    n_layers: int
    tied: bool  # the LM head is the token embedding: the last stage holds the embedding too

    @classmethod
    def of(cls, args: Any) -> Stage:
        """The stage a ModelArgs (compiled/models/llama.py) names with its pp_rank and layer range."""
        end = args.end_layer or args.n_layers
        return cls(args.pp_rank, args.pp_size, args.first_layer, end, args.n_layers, args.tie_word_embeddings)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.n_layers

    @property
    def has_embedding(self) -> bool:
        return self.first or (self.last and self.tied)

    def state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of a whole state dict, its layers renumbered from 0 as its model holds them."""
        out = {}
        for name, value in state.items():
            if m := _LAYER.match(name):
                layer = int(m.group(1))
                if self.start <= layer < self.end:
                    out[f"layers.{layer - self.start}.{name[m.end() :]}"] = value
            elif name.startswith("tok_embeddings."):
                if self.has_embedding:
                    out[name] = value
            elif not name.startswith(("norm.", "output.")) or self.last:
                out[name] = value  # names of no stage stay, for the loader to report as unexpected
        return out


class Pipe:
    """A rank's links to the same tensor-parallel rank of the stages before and after its own.

    Invariant: a sent tensor is kept until the next send has waited for it (the send is asynchronous)."""

    def __init__(self, rank: int, tp_size: int) -> None:
        self.prev, self.next = rank - tp_size, rank + tp_size
        self.sending: tuple[dist.Work, Tensor] | None = None

    def recv(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        hidden = torch.empty(rows, dim, dtype=dtype, device=device)
        dist.recv(hidden, src=self.prev)
        return hidden

    def send(self, hidden: Tensor) -> None:
        if self.sending is not None:
            self.sending[0].wait()
        hidden = hidden.clone()  # a CUDA graph's output is overwritten by its next replay, sent or not
        self.sending = (dist.isend(hidden, dst=self.next), hidden)
