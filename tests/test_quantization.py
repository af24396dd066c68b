"""Quantized weights: GGUF blocks read exactly, the packed layout's kernels, and whole models against
transformers on the same de-quantized weights."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled import loader, quant
from compiled.compile_policy import FEW_QUANTIZED_ROWS, CompilePolicy
from compiled.gguf import _dequantize, own_blocks
from compiled.loader import _place, resolve_quantization
from compiled.models.linear import Linear
from compiled.plan import MatmulPlan
from compiled.quant import INDUCTOR_OPTIONS, PackedWeight, QuantLinear, dequantize_kn, from_gguf, quantize
from compiled.w8a8 import Int8Gemm
from engine import LLM
from engine.config import EngineConfig
from engine.model_files import default_model_path
from server.bench.driver import RunnerDriver, build_runner, chat_prompts, greedy_mismatches
from tests.test_model_runner import check_packed_step, poison_kv_cache

KINDS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}
KINDS["Q8_0"] = gguf.GGMLQuantizationType.Q8_0


def _kn(packed: PackedWeight, start: int = 0, stop: int | None = None, dtype=torch.float32) -> torch.Tensor:
    return dequantize_kn(*packed.tiles(start, stop), packed.bits, packed.group, dtype)


# Both layouts of the fields, whatever this CPU's (quant.FLOAT_WORDS: every format in words held as
# float32 bits, for AVX2's kernels; else int32 words and signed bytes).
LAYOUTS = pytest.mark.parametrize("float_words", [False, True], ids=["int-fields", "float32-words"])


@LAYOUTS
@pytest.mark.parametrize("kind", list(KINDS))
def test_gguf_blocks_decode_as_gguf_does(kind, float_words, monkeypatch):
    monkeypatch.setattr(quant, "FLOAT_WORDS", float_words)
    rows, cols = 16, 96
    values = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    blocks = gguf.quants.quantize(values, KINDS[kind])
    expected = gguf.quants.dequantize(blocks, KINDS[kind])
    ours = from_gguf(kind, blocks, rows, cols)
    assert torch.equal(ours.dequantize(), torch.from_numpy(expected))
    packed = PackedWeight(ours)
    assert (packed.words.dtype == torch.float32) == float_words
    assert (packed.min is None) == (kind != "Q4_1")  # Q4_0's and Q8_0's mins are computed, not stored
    assert torch.equal(_kn(packed).T, torch.from_numpy(expected))
    assert torch.equal(packed.rows(torch.arange(rows)), torch.from_numpy(expected))
    x = torch.randn(2, cols)
    torch.testing.assert_close(packed.matvec(x), x @ torch.from_numpy(expected).T, rtol=1e-5, atol=1e-5)


def test_an_unreadable_block_type_names_the_tensor():
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight has block type type 99"):
        _dequantize("blk.3.ffn_up.weight", "type 99", 99, np.zeros(64, np.uint8), 32)


@LAYOUTS
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_packed_kernels_compute_the_dequantized_product(method, float_words, monkeypatch):
    monkeypatch.setattr(quant, "FLOAT_WORDS", float_words)
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    q = quantize(w, method)
    dense, packed = q.dequantize(), PackedWeight(q)
    assert (dense - w).abs().max() <= (0.5 if method == "int4" else 0.05) * w.abs().max()
    assert (packed.min is None) == (method == "int8")  # int8 is symmetric: no min to read
    assert torch.equal(_kn(packed).T, dense)
    assert torch.equal(_kn(packed, 1, 3, torch.bfloat16).T, dense[16:48].bfloat16())
    monkeypatch.setattr(quant, "CHUNK_ROWS", 32)  # several rows take the weight in two slices
    rows = torch.randn(3, 128)
    linear = QuantLinear(packed, None)
    product = linear(rows, MatmulPlan())
    torch.testing.assert_close(product, rows @ dense.T, rtol=1e-5, atol=1e-5)
    linear.pack(torch.float32)  # a copy packed for oneDNN holds the weight as de-quantized, exactly
    assert linear.gemm is not None and torch.equal(linear(torch.eye(128), MatmulPlan()), dense.T)
    torch.testing.assert_close(linear(rows, MatmulPlan()), rows @ dense.T, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 7, 8, 47])
    assert torch.equal(packed.rows(ids), dense[ids])
    matvec = torch.compile(packed.matvec, options=INDUCTOR_OPTIONS, dynamic=False)
    for x in (torch.randn(1, 128), torch.randn(5, 128)):  # one row, and a few rows inside the tiles
        for y in (packed.matvec(x), matvec(x)):
            torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-5)


def test_a_weight_whose_rows_do_not_fill_tiles_is_computed_dequantized(caplog):
    model = torch.nn.Module()
    model.proj = Linear(64, 24, bias=False)
    q = quantize(torch.randn(24, 64), "int4")
    _place(model, "proj.weight", q, torch.float32, torch.device("cpu"))
    assert type(model.proj) is Linear and torch.equal(model.proj.weight, q.dequantize())
    assert "proj.weight: 24 rows do not fill tiles of 16" in caplog.text


def test_bad_quantization_is_refused_before_the_engine_starts(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be auto, none, gguf, int8, int4 or w8a8"):
        EngineConfig(quantization="fp3")
    with pytest.raises(ValueError, match=r"quantization gguf needs a \.gguf model file"):
        LLM(model=tiny_llama, quantization="gguf")


def test_a_gguf_model_computes_on_its_own_blocks_unless_a_dtype_is_named(monkeypatch):
    """ "auto" takes the blocks where no step runs slower on them (int8 or float copies for several rows:
    an x86 CPU, one process) and no dtype was named for the weights; explicit choices stay as they are."""
    cpu, blocks = torch.device("cpu"), "/models/m.gguf"
    monkeypatch.setattr(loader, "INT8_ISA", "AVX2")
    monkeypatch.setattr(loader, "own_blocks", lambda path: path == blocks)
    assert resolve_quantization("auto", "auto", blocks, cpu, 1) == "gguf"
    assert resolve_quantization("auto", "bfloat16", blocks, cpu, 1) == "none"
    assert resolve_quantization("auto", "auto", None, cpu, 1) == "none"  # a safetensors directory
    assert resolve_quantization("auto", "auto", blocks, torch.device("cuda"), 1) == "none"
    assert resolve_quantization("auto", "auto", blocks, cpu, 2) == "none"  # ranks make no GEMM copies
    assert resolve_quantization("int4", "float32", None, cpu, 2) == "int4"
    assert resolve_quantization("auto", "auto", "/models/k-quants.gguf", cpu, 1) == "none"
    monkeypatch.setattr(loader, "INT8_ISA", None)  # not x86: the blocks' kernels are unmeasured there
    assert resolve_quantization("auto", "auto", blocks, cpu, 1) == "none"


def test_a_gguf_file_s_own_blocks_are_those_kiln_reads_as_they_are(tmp_path):
    assert own_blocks(default_model_path())  # Q4_1 and Q8_0
    writer = gguf.GGUFWriter(str(tmp_path / "f32.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 64), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    assert not own_blocks(str(tmp_path / "f32.gguf"))  # nothing to compute on but floats


@pytest.mark.slow
def test_the_default_model_loads_its_blocks_with_copies_for_several_rows_by_default():
    """int8 GEMM copies where products sum in 32 bits, float ones (packed as a float model's) elsewhere."""
    runner = build_runner(None, max_num_seqs=1, num_kv_blocks=16, enforce_eager=True)
    assert runner.config.quantization == ("gguf" if loader.INT8_ISA else "none")  # x86 with AVX2
    if not loader.INT8_ISA:
        return
    layers = [m for m in runner.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 120
    copy = Int8Gemm if loader.INT8_GEMMS else Linear
    assert all(isinstance(m.gemm, copy) for m in layers)
    assert all(m.gemm.prepacked is not None for m in layers)
    assert runner.model.output.gemm is not None  # the LM head's float copy


def _dequantized_copy(model_dir: str, method: str, target) -> str:
    """The HF model with every linear replaced by its int8/int4 values; a tied head is untied, as kiln
    keeps the input embedding's values."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = hf.get_output_embeddings()
    if head.weight is hf.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        hf.config.tie_word_embeddings = False
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize(module.weight, method).dequantize())
    hf.save_pretrained(target)
    return str(target)


def test_a_quantized_head_multiplies_several_rows_on_its_float_copy(tiny_model):
    """De-quantized slice by slice each step, the head cost more than its product: from two rows on it
    multiplies a packed copy, one row still reduces over the blocks."""
    runner = build_runner(
        tiny_model, quantization="int4", max_num_seqs=4, num_kv_blocks=16, enforce_eager=True
    )
    head = runner.model.output
    assert isinstance(head, QuantLinear) and head.gemm is not None
    policy = CompilePolicy(runner.model, torch.device("cpu"), enforce_eager=False, dtype=runner.dtype)
    assert policy.few_rows > 1  # the layers' few-row steps still reduce
    assert policy.head_plan(1).matvec and not policy.head_plan(2).matvec
    rows = torch.randn(3, head.in_features, dtype=runner.dtype)
    expected = rows.float() @ head.packed.rows(torch.arange(head.out_features)).T
    torch.testing.assert_close(head(rows, policy.head_plan(3)).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tiny_model", ["qwen2"], indirect=True)  # biases on q, k and v
def test_layers_without_int8_copies_multiply_several_rows_on_float_copies(tiny_model, monkeypatch):
    """Where products in int8 would sum in 16 bits (AVX2), several rows run on a float copy of each
    layer's weight as de-quantized, packed as a float model's: the float product of the same values,
    the bias in it and the residual added inside oneDNN's product; one row still reduces over the blocks."""
    monkeypatch.setattr(loader, "INT8_GEMMS", False)
    runner = build_runner(
        tiny_model, quantization="int4", dtype="float32", num_kv_blocks=16, enforce_eager=True
    )
    layers = [m for m in runner.model.layers.modules() if isinstance(m, QuantLinear)]
    assert layers and all(isinstance(m.gemm, Linear) and m.gemm.prepacked is not None for m in layers)
    assert any(m.bias is not None for m in layers)
    policy = CompilePolicy(runner.model, torch.device("cpu"), enforce_eager=False, dtype=runner.dtype)
    assert policy.few_rows == FEW_QUANTIZED_ROWS  # the blocks' reduction is faster than a float copy at 8
    torch.manual_seed(4)
    for layer in layers:
        x, h = torch.randn(6, layer.in_features), torch.randn(6, layer.out_features)
        dense = layer.packed.rows(torch.arange(layer.out_features))
        expected = torch.nn.functional.linear(x, dense, layer.bias)
        for how in (MatmulPlan(packed=True), MatmulPlan()):  # decode's packed copy, prefill's plain one
            torch.testing.assert_close(layer(x, how), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.add_to(h, x, how), h + expected, rtol=1e-5, atol=1e-5)
        reduced = layer(x[:1], MatmulPlan(matvec=True))
        torch.testing.assert_close(reduced, layer.reduce(x[:1]), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_packed_step_matches_transformers(tiny_model, method, tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "INT8_GEMMS", False)  # float copies: the de-quantized weights' own product
    reference = _dequantized_copy(tiny_model, method, tmp_path / "dequantized")
    check_packed_step(tiny_model, vocab=320, hf_dir=reference, quantization=method)


@pytest.mark.slow
def test_gguf_blocks_match_transformers_smollm2(smollm2_dir, smollm2_hf, monkeypatch):
    """The default GGUF's own Q4_1/Q8_0 blocks against transformers' forward on the GGUF de-quantized
    to float32: a packed step's logits, then greedy tokens compiled (no int8 copies, float ones)."""
    monkeypatch.setattr(loader, "INT8_GEMMS", False)
    check_packed_step(None, vocab=49152, hf_dir=smollm2_dir, tolerance=1e-3, quantization="gguf")
    from transformers import AutoTokenizer

    torch._dynamo.reset()
    runner = build_runner(
        None,
        quantization="gguf",
        dtype="float32",
        max_num_seqs=8,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
    )
    assert sum(isinstance(m, PackedWeight) for m in runner.model.modules()) == 121
    runner.initialize_kv_cache(128)
    poison_kv_cache(runner)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 5)
    assert greedy_mismatches(runner, smollm2_hf, prompts, batch_tokens=32, tail_tokens=32) == []
    assert "few" in runner.policy.decode_graphs  # the decode batches took the fused several-row kernel


TEXT = (Path(__file__).parent / "perplexity.txt").read_text()  # prose, about 900 tokens


def _perplexity(smollm2_dir: str, **engine_args) -> float:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT)["input_ids"]
    runner = build_runner(None, max_num_seqs=1, num_kv_blocks=64, enforce_eager=True, **engine_args)
    runner.initialize_kv_cache(64)
    drv = RunnerDriver(runner)
    drv.add("text", ids)
    logits = drv.logits(drv.build())["text"].float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


@pytest.mark.slow
def test_int8_int4_and_gguf_perplexity_stay_near_bfloat16(smollm2_dir):
    """The text as one prompt: every linear of the layers through the int8 GEMM, activations rounded per
    token, the LM head on the weights' own values. The GGUF's blocks are the bfloat16 model's weights, so
    what it loses is the activations' rounding alone (unsmoothed it lost 2.3 %)."""
    reference = _perplexity(smollm2_dir, dtype="bfloat16")
    int8 = _perplexity(smollm2_dir, dtype="bfloat16", quantization="int8")
    int4 = _perplexity(smollm2_dir, dtype="bfloat16", quantization="int4")
    gguf = _perplexity(smollm2_dir, dtype="bfloat16", quantization="gguf")
    assert 1 < reference < 100
    assert abs(int8 / reference - 1) < 0.02, (reference, int8)
    assert abs(int4 / reference - 1) < 0.08, (reference, int4)
    assert abs(gguf / reference - 1) < 0.015, (reference, gguf)
