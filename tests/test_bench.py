"""The bench commands keep working (tiny sizes; no timing is asserted)."""

import json
import os
import sys
from pathlib import Path

import pytest

from server.bench import runner as bench
from server.bench import serve as bench_serve
from server.cli import main


def test_bench_scheduler(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "scheduler", "--num-requests", "16", "--steps", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["us_per_step"] > 0 and result["num_requests"] == 16


def test_bench_runner_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "runner",
                "--model",
                tiny_llama,
                "--batches",
                "1,3",
                "--context",
                "40",
                "--steps",
                "2",
                "--prefill-len",
                "24",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    for engine in ("kiln_compiled", "kiln_eager", "transformers"):
        assert set(result[engine]["decode_tok_s"]) == {"1", "3"} and result[engine]["prefill_tok_s"] > 0
    assert result["roofline_tok_s"] > 0 and result["kiln_compiled"]["batch1_roofline"] > 0
    printed = capsys.readouterr().out
    assert "compiled / transformers" in printed and "batch-1 compiled decode = " in printed


def test_bench_runner_against_other_weights_compares_two_compiled_runners(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", "runner", "--model", tiny_chat_model, "--batches", "1,2", "--context", "40"]
    args += ["--steps", "2", "--prefill-len", "24", "--no-compare", "--json", str(out)]
    assert main([*args, "--quantization", "w8a8", "--against", "none:float32"]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["quantization"] == "w8a8" and "kiln_eager" not in result
    assert result["kiln_none_float32"]["decode_tok_s"]["2"] > 0
    assert "compiled / kiln_none_float32" in capsys.readouterr().out


def test_bench_runner_decodes_past_its_context_by_as_many_steps_as_asked(tiny_llama, tmp_path):
    """Batch 1 decodes its timed steps twice: the runner's length and KV cache hold them all."""
    out = tmp_path / "r.json"
    args = ["bench", "runner", "--model", tiny_llama, "--batches", "1", "--context", "40", "--steps", "80"]
    assert main([*args, "--prefill-len", "24", "--no-compare", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kiln_compiled"]["decode_tok_s"]["1"] > 0


def test_runner_engines_take_turns():
    log = []

    class Engine:
        prefill_len = 4

        def __init__(self, name: str) -> None:
            self.name = name

        def start(self, batch: int, context: int) -> None:
            log.append((self.name, "start"))

        def step(self) -> None:
            log.append((self.name, "step"))

        def finish(self) -> None:
            log.append((self.name, "finish"))

        def prefill(self) -> None:
            log.append((self.name, "prefill"))

    r = bench.measure({"a": Engine("a"), "b": Engine("b")}, [2], context=8, steps=4, rounds=2)
    # Blocks of an untimed step and two timed ones, the order reversed every round.
    assert [name for name, op in log if op == "step"] == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert [name for name, op in log if op == "prefill"] == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert set(r["a"]["decode_tok_s"]) == {2} and r["b"]["prefill_tok_s"] > 0


def test_runner_report_quotes_the_roofline_only_for_batch_1():
    engine = {"decode_tok_s": {8: 40.0, 32: 90.0}, "prefill_tok_s": 300.0, "warmup_s": 5.0}
    r = {
        "config": {"batches": [8, 32]},
        "copy_bandwidth_GBps": 30.0,
        "roofline_tok_s": 55.0,
        "kiln_compiled": engine,
        "transformers": {**engine, "decode_tok_s": {8: 20.0, 32: 45.0}},
    }
    report = bench.format_report(r)
    assert "| compiled / transformers | 2.00x | 2.00x | 1.00x |" in report and "of roofline" not in report
    r["config"]["batches"] = [1, 8, 32]
    for e in ("kiln_compiled", "transformers"):
        r[e]["decode_tok_s"][1] = 11.0
    r["kiln_compiled"].update(batch1_roofline=0.25, paired_copy_GBps=28.0)
    report = bench.format_report(r)
    assert "batch-1 compiled decode = 25% of roofline" in report and "28.0 GB/s" in report
    assert "20% against the best copy" in report


def test_bench_startup_on_a_tiny_model(tiny_chat_model, tmp_path):
    out = tmp_path / "st.json"
    assert (
        main(
            [
                "bench",
                "startup",
                "--model",
                tiny_chat_model,
                "--dtype",
                "float32",
                "--engine-arg=--enforce-eager",
                "--engine-arg=--kv-cache-memory=50000000",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["warm_s"] > 0 and result["cold_s"] > 0


TINY_ENGINE = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "50000000"]
TINY_LOAD = ["--num-prompts", "4", "--input-len-min", "8", "--input-len-max", "24", "--output-len", "4"]


def test_bench_prompts_are_seeded_windows_of_the_asked_lengths(tiny_chat_model, tmp_path):
    from engine.model_files import load_tokenizer
    from server.bench.prompts import dataset_prompts, token_prompts

    tok = load_tokenizer(tiny_chat_model)
    prompts = token_prompts(tok, 16, 8, 24, seed=1)
    assert len(prompts) == 16 and all(8 <= len(p) <= 24 for p in prompts)
    assert prompts == token_prompts(tok, 16, 8, 24, seed=1) != token_prompts(tok, 16, 8, 24, seed=2)
    assert len({tuple(p[:8]) for p in prompts}) == 16  # random offsets: no shared prefixes
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert dataset_prompts(str(data), 2) == ["a", "b"]
    data.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="'prompt'"):
        dataset_prompts(str(data), 2)


@pytest.mark.parametrize("continuous", [True, False])
def test_bench_throughput_against_transformers(continuous, tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "t.json"
    flags = [] if continuous else ["--no-continuous-batching-baseline"]
    assert (
        main(
            [
                "bench",
                "throughput",
                "--model",
                tiny_chat_model,
                *TINY_ENGINE,
                *TINY_LOAD,
                "--max-num-seqs",
                "2",
                "--compare",
                "transformers",
                *flags,
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert 8 <= r["config"]["input_len_min"] <= r["config"]["input_len_max"] <= 24
    for engine in ("kiln", "transformers_static"):
        assert r[engine]["num_requests"] == 4 and r[engine]["output_tokens"] == 4 * 4
        assert r[engine]["prompt_tokens"] == round(4 * r["config"]["input_len_mean"])
        assert r[engine]["requests_per_s"] > 0 and r[engine]["total_tok_s"] > r[engine]["output_tok_s"] > 0
    if not continuous:
        assert "transformers_continuous" not in r
        return
    cb = r["transformers_continuous"]
    assert cb.get("unavailable") or cb["output_tokens"] == 4 * 4
    assert "| transformers, static batches |" in capsys.readouterr().out


def test_bench_latency_against_transformers(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "l.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                tiny_chat_model,
                *TINY_ENGINE,
                "--max-model-len",
                "64",
                "--input-lens",
                "8,24,1000",
                "--output-len",
                "4",
                "--iters",
                "2",
                "--compare",
                "transformers",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["config"]["input_lens"] == [8, 24, 60]  # 1000 capped at max_model_len - output_len
    for engine in ("kiln", "transformers"):
        assert set(r[engine]) == {"8", "24", "60"}
        for d in r[engine].values():
            assert len(d["ttft_ms"]) == 2 and min(d["ttft_ms"]) > 0 and min(d["decode_tok_s"]) > 0
    assert (
        r["weight_bytes"] > 0 and r["roofline_tok_s"] > 0 and min(r["copy_bandwidth_GBps_before_after"]) > 0
    )
    assert "| kiln / transformers |" in capsys.readouterr().out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_launches_a_server_or_uses_a_running_one(
    endpoint, request, tiny_chat_model, tmp_path, capsys, monkeypatch
):
    """completions: a server it launches; chat: the session's server, with its key."""
    monkeypatch.setattr(bench_serve, "SETTLE_S", 0.0)
    out, data = tmp_path / "s.json", tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Tell me about kiln number {i}."}) + "\n" for i in range(4))
    )
    if endpoint == "chat":
        server = request.getfixturevalue("server")
        target = ["--base-url", server.url, "--api-key", "test-key", "--dataset", str(data)]
    else:
        target = ["--launch", tiny_chat_model, *TINY_ENGINE, "--request-rate", "50"]
    args = ["bench", "serve", *target, *TINY_LOAD, "--endpoint", endpoint, "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["first_error"] is None
    assert r["output_tokens"] == 4 * 4 and all(q["output_tokens"] == 4 for q in r["requests"])
    assert r["prompt_tokens"] > 0 and r["request_throughput"] > 0
    for m in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < r[m]["p50_ms"] <= r[m]["p99_ms"]
    assert r["e2e"]["mean_ms"] >= r["ttft"]["mean_ms"]
    assert "| TTFT |" in capsys.readouterr().out


def test_bench_serve_leaves_ignore_eos_out_for_servers_that_reject_it():
    path, [body] = bench_serve.request_payloads(["hi"], "chat", "m", 16, ignore_eos=False)
    assert path == "/v1/chat/completions" and "ignore_eos" not in body and body["max_tokens"] == 16
    path, [body] = bench_serve.request_payloads(["hi"], "completions", "m", 16, ignore_eos=True)
    assert path == "/v1/completions" and body["ignore_eos"] is True and body["prompt"] == "hi"


def test_gpu_check_without_a_gpu_runs_exactness_and_per_bucket_speed(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "g.json"
    assert (
        main(
            [
                "bench",
                "gpu-check",
                "--device",
                "cpu",
                "--model",
                tiny_chat_model,
                "--max-num-seqs",
                "3",
                "--context",
                "40",
                "--steps",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["ok"] and result["greedy_mismatches"] == []
    assert set(result["compiled"]["decode_tok_s"]) == set(result["eager"]["decode_tok_s"]) == {"1", "2", "3"}
    assert "token-exact" in capsys.readouterr().out


def test_gpu_check_refuses_cpu_only_machine_clearly(tiny_chat_model):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        from server.bench import gpu_check

        gpu_check.run(tiny_chat_model)


def test_bench_structured_on_a_tiny_model(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["bench", "structured", "--model", tiny_chat_model, *TINY_ENGINE, "--output-len", "12"]
    assert main([*args, "--rounds", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["batches"]) == {"1", "16"}
    for b in r["batches"].values():
        assert b["free_ms"] > 0 and b["json_ms"] > 0
        assert b["overhead"] == pytest.approx(b["json_ms"] / b["free_ms"] - 1)
    assert all(v > 0 for v in r["ttft_ms"].values()) and set(r["ttft_ms"]) == {
        "first_seen",
        "cached",
        "unconstrained",
    }
    assert "with a JSON schema" in capsys.readouterr().out


def test_the_vllm_peer_gets_kilns_model_directory_with_its_architecture_named(tmp_path):
    from server.bench import vllm_cpu

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with vllm_cpu.model_dir(str(tmp_path)) as d:
        assert json.loads((Path(d) / "config.json").read_text()) == {
            "model_type": "qwen2",
            "hidden_size": 8,
            "architectures": ["Qwen2ForCausalLM"],
        }
        assert (Path(d) / "model.safetensors").read_bytes() == b"weights"
    assert not Path(d).exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"), vllm_cpu.model_dir(str(tmp_path)):
        pass
    # Threads: the peer's OpenMP threads are bound to as many CPUs as kiln's engine had.
    cmd = vllm_cpu.command("/peer/bin/python", ["-P", "x.py"], 1)
    cpu = min(os.sched_getaffinity(0))
    assert f"VLLM_CPU_OMP_THREADS_BIND={cpu};" in cmd[2] and cmd[-3:] == ["/peer/bin/python", "-P", "x.py"]


def test_the_w8a8_checkpoint_for_vllm_multiplies_kilns_int8_weights(tiny_chat_model, tmp_path):
    """transformers on the checkpoint de-quantized (its RMSNorm weights and up rows carrying the 1/s kiln
    applies to a layer's input) gives the logits of transformers on the weights kiln's w8a8 layers
    multiply, o_proj's aside: the checkpoint's is re-quantized unsmoothed, and the reference takes it so."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from compiled.loader import load_model
    from compiled.w8a8 import INT8_ISA, quantize_weight, weight_max
    from server.bench.models import w8a8_checkpoint

    out = Path(w8a8_checkpoint(tiny_chat_model, "float32", str(tmp_path / "w8a8")))
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "int-quantized")
    assert q["ignore"] == ["lm_head"]
    group = q["config_groups"]["group_0"]
    assert (group["weights"]["strategy"], group["weights"]["dynamic"]) == ("channel", False)
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    assert (out / "tokenizer.json").exists()

    state = load_file(str(out / "model.safetensors"))
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    dequantized = {
        name: t.float() * state[f"{name}_scale"] if t.dtype == torch.int8 else t.float()
        for name, t in state.items()
        if not name.endswith("_scale")
    }
    theirs = LlamaForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    loaded = theirs.load_state_dict(dequantized, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {
        "lm_head.weight"
    }  # tied to the embedding

    kiln = load_model(tiny_chat_model, torch.float32, torch.device("cpu"), "w8a8")
    reference = LlamaForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    for layer, ours in zip(reference.model.layers, kiln.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        for module, w in zip(
            (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj),
            (
                *ours.attention.wqkv.dequantized().split([q_rows, kv_rows, kv_rows]),
                *ours.feed_forward.w13.dequantized().chunk(2),
                ours.feed_forward.w2.dequantized(),
            ),
        ):
            module.weight.data = w
        fields, scale = quantize_weight(attn.o_proj.weight, weight_max(INT8_ISA))  # o_proj: unsmoothed
        attn.o_proj.weight.data = fields.float() * scale[:, None]
    ids = torch.tensor([[1, 17, 4093, 28, 905, 3, 611, 42]])
    with torch.no_grad():
        got, want = theirs(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_throughput_on_w8a8_also_runs_vllm_on_kilns_weights(tiny_chat_model, tmp_path, monkeypatch, capsys):
    """With `--quantization w8a8` the vLLM peer runs twice, on the float weights and on the W8A8 checkpoint;
    otherwise once. The peer is replaced by one that says what it was given."""
    from server.bench import vllm_cpu

    def offline(python, weights, dtype, max_model_len, prompts, output_len, threads) -> dict:
        quantized = "quantization_config" in json.loads((Path(weights) / "config.json").read_text())
        elapsed = 2.0 if quantized else 4.0
        tokens = dict(prompt_tokens=1, output_tokens=len(prompts) * output_len, elapsed_s=elapsed)
        return dict(version="0", max_num_seqs=8, max_num_batched_tokens=64, **tokens)

    monkeypatch.setattr(vllm_cpu, "python", lambda given: "/peer/bin/python")
    monkeypatch.setattr(vllm_cpu, "offline", offline)
    for quantization in ("none", "w8a8"):
        out = tmp_path / f"{quantization}.json"
        argv = ["throughput", "--model", tiny_chat_model, *TINY_ENGINE, *TINY_LOAD, "--compare", "vllm"]
        assert main(["bench", *argv, "--quantization", quantization, "--json", str(out)]) == 0
        r = json.loads(out.read_text())
        assert r["vllm"]["elapsed_s"] == 4.0
        assert ("vllm_w8a8" in r) == (quantization == "w8a8")
    assert r["vllm_w8a8"]["elapsed_s"] == 2.0
    assert "| vLLM 0 (W8A8, kiln's int8 weights, " in capsys.readouterr().out


def test_compare_vllm_refuses_clearly_without_the_peer_or_a_launched_server(tmp_path, capsys):
    for argv in (
        ["throughput", "--compare", "vllm", "--vllm-python", str(tmp_path / "none")],
        ["serve", "--launch", "--compare", "vllm", "--vllm-python", str(tmp_path / "none")],
        ["serve", "--compare", "vllm"],
    ):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("setup-vllm-cpu.sh") == 2 and "needs --launch" in err


def test_serve_comparison_reports_kiln_over_vllm():
    def run(tok_s: float, ttft_p99: float) -> dict:
        stats = {"mean_ms": 10.0, "p50_ms": 10.0, "p90_ms": 10.0, "p99_ms": ttft_p99}
        return {"output_throughput": tok_s, "ttft": stats, "itl": stats, "tpot": stats}

    table = bench_serve.format_ratios({"kiln": run(120.0, 50.0), "vllm": run(100.0, 200.0)})
    assert "| output tok/s | 120.0 | 100.0 | 1.20x (higher is better) |" in table
    assert "| TTFT p99 ms | 50.0 | 200.0 | 0.25x (lower is better) |" in table


def test_greedy_references_continue_where_an_earlier_one_stopped(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    from server.bench.driver import hf_greedy

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    model, prompt = load(), [5, 9, 13, 2, 7]
    short = hf_greedy(model, prompt, 3)
    longer = hf_greedy(model, prompt, 12)
    assert longer[:3] == short and hf_greedy(model, prompt, 5) == longer[:5]
    assert longer == hf_greedy(load(), prompt, 12)  # a fresh model computes every step anew


def test_greedy_references_of_a_padded_batch_are_each_prompt_s_own(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    from server.bench.driver import hf_greedy, hf_greedy_batch

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    prompts = [[5, 9, 13, 2, 7], [3], [11, 4, 4, 8, 1, 6, 2, 9, 30]]
    one_by_one = load()  # each model keeps its own runs
    batched = hf_greedy_batch(load(), prompts, 10)
    assert batched == [hf_greedy(one_by_one, p, 10) for p in prompts]
    model = load()
    assert hf_greedy_batch(model, prompts, 4) == [tokens[:4] for tokens in batched]
    assert hf_greedy(model, prompts[0], 12)[:10] == batched[0]  # a batch's tokens are continued anew


def test_bench_spec_drafts_and_keeps_the_answers(tiny_chat_model, tmp_path, capsys):
    # suffix: the method with the more moving parts (ngram's drafts are tested in test_spec_decode.py)
    out, spec = tmp_path / "s.json", json.dumps({"method": "suffix", "num_speculative_tokens": 4})
    flags = ["--output-len", "12", "--concurrency", "2", "--rounds", "1", "--spec", spec, "--json", str(out)]
    assert main(["bench", "spec", "--model", tiny_chat_model, *TINY_ENGINE, *flags]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"grounded, 2 at a time", "open, 2 at a time"}
    for row in rows.values():
        assert row["off"] > 0 and row["drafts"] > 0 and row["same_answers"] is True
    assert "accept len" in capsys.readouterr().out


FAKE_LLAMA_CPP = """
__version__ = "fake"
import sys, types
class Params: use_extra_bufts = True
class llama_cpp: llama_model_default_params = staticmethod(lambda: Params())
class Llama:
    def __init__(self, path, draft_model=None, **kw): self.draft = draft_model
    def reset(self): pass
    def generate(self, prompt, temp, top_k):  # the prompt over and over; 7 where a drafting model stops
        for i in range(1000):
            yield 7 if self.draft is not None and i == 3 else prompt[i % len(prompt)]
speculative = types.ModuleType("llama_cpp.llama_speculative")
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size, num_pred_tokens): assert (max_ngram_size, num_pred_tokens) == (5, 8)
speculative.LlamaPromptLookupDecoding = LlamaPromptLookupDecoding
sys.modules["llama_cpp.llama_speculative"] = speculative
"""


def test_llama_cpp_peer_answers_plain_and_by_prompt_lookup(tmp_path, monkeypatch):
    from server.bench.latency import LlamaCpp

    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    peer = LlamaCpp(sys.executable, "model.gguf", 1, 64, lookup=(8, 5))
    try:
        assert peer.version == "fake"
        assert peer.call([1, 2, 3], 5, stop=[7])["tokens"] == [1, 2, 3, 1, 2]
        assert peer.call([1, 2, 3], 5, stop=[7], lookup=True)["tokens"] == [1, 2, 3, 7]
        ttft, decode = peer.request([1, 2, 3], 4)
        assert ttft >= 0 and decode > 0
    finally:
        peer.close()


def test_bench_spec_runs_a_peer_one_request_at_a_time(tiny_chat_model):
    import asyncio

    from engine.async_llm import AsyncLLM
    from engine.params import SamplingParams
    from server.bench import spec

    calls = []

    class Peer:
        def call(self, prompt, output_len, stop, lookup):
            calls.append((len(prompt), output_len, tuple(stop), lookup))
            return {"tokens": prompt[:3], "seconds": 0.01 if lookup else 0.02}

    args = dict(dtype="float32", enforce_eager=True, kv_cache_memory=50_000_000)
    drafts = '{"method": "ngram", "num_speculative_tokens": 2}'
    llm = AsyncLLM(tiny_chat_model, **args)  # one engine in both roles: the peer's rows are what is checked
    engines = {"off": llm, "drafts": llm}
    try:
        sets = {"grounded": [llm.chat_prompt([{"role": "user", "content": "hi"}])]}
        params = SamplingParams(temperature=0.0, max_tokens=6)
        rows = asyncio.run(spec._bench(engines, None, sets, params, (1, 2), 1, Peer()))
    finally:
        llm.shutdown()
    one, two = rows["grounded, 1 at a time"], rows["grounded, 2 at a time"]
    assert one["llama.cpp lookup"] == pytest.approx(2 * one["llama.cpp"]) and one["llama.cpp tokens"] == 3
    assert one["llama.cpp same"] is True
    assert "llama.cpp" not in two  # a batch-1 peer: no served streams
    stop = engines["off"].processor.eos_token_id
    assert {c[1:] for c in calls} == {(6, (stop,), False), (6, (stop,), True)} and len(calls) == 4
    report = spec.format_report(
        {
            "speculative_config": drafts,
            "output_len": 6,
            "rows": rows,
            "llama.cpp": {"version": "x", "num_pred_tokens": 2, "max_ngram_size": 5},
        }
    )
    assert "kiln drafts / lookup" in report


def test_a_random_model_of_a_larger_shape_is_written_once_and_computes_as_transformers_does(tmp_path):
    from server.bench.models import random_model
    from tests.test_model_runner import check_packed_step

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    path = random_model("llama-3.2-1b", str(tmp_path / "m"), **small, num_key_value_heads=2, head_dim=16)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert (tmp_path / "m" / "tokenizer.json").exists()
    written = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    assert random_model("llama-3.2-1b", path) == path
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == written
    check_packed_step(path, vocab=128256)  # a step's logits against transformers' forward
