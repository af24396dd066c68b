"""The matmuls of the models' layers, and the paths a CPU runs them on: a matrix-vector reduction for one
row or a few, oneDNN on weights packed once, float32 where the CPU lacks bfloat16 arithmetic."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiled.plan import MatmulPlan, force_stride_order

# oneDNN's ISAs without bfloat16 dot products: capped at one (ONEDNN_MAX_CPU_ISA), it emulates bfloat16.
NO_BF16_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_flags() -> str:
    """/proc/cpuinfo, empty where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def onednn_cap() -> str:
    """The highest ISA oneDNN may use, as ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) names it, else ALL."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def cpu_has_fast_bf16(flags: str, cap: str) -> bool:
    """Whether the CPU's flags name bfloat16 arithmetic (AMX, AVX-512-BF16) that oneDNN capped at `cap`
    may use."""
    return bool(re.search(r"\b(amx_bf16|avx512_bf16)\b", flags)) and cap.upper() not in NO_BF16_ISAS


# Blocks of its rows a weight is reduced in by one-row products, side by side, an accumulator each
# (measured on CPUs; CUDA takes the same, unmeasured).
ROW_BLOCKS = 4
# AMX or AVX-512-BF16: this CPU computes bfloat16 natively. A constant, so that traced code reads a bool.
CPU_HAS_FAST_BF16 = cpu_has_fast_bf16(cpu_flags(), onednn_cap())


def cpu_matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU matmul of `dtype` operands runs in: float32 without bfloat16 arithmetic."""
    return dtype if dtype == torch.float32 or CPU_HAS_FAST_BF16 else torch.float32


class Linear(nn.Linear):
    """nn.Linear whose rows take the path the step's plan names (`MatmulPlan`, compiled/plan.py).

    - `matvec`: one row, or each row of a decode step of a few, is a matrix-vector reduction, pure weight
      streaming that Inductor vectorises faster than BLAS, the weight's rows reduced in `ROW_BLOCKS`
      blocks side by side so that each thread streams several places of the weight at once. The input is
      materialised once in float32 first: left to fuse, Inductor would recompute the RMSNorm for every
      weight row.
    - `packed`: through oneDNN on a copy of the weight packed for it (`prepacked`, made once by `pack`).
      `add_to` adds the product to the residual stream inside oneDNN's product, rounding the sum once.
    - `weight_left`: unpacked, MKL's sgemm is much faster with the weight as its left operand, (W @ xᵀ)ᵀ.
    - `upcast`: half-precision weights on a CPU without bfloat16 arithmetic multiply in float32 (products
      of bfloat16 values are exact there), since BLAS emulates bfloat16 several times slower.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("prepacked", None, persistent=False)  # see pack

    def reset_parameters(self) -> None:
        """Nothing to draw: the weights come from the checkpoint (and drawn on the meta device, where the
        model is built, they would import Dynamo)."""

    def forward(self, x: Tensor, how: MatmulPlan) -> Tensor:
        if how.matvec:
            return self.matvec(x)
        if how.packed and (w := self.prepacked) is not None:
            b = None if self.bias is None else self.bias.to(w.dtype)
            return torch.ops.kiln.packed_linear(x.to(w.dtype), w, b).to(x.dtype)
        w, b, dtype = self.weight, self.bias, x.dtype
        if how.upcast:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
        if how.weight_left:
            y = (w @ x.T).T
            return (y if b is None else y + b).to(dtype)
        return F.linear(x, w, b).to(dtype)

    def add_to(self, h: Tensor, x: Tensor, how: MatmulPlan) -> Tensor:
        """h + self(x, how). On a packed copy the add is a post-op of oneDNN's product: the sum rounded
        once, as Inductor's `addmm` rounds it where the matmul runs unpacked, and sooner than that `addmm`."""
        if how.matvec or not how.packed or (w := self.prepacked) is None:
            return h + self(x, how)
        b = None if self.bias is None else self.bias.to(w.dtype)
        return torch.ops.kiln.packed_linear_add(x.to(w.dtype), w, b, h.to(w.dtype)).to(h.dtype)

    def matvec(self, x: Tensor) -> Tensor:
        """Rows [M, K] -> [M, N] as `ROW_BLOCKS` reductions over blocks of the weight's rows."""
        w, b, dtype = self.weight, self.bias, x.dtype
        x = force_stride_order(x.float(), x.stride())
        n = -(-w.shape[0] // ROW_BLOCKS)
        y = torch.cat(
            [(x[:, None, :] * w[None, i : i + n].float()).sum(-1) for i in range(0, w.shape[0], n)], -1
        )
        y = y.to(dtype)
        return y if b is None else y + b

    def pack(self) -> None:
        """On CPU, matmuls of several rows run through oneDNN on a copy of the weight packed once for it,
        in the dtype the matmul runs in (float32 on CPUs without bfloat16 arithmetic): faster than the
        unpacked matmul, for a second copy of the weight. One row keeps the compiled reduction over the
        original."""
        w = self.weight
        dtype = cpu_matmul_dtype(w.dtype)
        if packable(w.device, dtype):
            self.prepacked = onednn_packed(w.detach().to(dtype))


class PackedProduct(nn.Module):
    """Rows [M, K] -> x @ Wᵀ [M, N] in W's dtype, through oneDNN on W packed once: the float product of a
    weight kept in another form (a quantized LM head's, compiled/quant.py)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("prepacked", onednn_packed(weight), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.kiln.packed_linear(x.to(self.prepacked.dtype), self.prepacked, None)


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_packed(weight: Tensor) -> Tensor:
    # The row-count hint hardly matters: packed for 8, 32 or 64 rows, every count ran alike.
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights on `device` for products in `dtype`."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES


# Prefill's row counts change step by step, where decode's are bucketed. In bfloat16 oneDNN's packed product
# costs no more memory over many row counts than F.linear does, gives the same bits and runs sooner; in
# float32 it grew a process several times more than F.linear did.
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
