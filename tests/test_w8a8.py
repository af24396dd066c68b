"""W8A8 linears (compiled/w8a8.py): each ISA's int8 GEMM against the exact product of its quantized
operands, the one-row path on the same weights, smoothing, and the real model against float32."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from compiled import loader, w8a8
from compiled.loader import load_model
from compiled.models.linear import cpu_has_fast_bf16
from compiled.plan import MatmulPlan
from compiled.quant import QuantLinear
from compiled.w8a8 import Int8Linear, int8_isa, quantize_rows, quantize_weight, smoothing, weight_max
from engine.config import EngineConfig
from server.bench.driver import RunnerDriver, build_runner, chat_prompts
from tests.test_quantization import _perplexity

GEMM, ONE_ROW = MatmulPlan(packed=True), MatmulPlan(matvec=True)


def test_the_isa_is_the_best_the_flags_name_capped_as_onednn_is():
    spr = "flags : fpu avx2 avx512f avx512bw avx512_vnni avx_vnni amx_tile amx_int8"
    assert int8_isa(spr, "ALL") == "AVX512_CORE_AMX"
    assert int8_isa(spr, "avx512_core_vnni") == "AVX512_CORE_VNNI"
    assert int8_isa(spr, "AVX2") == "AVX2"
    assert int8_isa("flags : fpu avx2 avx512f avx512bw", "ALL") == "AVX512_CORE"  # Skylake: no VNNI
    assert int8_isa("flags : fpu sse4_2 avx2", "AVX512_CORE_AMX") == "AVX2"  # a cap above the CPU
    assert int8_isa("flags : fpu sse4_2", "ALL") is None
    # 16-bit pair sums saturate without VNNI: 7-bit weights there, 8-bit where products sum in 32 bits.
    isas = ("AVX2", "AVX512_CORE", "AVX2_VNNI", "AVX512_CORE_AMX")
    assert [weight_max(i) for i in isas] == [63, 63, 127, 127]


def test_bfloat16_counts_as_fast_only_where_the_flags_name_it_and_onednn_may_use_it():
    zen4 = "flags : fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16"
    assert cpu_has_fast_bf16(zen4, "ALL")
    assert cpu_has_fast_bf16("flags : fpu avx2 avx512f amx_bf16 amx_int8", "AVX512_CORE_AMX")
    assert not cpu_has_fast_bf16("flags : fpu avx2 avx512f avx512bw avx512_vnni", "ALL")  # Ice Lake
    # oneDNN capped below its bfloat16 ISAs (an AVX2 CPU's paths, run on an AVX-512 one) emulates it.
    assert not cpu_has_fast_bf16(zen4, "avx2")
    assert not cpu_has_fast_bf16(zen4, "AVX512_CORE_VNNI")


def _gemm_error(isa: str | None) -> float:
    """Relative error of the GEMM path against the exact product of its quantized operands, activations
    over their whole range (every field 1..255 occurs), with a bias."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 576) * 0.05, torch.randn(96)
    x = torch.randn(64, 576) * 3
    x[:, 5] = 40.0  # an outlier channel, so most other fields sit far from the zero point
    smooth = torch.rand(576) + 0.5
    layer = Int8Linear(w, bias, smooth, isa=isa)
    q, x_scale = quantize_rows(x * (1 / smooth))
    wq, w_scale = quantize_weight(w * smooth, weight_max(isa))
    exact = (q.double() - 128) @ wq.double().T * w_scale.double() * x_scale.double() + bias.double()
    y = layer(x, GEMM).double()
    return float((y - exact).norm() / exact.norm())


@pytest.mark.parametrize("cap", [None, "AVX2", "AVX512_CORE_VNNI"])
def test_the_int8_gemm_is_the_exact_product_of_its_quantized_operands(cap):
    """Each ISA oneDNN runs here (AVX2 and VNNI by capping it, in a process of their own): a wrong
    scale, zero point or saturating sum would be far off."""
    if cap is None:
        assert _gemm_error(w8a8.INT8_ISA) < 1e-6
        return
    code = "from tests.test_w8a8 import _gemm_error, w8a8; print(w8a8.INT8_ISA, _gemm_error(w8a8.INT8_ISA))"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=cap, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    isa, error = out.stdout.split()[-2:]
    assert isa == int8_isa(cap=cap)  # the CPU's flags, capped
    assert float(error) < 1e-6, out.stdout


