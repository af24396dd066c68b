"""Weight-only quantized linears: a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks, or int8 / int4 made at load.

Every format is one form, `w = scale * q + min` with an unsigned field `q` of 4 or 8 bits and one
scale and min per group of a row (Q4_0: min = -8 scale; Q8_0 and int8: min = -128 scale), so one
kernel serves them all and the de-quantized values are exactly the format's own.

Packed layout (`PackedWeight`): rows in tiles of `TILE`, the tile's rows side by side innermost, so
a product with one or a few rows is a reduction Inductor vectorises across the tile's rows with
whole-vector loads. 4-bit fields of a row lie in int32 words in order (field `k` of a row: word
k // per_word, bits (k % per_word) * bits); 8-bit fields are signed bytes (q - 128), [tiles, K, TILE],
which one vector load widens straight to floats, so a symmetric 8-bit format has no min term at all.
Where Inductor writes AVX2 kernels, torch's vector headers load a count of integers through a copy in
memory (a stalled store-to-load forward each) but floats with a masked load: there every format lies
in words, 8-bit fields four to a word as they come (q), held as float32 bits and bit-cast in the
kernels (`FLOAT_WORDS`).
Scales and mins are float32 in the same tiling: half-precision ones ran slower. More rows (prefill,
larger decode batches) go through a copy of the weight where one was made (the int8 GEMM's,
compiled/w8a8.py; a float one, `QuantLinear.copy_dense` and `pack`), else de-quantize the weight slice by
slice for the matmul.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from compiled.models.linear import Linear, PackedProduct, cpu_matmul_dtype, packable
from compiled.plan import MatmulPlan, force_stride_order

TILE = 16  # rows per tile: one AVX-512 vector of float32, two AVX2 ones (eight ran much slower on AVX-512)
# Several rows de-quantize this many weight rows at a time: a slice stays in cache for its matmul, and
# the kernel's loads stay within few pages (the LM head whole ran several times slower a weight).
CHUNK_ROWS = 2048
# ATen's vector ISA, which Inductor follows unless its own build test of that ISA fails (then slower, not
# wrong); CUDA's kernels bit-cast as cheaply either way.
FLOAT_WORDS = torch.backends.cpu.get_cpu_capability() == "AVX2"
INT4_GROUP = 32
INT8_GROUP = 64  # one scale per output channel cost measurable perplexity, groups of 64 none
# Inductor would store the sum over a word's fields to memory and read it back (it realises a node
# that reads many inputs); the fused reduction reads each weight word once.
INDUCTOR_OPTIONS = {"realize_acc_reads_threshold": 64, "realize_opcount_threshold": 1000}


@dataclass
class Quantized:
    """A weight as unsigned fields [N, K] (uint8) with a scale and min per group of `group` columns."""

    q: Tensor
    scale: Tensor  # [N, K / group] float32
    min: Tensor
    bits: int
    kind: str  # what it came from, for the log: Q4_1, Q8_0, int8, ...

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def stored(self) -> tuple[Tensor, Tensor]:
        """Fields and mins as signed bytes hold them: 8-bit fields signed (q - 128) as in Q8_0, mins shifted
        to match (4-bit ones as they are)."""
        if self.bits != 8:
            return self.q, self.min
        return (self.q.to(torch.int16) - 128).to(torch.int8), self.min + 128 * self.scale

    def dequantize(self) -> Tensor:
        """The values as the packed kernels compute them."""
        (q, mn), g = self.stored(), self.group
        return q.float() * self.scale.repeat_interleave(g, 1) + mn.repeat_interleave(g, 1)

    def rows(self, index: Tensor) -> Quantized:
        return Quantized(self.q[index], self.scale[index], self.min[index], self.bits, self.kind)

    @staticmethod
    def cat(parts: list[Quantized]) -> Quantized | None:
        """Rows of several weights stacked; None when their formats differ."""
        first = parts[0]
        if any(p.bits != first.bits or p.group != first.group for p in parts):
            return None
        q, scale, mn = (torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "min"))
        return Quantized(q, scale, mn, first.bits, first.kind)


# ---- from GGUF blocks ----------------------------------------------------------------------------

GGUF_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per block of 32 weights


def from_gguf(kind: str, data: np.ndarray, rows: int, cols: int) -> Quantized:
    """A GGUF tensor's blocks ([rows, bytes per row] uint8) as fields, scales and mins, exactly."""
    blocks = np.ascontiguousarray(data).reshape(rows, cols // 32, GGUF_BLOCK[kind])

    def half(at: int) -> Tensor:  # the float16 at byte `at` of every block, as float32
        return torch.from_numpy(blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32))

    d = half(0)
    if kind == "Q8_0":
        q = torch.from_numpy((blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
        return Quantized(q.reshape(rows, cols), d, -128 * d, 8, kind)
    start = 4 if kind == "Q4_1" else 2
    packed = torch.from_numpy(blocks[..., start:].copy())  # byte j: element j (low), j + 16 (high)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(rows, cols)
    return Quantized(q, d, half(2) if kind == "Q4_1" else -8 * d, 4, kind)


# ---- from float weights ----------------------------------------------------------------------------


def quantize(w: Tensor, method: str) -> Quantized:
    """Round to nearest: int8 in groups of INT8_GROUP columns, symmetric about zero (as Q8_0), so the
    kernels compute the min rather than read it; int4 in groups of INT4_GROUP, between each group's min
    and max, since 15 steps over a group's whole range would cost 4-bit weights too much."""
    w = w.detach().float()
    n, k = w.shape
    bits, group = (8, INT8_GROUP) if method == "int8" else (4, INT4_GROUP)
    group = group if k % group == 0 else k
    top = (1 << bits) - 1
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    if bits == 8:  # fields 1..255 about 128, and a min of exactly -128 scales
        scale = (torch.maximum(hi, -lo) / 127).clamp_min(1e-12)
        lo = -128 * scale
    else:
        scale = ((hi - lo) / top).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, top).to(torch.uint8)
    return Quantized(q.view(n, k), scale, lo, bits, method)


def quantizable(method: str, w: Tensor) -> bool:
    """Whether `quantize(w, method)` packs: whole tiles of rows, whole words (and int4 groups) of columns."""
    columns = 4 if method == "int8" else INT4_GROUP
    return w.dim() == 2 and w.shape[0] % TILE == 0 and w.shape[1] % columns == 0


# ---- packed for compute ----------------------------------------------------------------------------


class PackedWeight(nn.Module):
    """`Quantized` in the tiled layout; shared by a tied embedding and LM head."""

    def __init__(self, w: Quantized) -> None:
        super().__init__()
        n, k = w.q.shape
        if n % TILE or (k * w.bits) % 32 or w.group % (32 // w.bits):
            raise ValueError(f"cannot pack a {n}x{k} {w.kind} weight (groups of {w.group})")
        self.bits, self.group, self.kind = w.bits, w.group, w.kind
        self.out_features, self.in_features = n, k
        # Parameters, not buffers: Dynamo keeps parameters' shapes static in the dynamic layer graphs,
        # so the kernels are specialised to each weight's sizes.
        if w.bits == 8 and not FLOAT_WORDS:
            # Bytes: masking and shifting fields out of words made the one-row product compute-bound.
            stored, mn = w.stored()
            self.words = nn.Parameter(_tile(stored), requires_grad=False)
        else:
            per_word, mn = 32 // w.bits, w.min
            fields = w.q.to(torch.int32).view(n, k // per_word, per_word)
            words = fields[..., 0].clone()
            for i in range(1, per_word):
                words |= fields[..., i] << (w.bits * i)  # the top field wraps into the sign bit, as meant
            # int32 itself elsewhere: Inductor's AVX-512 code bit-casts a float32 vector lane by lane.
            words = _tile(words).view(torch.float32) if FLOAT_WORDS else _tile(words)
            self.words = nn.Parameter(words, requires_grad=False)
        self.scale = nn.Parameter(_tile(w.scale.float()), requires_grad=False)
        # Symmetric formats (Q8_0, int8, Q4_0) have no min to read: the kernels compute it (Q4_0: -8
        # scales, 8-bit in words -128) or drop it (signed bytes), a ninth of a Q8_0 weight's bytes.
        symmetric = torch.equal(mn, w.scale * offset(w.bits, self.words))
        self.min = None if symmetric else nn.Parameter(_tile(mn.float()), requires_grad=False)

    def tiles(self, start: int = 0, stop: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Tiles start:stop as `dequantize_kn` and `slice_product` take them: words, scales, mins."""
        mn = None if self.min is None else self.min[start:stop]
        return self.words[start:stop], self.scale[start:stop], mn

    def dequantize(self) -> Tensor:
        """The whole weight de-quantized, [N, K] float32: where a copy in another form is made."""
        return self.rows(torch.arange(self.out_features, device=self.scale.device))

    def rows(self, index: Tensor) -> Tensor:
        """De-quantized rows [len(index), K] float32: an embedding lookup."""
        t, lane = index // TILE, index % TILE
        scale = self.scale[t, :, lane]
        mn = None if self.min is None else self.min[t, :, lane, None]
        if self.words.dtype == torch.int8:
            fields = self.words[t, :, lane].view(*scale.shape, self.group)
        else:  # few eager ops: a decode step embeds its tokens outside the compiled graphs
            words = _ints(self.words)[t, :, lane]
            shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=index.device)
            fields = ((words[..., None] >> shifts) & ((1 << self.bits) - 1)).view(*scale.shape, self.group)
        return _values(fields, scale[..., None], mn, offset(self.bits, self.words)).flatten(1)

    def matvec(self, x: Tensor) -> Tensor:
        """A few rows [M, K] -> [M, N] float32. Fields in words: each word's fields are masked in place and
        their inputs scaled by the matching power of two (exact), then sum(scale * sum_fields + min * sum_x)
        (8-bit ones unsigned about a min of -128 scales: their float32 sums cancel more than signed bytes'
        would, still far below the fields' own rounding); signed bytes: `_matvec_bytes`. Rows lie inside tiles
        ([T, M, TILE]), so a tile's fields are read once from memory for all rows."""
        if self.words.dtype == torch.int8:
            return self._matvec_bytes(x)
        per_word, bits = 32 // self.bits, self.bits
        mask = (1 << bits) - 1
        m = x.shape[0]
        xf = x.float().view(m, -1, per_word)  # [M, W, per_word]
        x_sum = xf.sum(-1)
        shift = torch.tensor([2.0 ** (-bits * i) for i in range(per_word - 1)] + [1.0], device=x.device)
        xs = force_stride_order(xf * shift, (xf.shape[1] * per_word, per_word, 1))
        w = _ints(self.words)
        inner = None
        for i in range(per_word):
            # The top field shifted down: masked in place it would turn the int32 negative.
            field = (w >> (bits * i)) & mask if i == per_word - 1 else w & (mask << (bits * i))
            term = xs[None, :, :, i, None] * field.float()[:, None]  # [T, M, W, TILE]
            inner = term if inner is None else inner + term
        rep = self.group // per_word
        scale = _per_word(self.scale, rep)[:, None]
        mn = _min(scale, None if self.min is None else _per_word(self.min, rep)[:, None], offset(bits, w))
        y = (scale * inner + mn * x_sum[None, :, :, None]).sum(2)
        return y.permute(1, 0, 2).reshape(m, -1)

    def _matvec_bytes(self, x: Tensor) -> Tensor:
        """`matvec` on signed bytes: per group of a row, scale * sum(fields * x) (+ min * sum(x) if any)."""
        m, (tiles, _, lanes), groups = x.shape[0], self.words.shape, self.scale.shape[1]
        xf = force_stride_order(x.float(), x.stride()).view(1, m, groups, self.group, 1)
        fields = self.words.float().view(tiles, 1, groups, self.group, lanes)
        y = self.scale[:, None] * (fields * xf).sum(3)  # [T, M, groups, TILE]
        if self.min is not None:
            y = y + self.min[:, None] * xf.view(m, groups, self.group).sum(-1)[None, :, :, None]
        y = y.sum(2)
        return y.permute(1, 0, 2).reshape(m, -1)


def dequantize_kn(
    words: Tensor, scale: Tensor, mn: Tensor | None, bits: int, group: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Packed tiles de-quantized and transposed, [K, rows]. The kernel loops over (column, tile, lane),
    so every load and store is a whole tile row; indexed by flat (column, row) instead, Inductor
    gathered lane by lane, far slower."""
    tiles, count, lanes = words.shape
    per_word, mask = 32 // bits, (1 << bits) - 1

    def spread(t: Tensor, rep: int) -> Tensor:  # [T, C, TILE] -> [C * rep, T, TILE]: each C rep times
        c = t.shape[1]
        return t.permute(1, 0, 2)[:, None].expand(c, rep, tiles, lanes).reshape(c * rep, tiles, lanes)

    if words.dtype == torch.int8:
        fields = words.permute(1, 0, 2)
    else:
        shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
        fields = (spread(_ints(words), per_word) >> shifts.repeat(count)[:, None, None]) & mask
    mins = None if mn is None else spread(mn, group)
    w = _values(fields, spread(scale, group), mins, offset(bits, words))
    return w.to(dtype).reshape(-1, tiles * lanes)


def slice_product(
    x: Tensor, words: Tensor, scale: Tensor, mn: Tensor | None, bits: int, group: int
) -> Tensor:
    """x @ a slice of packed tiles, de-quantized in x's dtype: [M, K] -> [M, rows of the slice]."""
    return x @ dequantize_kn(words, scale, mn, bits, group, x.dtype)


def offset(bits: int, words: Tensor) -> float:
    """A symmetric format's min in scales of its stored fields: 0 for signed bytes, else that of unsigned
    fields in words (-8 for 4 bits, -128 for 8)."""
    return 0.0 if words.dtype == torch.int8 else float(-(1 << (bits - 1)))


def _values(fields: Tensor, scale: Tensor, mn: Tensor | None, off: float) -> Tensor:
    """Fields de-quantized, exactly the format's own: q * scale + min where the min is stored, else
    (q + off) * scale, as GGUF computes (q - 8) * d, one rounding."""
    return fields.float() * scale + mn if mn is not None else (fields.float() + off) * scale


def _min(scale: Tensor, mn: Tensor | None, off: float) -> Tensor | None:
    """The min term to add, computed (`off` scales) where the format stores none; None where it is zero."""
    if mn is not None or off == 0:
        return mn
    return scale * off


def _ints(words: Tensor) -> Tensor:
    """Packed words as int32, bit-cast where held as float32 bits (`FLOAT_WORDS`)."""
    return words.view(torch.int32) if words.dtype == torch.float32 else words


def _tile(t: Tensor) -> Tensor:
    n, c = t.shape
    return t.view(n // TILE, TILE, c).transpose(1, 2).contiguous()


def _per_word(t: Tensor, rep: int) -> Tensor:
    """Per-group [T, G, TILE] values repeated for each of a group's `rep` words: [T, G * rep, TILE]."""
    tiles, groups, lanes = t.shape
    return t[:, :, None, :].expand(tiles, groups, rep, lanes).reshape(tiles, groups * rep, lanes)


class QuantLinear(nn.Module):
    """A linear layer whose weight is packed: one row, or a few (the plan's `matvec`), through the fused
    reduction; more rows through `gemm`, a copy of the weight where one was made (a layer's for an int8
    GEMM, compiled/w8a8.py: Int8Gemm, or else in float, `copy_dense`; the LM head's in float, `pack`),
    else de-quantized for the matmul, CHUNK_ROWS weight rows at a time.

    Inside a compiled layer the slices' products unroll into the layer's graph. The LM head has many more
    slices (24 for SmolLM2's vocabulary): the compile policy passes it `kernels` with one graph called
    slice by slice, since unrolled they were slow to compile."""

    def __init__(self, packed: PackedWeight, bias: Tensor | None) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.gemm: nn.Module | None = None

    def forward(self, x: Tensor, how: MatmulPlan, kernels: QuantKernels | None = None) -> Tensor:
        kernels = kernels or EAGER_KERNELS
        if how.matvec:
            return kernels.matvec(self, x)
        if isinstance(self.gemm, Linear):
            return self.gemm(x, how)
        if self.gemm is not None:
            y = self.gemm(x)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        dtype, p, step = x.dtype, self.packed, CHUNK_ROWS // TILE
        x = x.float() if how.upcast else x
        slices = [p.tiles(t, t + step) for t in range(0, p.words.shape[0], step)]
        y = torch.cat([kernels.slice_product(x, *w, p.bits, p.group) for w in slices], -1)
        return (y if self.bias is None else y + self.bias.to(y.dtype)).to(dtype)

    def add_to(self, h: Tensor, x: Tensor, how: MatmulPlan) -> Tensor:
        if isinstance(self.gemm, Linear) and not how.matvec:
            return self.gemm.add_to(h, x, how)
        return h + self(x, how)

    def copy_dense(self, dtype: torch.dtype) -> None:
        """Several rows of `dtype` run as a float model's layer runs them, on a `Linear` holding the weight
        as de-quantized (and the bias), packed as its own weights are: for a layer without an int8 GEMM's
        copy, whose slices de-quantized anew each step ran at half the float product's rate."""
        weight = self.packed.dequantize()
        with torch.device("meta"):
            copy = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        copy.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if self.bias is not None:
            copy.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        copy.pack()
        self.gemm = copy

    def pack(self, dtype: torch.dtype) -> None:
        """Several rows of `dtype` multiply a copy of the weight as de-quantized, packed for oneDNN in the
        dtype their product runs in, where it packs: for the LM head, whose slices de-quantized anew each
        step cost more than its product."""
        dtype, device = cpu_matmul_dtype(dtype), self.packed.scale.device
        if packable(device, dtype):
            self.gemm = PackedProduct(self.packed.dequantize().to(dtype))

    def reduce(self, x: Tensor) -> Tensor:
        """One row or a few through the fused reduction."""
        y = self.packed.matvec(x).to(x.dtype)
        return y if self.bias is None else y + self.bias


class QuantKernels(NamedTuple):
    """How a QuantLinear computes: its one- and few-row reduction, and the product of one slice."""

    matvec: Callable[[QuantLinear, Tensor], Tensor] = QuantLinear.reduce
    slice_product: Callable[..., Tensor] = slice_product


EAGER_KERNELS = QuantKernels()


class QuantEmbedding(nn.Module):
    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed, self.dtype = packed, dtype

    def forward(self, ids: Tensor) -> Tensor:
        return self.packed.rows(ids).to(self.dtype)


def describe(modules: list[nn.Module]) -> str:
    """'Q4_1 x120, Q8_0 x1' for the log line at start."""
    kinds = Counter(m.kind for m in modules if isinstance(m, PackedWeight))
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
