"""W8A8 linears: int8 weights made at load (symmetric, one scale per output channel) times activations
quantized to int8 per token as each step runs, through oneDNN's int8 GEMM on weights prepacked once
(`onednn.qlinear_pointwise`, what PT2E's x86 quantization lowers to). CPUs multiply int8 at twice their
bfloat16 rate or more: AVX-512 VNNI's and AVX-VNNI's `vpdpbusd`, AMX's int8 tiles.

- Activations go in as uint8 about a zero point of 128: oneDNN's fast kernels are u8 x s8, and signed
  activations fell to a reference kernel hundreds of times slower.
- Without VNNI the products go through `vpmaddubsw`, which adds pairs of u8 x s8 products in int16 and
  saturates, so weights there keep 7 bits (|q| <= 63): 2 * 255 * 63 fits, and every path computes the
  exact product of its quantized operands.
- The GEMM's output, in the step's dtype, is scaled per channel inside it and per token after it; the
  activations' quantization is traced into the layer's graph, where Inductor fuses it with the op
  before it (RMSNorm, SiLU x up). The GEMM is an op of kiln's: Inductor's own lowering of oneDNN's
  takes the weight for a constant, and kiln's layer graphs take weights as inputs.
- One row, or a few, take the weight-only reduction of compiled/quant.py over a tiled copy of the same
  int8 values: such a step costs reading the weight, which the GEMM reads no faster.
- int8, int4 and GGUF weights (compiled/quant.py) get an `Int8Gemm` copy for steps of several rows in
  their layers (compiled/loader.py: INT8_GEMMS): made from the float weight (int8, int4) or the blocks.
- Per-token activations lose most where a few channels carry outliers (the input of the MLP's down
  projection above all). SmoothQuant's migration moves part of each input channel's range into the
  weight's column (x / s times W * s), with s from each channel's largest input over the shipped
  calibration chats (calibration.json), run once at load.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from compiled.attention import AttentionMetadata
from compiled.attention_cpu import fresh_prompt_pages
from compiled.models.linear import Linear, cpu_flags, onednn_cap
from compiled.plan import MatmulPlan, StepPlan, force_stride_order
from compiled.quant import PackedWeight, Quantized, QuantLinear, quantizable
from engine.model_files import kept

logger = logging.getLogger("kiln.loader")

ZERO_POINT = 128  # of the uint8 activations: signed values -127..127 shifted
# SmoothQuant's migration strength: the share of an input channel's range moved into the weight.
SMOOTHING = 0.6
CALIBRATION = Path(__file__).with_name("calibration.json")
# oneDNN's x86 int8 ISAs, weakest first, as ONEDNN_MAX_CPU_ISA names them, with the CPU flag of each.
ISAS = (
    ("AVX2", "avx2"),
    ("AVX2_VNNI", "avx_vnni"),
    ("AVX512_CORE", "avx512bw"),
    ("AVX512_CORE_VNNI", "avx512_vnni"),
    ("AVX512_CORE_AMX", "amx_int8"),
)


def int8_isa(flags: str | None = None, cap: str | None = None) -> str | None:
    """The ISA oneDNN's int8 GEMM runs on here: the best the CPU's flags name, at most the one
    ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) allows; None without AVX2 or off x86."""
    flags = cpu_flags() if flags is None else flags
    cap = onednn_cap() if cap is None else cap
    names = [name for name, _ in ISAS]
    found = [name for name, flag in ISAS if re.search(rf"\b{flag}\b", flags)]
    if not found:
        return None
    best = found[-1]
    cap = cap.upper()
    if cap in names and names.index(cap) < names.index(best):
        return cap
    return best


def weight_max(isa: str | None) -> int:
    """The largest |q| of a weight field: 127 where products accumulate in 32 bits (VNNI, AMX), 63 where
    `vpmaddubsw`'s 16-bit pair sums would saturate on 8-bit weights."""
    return 127 if isa is not None and ("VNNI" in isa or "AMX" in isa) else 63


INT8_ISA = int8_isa()


def quantize_weight(w: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """Round to nearest, symmetric per output channel: fields int8 [N, K] in -top..top, scales [N] float32."""
    w = w.detach().float()
    scale = (w.abs().amax(-1) / top).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-top, top).to(torch.int8), scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, symmetric: uint8 fields [M, K] about ZERO_POINT, and each row's scale [M, 1] float32.
    An all-zero row (padding) gets fields of zero, not a division by zero. The fields are computed from
    the row maxima themselves, not from the scales: Inductor then quantizes each row in the loop that
    found its maximum, while the row is in cache."""
    xf = x.float()
    top = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return (torch.round(xf * (127 / top)) + ZERO_POINT).to(torch.uint8), top / 127


def smoothing(input_max: Tensor, weight: Tensor, alpha: float = SMOOTHING) -> Tensor:
    """SmoothQuant's factor per input channel, s = max|x|^alpha / max|w|^(1 - alpha): [K] float32."""
    w_max = weight.detach().float().abs().amax(0).clamp_min(1e-5)
    return (input_max.float().clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)


