"""The matmuls of the models' layers, and the paths a CPU runs them on: a matrix-vector reduction for one
row or a few, oneDNN on weights packed once, float32 where the CPU lacks bfloat16 arithmetic."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor import inductor_prims


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
      left operand, (W @ xᵀ)ᵀ. Prefill takes a bfloat16 packed copy too (`PACKED_PREFILL_DTYPES`).
      `add_to` adds the product to the residual stream inside oneDNN's product, rounding the sum once.
    - Half-precision weights on a CPU without bfloat16 arithmetic: the matmul runs in float32 (products
      of bfloat16 values are exact there), since BLAS emulates bfloat16 several times slower.
    """

    row_blocks = 0
    few_rows = False
    packed_rows = True  # False while the policy traces a step whose rows run on the weight as stored

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("prepacked", None, persistent=False)  # see pack

    def forward(self, x: Tensor, weight_left: bool = False) -> Tensor:
        if self._reduces(x):
            return self.matvec(x)
        if (w := self._packed_for(x, weight_left)) is not None:
            b = None if self.bias is None else self.bias.to(w.dtype)
            return torch.ops.kiln.packed_linear(x.to(w.dtype), w, b).to(x.dtype)
        w, b, dtype = self.weight, self.bias, x.dtype
        if x.device.type == "cpu" and cpu_matmul_dtype(dtype) != dtype:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
        if weight_left and x.device.type == "cpu":  # an MKL finding; cuBLAS is not measured
            y = (w @ x.T).T
            return (y if b is None else y + b).to(dtype)
        return F.linear(x, w, b).to(dtype)

    def add_to(self, h: Tensor, x: Tensor, weight_left: bool = False) -> Tensor:
        """h + self(x, weight_left). On a packed copy the add is a post-op of oneDNN's product: the sum
        rounded once, as Inductor's `addmm` rounds it where the matmul runs unpacked, and 5-9 % sooner
        than that `addmm` (BENCHMARKS.md)."""
        if self._reduces(x) or (w := self._packed_for(x, weight_left)) is None:
            return h + self(x, weight_left)
        b = None if self.bias is None else self.bias.to(w.dtype)
        return torch.ops.kiln.packed_linear_add(x.to(w.dtype), w, b, h.to(w.dtype)).to(h.dtype)

    def _reduces(self, x: Tensor) -> bool:
        """These rows run as the compiled matrix-vector reduction (`matvec`)."""
        return bool(self.row_blocks) and (x.shape[0] == 1 or self.few_rows)

    def _packed_for(self, x: Tensor, weight_left: bool) -> Tensor | None:
        """The packed copy these rows run on, if they take one."""
        w = self.prepacked
        if w is None or not self.packed_rows or not (weight_left or w.dtype in PACKED_PREFILL_DTYPES):
            return None
        return w

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
_lib.define("packed_linear_add(Tensor x, Tensor packed, Tensor? bias, Tensor residual) -> Tensor")


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_add(x: Tensor, packed: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), packed, bias, "add")


def _packed_shape(x: Tensor, packed: Tensor, *bias_and_residual: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


for _name, _impl in (("packed_linear", _packed_linear), ("packed_linear_add", _packed_linear_add)):
    for _key in ("CPU", "MkldnnCPU"):  # a packed bfloat16 weight is an oneDNN tensor
        _lib.impl(_name, _impl, _key)
    torch.library.register_fake(f"kiln::{_name}")(_packed_shape)