def test_zero_rows_quantize_to_the_zero_point_and_others_span_the_range():
    x = torch.randn(3, 64)
    x[1] = 0
    q, scale = quantize_rows(x)
    assert torch.isfinite(scale).all()
    assert (q[1] == 128).all()
    assert ((q[[0, 2]].int() - 128).abs().amax(-1) == 127).all()


def test_the_one_row_reduction_computes_with_the_gemm_s_weights():
    torch.manual_seed(1)
    w, x = torch.randn(48, 128), torch.randn(3, 128)
    layer = Int8Linear(w, None, torch.rand(128) + 0.5)
    one_row = layer(x, ONE_ROW)
    torch.testing.assert_close(one_row, x @ layer.dequantized().T, rtol=1e-4, atol=1e-4)
    assert (layer.dequantized() - w).abs().max() < 0.02 * w.abs().max()
    # The GEMM differs from it by the activations' rounding alone.
    assert (layer(x, GEMM) - one_row).norm() / one_row.norm() < 0.02


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layers_take_an_int8_gemm_for_several_rows_their_own_kernel_for_one(
    tiny_llama, method, monkeypatch
):
    """The layers of int8 / int4 weights get an int8 GEMM's copy of the float weight, the LM head none:
    several rows go through it, within the activations' rounding of the float product; one row through
    the weight-only reduction, exactly its de-quantized product. (Copies are made only where products sum
    in 32 bits; elsewhere they have 7-bit weights.)"""
    monkeypatch.setattr(loader, "INT8_GEMMS", True)
    tolerance = 0.03 if weight_max(w8a8.INT8_ISA) == 127 else 0.06
    cpu = torch.device("cpu")
    model, plain = (load_model(tiny_llama, torch.float32, cpu, q) for q in (method, "none"))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert "output" in linears and len(linears) > 1
    assert all((m.gemm is not None) == name.startswith("layers.") for name, m in linears.items())
    torch.manual_seed(3)
    for name, layer in linears.items():
        if layer.gemm is None:
            continue
        x = torch.randn(8, layer.in_features)
        exact = x @ plain.get_submodule(name).weight.T
        several = layer(x, GEMM)
        assert torch.equal(several, layer.gemm(x) + (0 if layer.bias is None else layer.bias))
        assert (several - exact).norm() / exact.norm() < tolerance, name
        dense = layer.packed.rows(torch.arange(layer.out_features))
        torch.testing.assert_close(layer(x[:1], ONE_ROW), x[:1] @ dense.T, rtol=1e-4, atol=1e-4)


def test_smoothing_moves_an_outlier_channel_s_range_into_the_weight():
    torch.manual_seed(2)
    w, x = torch.randn(64, 256) * 0.05, torch.randn(32, 256)
    x[:, 3] *= 60
    exact = x @ w.T

    def error(layer: Int8Linear) -> float:
        return float((layer(x, GEMM) - exact).norm() / exact.norm())

    plain, smoothed = error(Int8Linear(w, None)), error(Int8Linear(w, None, smoothing(x.abs().amax(0), w)))
    assert smoothed < plain / 2, (plain, smoothed)


def test_w8a8_is_a_cpu_quantization_calibrated_by_the_model_s_tokenizer(smollm2_dir, tiny_llama):
    assert EngineConfig(quantization="w8a8").quantization == "w8a8"
    with pytest.raises(ValueError, match="w8a8 runs on x86 CPUs"):
        load_model(smollm2_dir, torch.float32, torch.device("cuda"), "w8a8")
    with pytest.raises(ValueError, match="w8a8 calibrates on chats its tokenizer writes"):
        load_model(tiny_llama, torch.float32, torch.device("cpu"), "w8a8")  # no tokenizer


def test_the_calibration_chats_are_kept_by_the_tokenizer_s_files(smollm2_dir, tmp_path, monkeypatch):
    """Written once through transformers, read back without it; a changed chat template writes them anew."""
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    first = w8a8.calibration_prompts(str(model))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = json.loads(w8a8.CALIBRATION.read_text())[0]
    assert first[0] == tokenizer.apply_chat_template(chat)["input_ids"]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "transformers", None)  # any import of it fails
        assert w8a8.calibration_prompts(str(model)) == first
    template = model / "chat_template.jinja"
    template.write_text("Chat:" + template.read_text())
    assert w8a8.calibration_prompts(str(model))[0] == tokenizer.encode("Chat:") + first[0]
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 2