def smoothed_fields(weight: Tensor, smooth: Tensor | None, isa: str | None) -> tuple[Tensor, Tensor, Tensor]:
    """W * s quantized per output channel for `isa`: fields, scales, and s (ones if `smooth` is None)."""
    smooth = torch.ones(weight.shape[1]) if smooth is None else smooth.float()
    return *quantize_weight(weight.detach().float() * smooth, weight_max(isa)), smooth


class Int8Gemm(nn.Module):
    """oneDNN's int8 GEMM on a weight W quantized once per output channel as W * s (`smooth` s per input
    channel, ones if none): rows x / s quantized per token as they come, the product scaled per channel
    inside the GEMM and per token after it."""

    def __init__(self, q: Tensor, scale: Tensor, smooth: Tensor) -> None:
        super().__init__()
        self.register_buffer("prepacked", torch.ops.onednn.qlinear_prepack(q, None), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero_points", torch.zeros(len(scale), dtype=torch.int64), persistent=False)
        self.register_buffer("inverse", 1 / smooth, persistent=False)

    @classmethod
    def of(cls, weight: Tensor, smooth: Tensor | None = None, isa: str | None = INT8_ISA) -> Int8Gemm:
        return cls(*smoothed_fields(weight, smooth, isa))

    def forward(self, x: Tensor) -> Tensor:
        """Rows [M, K] -> [M, N] float32, for the caller to add its bias to before rounding."""
        xs = x.float() * self.inverse
        # Materialised once: fused, the row maxima's pass and the quantizing pass would each recompute the
        # op before (SiLU's exponentials).
        q, scale = quantize_rows(force_stride_order(xs, xs.stride()))
        return torch.ops.kiln.int8_linear(q, self.prepacked, self.scale, self.zero_points, x.dtype) * scale


class Int8Linear(nn.Module):
    """A linear layer on int8 weights: several rows through the int8 GEMM, one or a few (the plan's
    `matvec`) through the weight-only reduction. Invariant: `gemm` and `tiled` hold one quantization
    of one weight, W * s with `smooth` s (ones if none), and both paths multiply it by x / s."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, smooth: Tensor | None = None, isa: str | None = INT8_ISA
    ) -> None:
        super().__init__()
        q, scale, smooth = smoothed_fields(weight, smooth, isa)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        fields = (q.to(torch.int16) + 128).to(torch.uint8)
        self.tiled = PackedWeight(Quantized(fields, scale[:, None], -128 * scale[:, None], 8, "w8a8"))
        self.gemm = Int8Gemm(q, scale, smooth)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor, how: MatmulPlan) -> Tensor:
        if how.matvec:
            y = self.tiled.matvec(x.float() * self.gemm.inverse)
        else:
            y = self.gemm(x)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def add_to(self, h: Tensor, x: Tensor, how: MatmulPlan) -> Tensor:
        return h + self(x, how)

    def dequantized(self) -> Tensor:
        """The weight the layer computes with, W as de-quantized, [N, K] float32."""
        return self.tiled.dequantize() * self.gemm.inverse


def calibration_prompts(model_dir: str) -> list[list[int]]:
    """The shipped calibration chats as the model's tokenizer writes them (its chat template, if any), kept
    by the chats and the name, size and modification time of every file of `model_dir` (`kept`): loading
    a tokenizer through transformers took seconds of every quantized start, and reading its files whole
    (tens of MB for some) would cost part of that again."""

    def resolve() -> list[list[int]]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        chats = json.loads(CALIBRATION.read_text())
        if tokenizer.chat_template:
            texts = [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
        else:
            texts = ["\n\n".join(m["content"] for m in chat) for chat in chats]
        special = not tokenizer.chat_template
        return [tokenizer(text, add_special_tokens=special)["input_ids"] for text in texts]

    files = [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in sorted(Path(model_dir).iterdir())]
    return kept("calibration", CALIBRATION.read_bytes() + json.dumps(files).encode(), resolve)


def input_maxima(model: nn.Module, prompts: list[list[int]], block_size: int = 64) -> dict[str, Tensor]:
    """The largest |input| per channel of every linear layer of the layers (by name) over `prompts`, run
    eagerly as one prefill step in the model's own weights, over a KV cache made for it and dropped after."""
    maxima: dict[str, Tensor] = {}

    def record(name: str, module: nn.Module, args: tuple) -> None:
        x = args[0].detach().float().abs().amax(0)
        maxima[name] = x if name not in maxima else torch.maximum(maxima[name], x)

    hooks = [
        m.register_forward_pre_hook(functools.partial(record, name))
        for name, m in model.layers.named_modules(prefix="layers")
        if type(m) in (Linear, QuantLinear)
    ]
    lens = [len(ids) for ids in prompts] + [0]  # an empty chunk last, as a step of one prompt carries
    tables, slots, chunks = fresh_prompt_pages(lens, block_size)
    dtype = model.norm.weight.dtype
    model.allocate_kv_cache(int(tables.max()) + 1, block_size, dtype)
    model.cache_rope(max(lens), dtype)
    empty = torch.zeros(0, dtype=torch.int64)
    try:
        with torch.no_grad():
            model(
                torch.tensor([t for ids in prompts for t in ids], dtype=torch.int64),
                torch.cat([torch.arange(n) for n in lens]),
                AttentionMetadata(slots, empty.view(0, 1), empty, empty, tables, chunks),
                StepPlan("prefill", MatmulPlan(), "matmul"),
            )
    finally:
        for hook in hooks:
            hook.remove()
        for layer in model.layers:
            layer.attention.k_cache = layer.attention.v_cache = None
    return maxima


def calibrate(model: nn.Module, model_dir: str) -> dict[str, Tensor]:
    """`input_maxima` over the shipped calibration chats; none where the model has no tokenizer to write
    them, and its int8 GEMMs then go unsmoothed."""
    try:
        prompts = [ids for ids in calibration_prompts(model_dir) if ids]
    except Exception as e:  # a missing tokenizer, a broken chat template: the error, not the load, is logged
        logger.warning("%s cannot write the calibration chats (%s): int8 GEMMs unsmoothed", model_dir, e)
        return {}
    if not prompts or max(max(ids) for ids in prompts) >= model.args.vocab_size:
        logger.warning("%s's tokenizer does not fit the model: int8 GEMMs unsmoothed", model_dir)
        return {}
    return input_maxima(model, prompts)


def int8_gemm(weight: Tensor, input_max: Tensor | None) -> Int8Gemm:
    """An Int8Gemm of `weight` ([N, K], float), smoothed by its inputs' maxima where known."""
    return Int8Gemm.of(weight, None if input_max is None else smoothing(input_max, weight))


def add_int8_gemms(model: nn.Module, maxima: dict[str, Tensor]) -> None:
    """Every QuantLinear of the layers given an int8 GEMM's copy of its weight as de-quantized, for several
    rows. The LM head keeps its float product: logits through int8 activations cost measurable perplexity."""
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, QuantLinear):
            module.gemm = int8_gemm(module.packed.dequantize(), maxima.get(name))


