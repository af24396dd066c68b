"""A step's plan: how each part of one step computes, decided by the compile policy from the step's shape
(compiled/compile_policy.py) and passed into the model's forward as an argument.

A plan's fields are Python constants to the compiler: a layer is traced once per distinct plan and
specialised on it, so each kind of step has graphs of its own, while no module attribute changes from
one step to the next. Fields are bools and strings only: Dynamo would trace an int as a dynamic size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class MatmulPlan:
    """How a linear layer multiplies a step's rows by its weight."""

    matvec: bool = False  # a compiled matrix-vector reduction per row: one row, or a few
    packed: bool = False  # through oneDNN on the weight's packed copy, where the layer has one
    weight_left: bool = False  # on the weight as stored, as (W @ xᵀ)ᵀ: MKL's faster form for decode rows
    upcast: bool = False  # half-precision operands multiplied in float32: the CPU lacks bfloat16 arithmetic


@dataclass(frozen=True)
class StepPlan:
    """How one step runs its layers."""

    kind: str  # decode steps by their rows, "one", "few" or "more"; "prefill": with multi-token chunks
    linear: MatmulPlan  # every linear layer of the blocks
    decode_attention: str  # single-query rows: "reduction" (for Inductor to fuse) or "matmul" (eager)

    @property
    def decode(self) -> bool:
        return self.kind != "prefill"


def call_module(module: nn.Module, *args: object) -> object:
    return module(*args)


class PartCalls(NamedTuple):
    """What runs a model's parts in a step, each called with the part's module first: the compile policy's
    compiled calls, or each module's own call."""

    embed: Callable = call_module
    block: Callable = call_module
    norm: Callable = call_module


OWN_CALLS = PartCalls()


def force_stride_order(x: Tensor, stride: Sequence[int]) -> Tensor:
    """`x` laid out with `stride`, copied only where it is not: compiled, through Inductor's own prim, whose
    layout its passes keep; eager, without importing Inductor, seconds an eager process need not spend."""
    if torch.compiler.is_compiling():
        from torch._inductor import inductor_prims

        return inductor_prims.force_stride_order(x, stride)
    if x.stride() == tuple(stride):
        return x
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)