@pytest.mark.slow
def test_w8a8_perplexity_stays_near_float32(smollm2_dir):
    """Within 1.5 % where int8 products sum in 32 bits (measured +0.5 %); AVX2's 7-bit weights lose more
    (measured +3.1 %, with oneDNN capped to AVX2: every path computes its operands' exact product, so any
    AVX2 CPU computes the same)."""
    reference = _perplexity(smollm2_dir, dtype="float32")
    ours = _perplexity(smollm2_dir, dtype="float32", quantization="w8a8")
    limit = 0.015 if weight_max(w8a8.INT8_ISA) == 127 else 0.035
    assert abs(ours / reference - 1) < limit, (reference, ours)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["w8a8", "gguf"])  # gguf: its blocks and their int8 GEMM copies
def test_compiled_int8_arithmetic_decodes_what_float32_would_choose(smollm2_dir, smollm2_hf, quantization):
    """Greedy continuations, compiled, nine prompts batched (GEMM steps) and one alone (one-row steps):
    at 90 % of their positions (measured: 94-96 %) the token is float32 transformers' own argmax after
    the same tokens. Whole continuations part from float32's sooner: bfloat16's own do too, after a
    first close call."""
    runner = build_runner(None, dtype="float32", quantization=quantization, max_num_seqs=16)
    runner.initialize_kv_cache(64)
    runner.warmup()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 9)
    drv = RunnerDriver(runner, chunk=24)
    for i, p in enumerate(prompts):
        drv.add(str(i), p)
    out = drv.generate(24)
    for _ in range(8):  # the first prompt alone: one-row steps
        drv.step(["0"])
    out["0"] = drv.reqs["0"]["out"][:32]
    # From two rows on the GEMM (w8a8), from five (gguf, whose few rows reduce over the blocks).
    assert set(runner.policy.decode_graphs) == (
        {"one", "more"} | ({"few"} if quantization == "gguf" else set())
    )
    agree = total = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            tokens = out[str(i)]
            logits = smollm2_hf(torch.tensor([p + tokens])).logits[0, len(p) - 1 : -1]
            agree += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
            total += len(tokens)
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.slow
def test_w8a8_answers_the_shipped_lm_eval_task_within_one_question_of_float32(smollm2_dir):
    """tests/lm_eval_task scored as lm-eval scores a multiple-choice task (the summed logprobs of each
    choice's tokens after the question; tests/test_lm_eval.py checks kiln's server against lm-eval itself)."""
    docs = [json.loads(line) for line in (Path(__file__).parent / "lm_eval_task" / "kiln_mc.jsonl").open()]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)

    def correct(**engine_args) -> int:
        runner = build_runner(None, max_num_seqs=64, num_kv_blocks=80, enforce_eager=True, **engine_args)
        runner.initialize_kv_cache(80)
        drv, spans = RunnerDriver(runner), {}
        for d, doc in enumerate(docs):
            context = tokenizer(doc["question"])["input_ids"]
            for c, choice in enumerate(doc["choices"]):
                ids = tokenizer(doc["question"] + " " + choice)["input_ids"]
                drv.add(f"{d}-{c}", ids)
                spans[f"{d}-{c}"] = (ids, len(context))
        logits = drv.logits(drv.build())
        score = {}
        for rid, (ids, start) in spans.items():
            logprobs = logits[rid].float().log_softmax(-1)[start - 1 : -1]
            score[rid] = float(logprobs.gather(-1, torch.tensor(ids[start:])[:, None]).sum())
        answers = [[score[f"{d}-{c}"] for c in range(len(doc["choices"]))] for d, doc in enumerate(docs)]
        return sum(s.index(max(s)) == doc["answer"] for s, doc in zip(answers, docs))

    reference = correct(dtype="float32")
    assert reference >= len(docs) // 2  # the task is one the model mostly answers
    assert abs(correct(dtype="float32", quantization="w8a8") - reference) <= 1