def quantize_layers(model: nn.Module, maxima: dict[str, Tensor]) -> None:
    """Every Linear of the layers that packs in tiles replaced by an Int8Linear, smoothed by its inputs'
    `maxima`."""
    bits = weight_max(INT8_ISA).bit_length() + 1
    logger.info("w8a8: oneDNN's int8 GEMM on %s, weights of %d bits", INT8_ISA, bits)
    if bits < 8:
        logger.warning(
            "w8a8 without VNNI: 7-bit weights lose more quality than with VNNI or AMX (BENCHMARKS.md)"
        )
    for name, module in list(model.layers.named_modules(prefix="layers")):
        if type(module) is Linear and quantizable("int8", module.weight):
            smooth = smoothing(maxima[name], module.weight) if name in maxima else None
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Int8Linear(module.weight, module.bias, smooth))


_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(
    "int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor zero_points, ScalarType dtype) -> Tensor"
)


def _int8_linear(x: Tensor, packed: Tensor, scale: Tensor, zero_points: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, ZERO_POINT, packed, scale, zero_points, None, 1.0, 0, dtype, "none", [], ""
    )


for _key in ("CPU", "MkldnnCPU"):  # the prepacked weight is an oneDNN tensor
    _lib.impl("int8_linear", _int8_linear, _key)


@torch.library.register_fake("kiln::int8_linear")
def _int8_linear_shape(
    x: Tensor, packed: Tensor, scale: Tensor, zero_points: Tensor, dtype: torch.dtype
) -> Tensor:
    return x.new_empty(x.shape[0], scale.shape[0], dtype=dtype)
