import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled import compile_policy, guard_free, quant
from compiled.guard_free import GuardFreeGraph
from compiled.input_batch import StepInputs, decode_buckets
from compiled.loader import load_config
from compiled.model_runner import ModelRunner
from compiled.plan import PartCalls, call_module
from engine.params import SamplingParams
from engine.step import NewRequestData
from server.bench.driver import (
    RunnerDriver,
    build_runner,
    chat_prompts,
    greedy_mismatches,
    hf_greedy_batch,
)
from tests.conftest import make_tiny_model


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def poison_kv_cache(runner: ModelRunner) -> None:
    """The cache starts uninitialised: make that garbage NaN, which any unmasked read would spread."""
    for layer in runner.model.layers:
        layer.attention.k_cache.fill_(float("nan"))
        layer.attention.v_cache.fill_(float("nan"))


def check_packed_step(
    model_dir: str | None,
    vocab: int,
    block_size: int = 4,
    hf_dir: str | None = None,
    tolerance: float = 1e-4,
    **engine_args,
) -> None:
    """One packed step of chunks, decodes, a fresh prompt and a prefix-cache hit against transformers'
    forward on `hf_dir` (default: the same model)."""
    torch.manual_seed(1)
    runner = build_runner(
        model_dir,
        dtype="float32",
        block_size=8 if block_size == 8 else 16,
        max_num_seqs=8,
        num_kv_blocks=256,
        enforce_eager=True,
        **engine_args,
    )
    runner.initialize_kv_cache(256)
    poison_kv_cache(runner)
    bs = runner.block_size
    drv = RunnerDriver(runner, chunk=2 * bs)
    prompts = {
        rid: torch.randint(0, vocab, (n,)).tolist()
        for rid, n in [("chunked", 5 * bs + 3), ("decode", 7), ("one", 1), ("fresh", 2 * bs - 3)]
    }
    for rid in ("chunked", "decode", "one"):
        drv.add(rid, prompts[rid])
    drv.step()  # chunked: first 2 blocks; decode and one: whole prompt, sampled
    so = drv.build()  # chunked continues after cached context; decode and one decode
    drv.add("fresh", prompts["fresh"])
    fresh = drv.build(["fresh"])
    so.new_reqs += fresh.new_reqs
    so.num_scheduled_tokens.update(fresh.num_scheduled_tokens)
    # A prefix-cache hit: shares "chunked"'s first two (computed) blocks and computes the rest.
    hit_prompt = drv.reqs["chunked"]["tokens"][: 2 * bs] + torch.randint(0, vocab, (bs + 5,)).tolist()
    hit_blocks = [*drv.reqs["chunked"]["blocks"][:2], 200, 201]
    so.new_reqs.append(
        NewRequestData(
            "hit", hit_prompt, len(hit_prompt), SamplingParams(temperature=0), hit_blocks, 2 * bs, 0
        )
    )
    so.num_scheduled_tokens["hit"] = bs + 5
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    ours = drv.logits(so)
    hf = hf_model(hf_dir or model_dir)
    seqs = {rid: r["tokens"] for rid, r in drv.reqs.items()} | {"hit": hit_prompt}
    computed = {rid: r["computed"] for rid, r in drv.reqs.items()} | {"hit": 2 * bs}
    assert {s.req_id for s in runner.batch.requests.values()} == set(seqs)
    for rid, logits in ours.items():
        start, n = computed[rid], so.num_scheduled_tokens[rid]
        with torch.no_grad():
            ref = hf(torch.tensor([seqs[rid][: start + n]])).logits[0, start : start + n].float()
        err = (logits - ref).abs().max() / ref.abs().max()
        assert err < tolerance, f"{rid}: relative error {err:.2e}"


def test_packed_step_logits_match_transformers(tiny_model):
    check_packed_step(tiny_model, vocab=320)


def test_a_sliding_window_matches_transformers_past_the_window(tmp_path):
    """Mistral's window of 12 keys, compiled: prompts prefill together tile by tile and in chunks after
    context, then decode far past the window; greedy tokens as transformers' in float32."""
    path = make_tiny_model(tmp_path, "mistral")
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    runner = build_runner(path, dtype="float32", max_num_seqs=4, num_kv_blocks=64, block_size=16)
    runner.initialize_kv_cache(64)
    poison_kv_cache(runner)
    assert [layer.attention.scoring.window for layer in runner.model.layers] == [12, 12]
    torch.manual_seed(3)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (45, 9, 30, 17)]
    assert greedy_mismatches(runner, hf_model(path), prompts, batch_tokens=24, tail_tokens=48, chunk=20) == []


def test_bfloat16_decode_matches_transformers(tiny_llama):
    """bfloat16 decode graphs: one sequence, then two (matrix-vector reductions for both where the CPU
    computes bfloat16, a few rows being of their own kind)."""
    torch.manual_seed(2)
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    runner = build_runner(tiny_llama, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64)
    runner.initialize_kv_cache(64)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    drv = RunnerDriver(runner, chunk=64)

    def check(so) -> None:
        for rid, logits in drv.logits(so).items():
            tokens = drv.reqs[rid]["tokens"][: drv.reqs[rid]["computed"] + 1]
            with torch.no_grad():
                ref = hf(torch.tensor([tokens])).logits[0, -1:].float()
            err = (logits.float() - ref).abs().max() / ref.abs().max()
            assert err < 2e-2, f"{rid}: relative error {err:.2e}"

    drv.add("a", torch.randint(0, 320, (21,)).tolist())
    drv.step()
    check(drv.build())
    drv.add("b", torch.randint(0, 320, (35,)).tolist())
    drv.step()  # "a" decodes beside "b"'s prefill
    so = drv.build()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    check(so)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_run_on_weights_packed_for_onednn_on_cpu(tiny_llama, dtype):
    from compiled.models.linear import PACKED_PREFILL_DTYPES, Linear, cpu_matmul_dtype

    runner = build_runner(tiny_llama, dtype=dtype, max_num_seqs=4, num_kv_blocks=8, enforce_eager=True)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * len(runner.model.layers) + 1
    for linear in linears:
        packed = linear.prepacked
        assert (packed is not None) == torch.backends.mkldnn.is_available()
        if packed is not None:  # packed in the dtype the matmul runs in on this CPU
            assert packed.dtype == cpu_matmul_dtype(linear.weight.dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    w13, plans = runner.model.layers[0].feed_forward.w13, runner.policy.plans
    decode, prefill_plan = plans["more"].linear, plans["prefill"].linear
    x = torch.randn(7, 64).to(w13.weight.dtype)
    expected = x.float() @ w13.weight.float().T
    torch.testing.assert_close(w13(x, decode).float(), expected, rtol=tol, atol=tol)
    with torch.profiler.profile() as prof:
        prefill = w13(x, prefill_plan)  # a prefill's rows: on the packed copy where it is bfloat16
    calls = sum(e.count for e in prof.key_averages() if e.key == "kiln::packed_linear")
    assert calls == (w13.prepacked is not None and w13.prepacked.dtype in PACKED_PREFILL_DTYPES)
    torch.testing.assert_close(prefill.float(), expected, rtol=tol, atol=tol)
    # The output projection adds to the residual stream inside the packed product.
    wo, h = runner.model.layers[0].attention.wo, torch.randn(7, 64).to(w13.weight.dtype)
    for how in (prefill_plan, decode):
        with torch.profiler.profile() as prof:
            summed = wo.add_to(h, x, how)
        fused = sum(e.count for e in prof.key_averages() if e.key == "kiln::packed_linear_add")
        packed = wo.prepacked is not None and (how is decode or wo.prepacked.dtype in PACKED_PREFILL_DTYPES)
        assert fused == packed
        expected_sum = h.float() + x.float() @ wo.weight.float().T
        torch.testing.assert_close(summed.float(), expected_sum, rtol=tol, atol=2 * tol)
    weight = runner.model.output.weight
    hidden = torch.randn(5, 64).to(weight.dtype)
    expected = hidden.float() @ weight.float().T
    logits = runner.policy.logits(hidden)
    assert logits.dtype == torch.float32 and logits.is_contiguous()  # row maxima read rows
    torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(runner.policy.logits(hidden[:1]), expected[:1], rtol=tol, atol=tol)


def test_no_packed_copy_where_it_would_crowd_the_ram(tiny_llama, monkeypatch):
    from compiled import model_runner

    def runner():
        return build_runner(tiny_llama, dtype="float32", max_num_seqs=4, num_kv_blocks=8, enforce_eager=True)

    ram = 100 * runner().weight_bytes
    monkeypatch.setattr(model_runner, "available_ram", lambda: ram)  # weights at 1 % of it: packed
    assert (runner().model.output.prepacked is not None) == torch.backends.mkldnn.is_available()
    monkeypatch.setattr(model_runner, "available_ram", lambda: ram // 50)  # at 50 %: not
    runner = runner()
    assert all(getattr(m, "prepacked", None) is None for m in runner.model.modules())
    hidden = torch.randn(5, 64)
    expected = hidden @ runner.model.output.weight.T
    torch.testing.assert_close(runner.policy.logits(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_packed_step_logits_match_transformers_smollm2(smollm2_dir):
    check_packed_step(smollm2_dir, vocab=49152)


@pytest.mark.slow
def test_greedy_generation_matches_transformers_smollm2(smollm2_dir, smollm2_hf):
    """Eager; compiled, the same check runs in tests/test_llm.py and, quantized, test_quantization.py."""
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 9)
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    runner = build_runner(
        smollm2_dir,
        dtype="float32",
        max_num_seqs=16,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        enforce_eager=True,
    )
    runner.initialize_kv_cache(128)
    poison_kv_cache(runner)
    assert greedy_mismatches(runner, smollm2_hf, prompts) == []


def teacher_forced_logits(
    runner: ModelRunner, sequences: list[list[int]], n_prompt: list[int], few: int = 0
) -> list:
    """Logits at every position of each sequence, the sequences' own tokens fed back (teacher forcing):
    prompts prefill together in chunks, then every later token is fed as a decode of all sequences at once,
    or, every other step when `few` is given, of `few` sequences at a time."""
    drv = RunnerDriver(runner, chunk=24)
    for i, (seq, n) in enumerate(zip(sequences, n_prompt)):
        drv.add(str(i), seq[:n])
    rows: dict[str, list] = {str(i): [] for i in range(len(sequences))}
    for step in itertools.count():
        live = [rid for rid, r in drv.reqs.items() if r["computed"] < len(sequences[int(rid)]) - 1]
        if not live:
            break
        size = few if few and step % 2 else len(live)
        for i in range(0, len(live), size):
            so = drv.build(live[i : i + size])
            for rid, logits in drv.logits(so).items():
                r, seq = drv.reqs[rid], sequences[int(rid)]
                rows[rid].append(logits.float())
                r["computed"] += so.num_scheduled_tokens[rid]
                if r["computed"] == len(r["tokens"]) and r["computed"] < len(seq):
                    # the teacher's token, where sampling would put one
                    r["tokens"].append(seq[r["computed"]])
                    runner.batch.requests[rid].token_ids.append(seq[r["computed"]])
    drv.finish()
    return [torch.cat(rows[str(i)])[: len(seq) - 1] for i, seq in enumerate(sequences)]


@pytest.mark.slow
def test_bfloat16_teacher_forced_matches_transformers_bfloat16(smollm2_dir, smollm2_hf):
    """The same tokens fed to kiln in bfloat16 (compiled: chunked prefill, then batched decode) and to
    transformers in bfloat16 and float32: kiln's top-1 agrees with transformers' bfloat16 at >= 99 % of
    positions, and kiln's logits are no further from float32's than transformers' bfloat16 logits are.

    A position counts once however many prompts share its context (they all open with the same system
    prompt), and a top-1 tied in either bfloat16 logit row agrees with either of its tokens."""
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 9)
    sequences = [p + out for p, out in zip(prompts, hf_greedy_batch(smollm2_hf, prompts, 32))]
    torch._dynamo.reset()
    runner = build_runner(smollm2_dir, dtype="bfloat16", max_num_seqs=16, num_kv_blocks=128)
    runner.initialize_kv_cache(128)
    # Every other decode step of two sequences: where the CPU computes in bfloat16, those run the graph
    # for a few rows (matrix-vector reductions), the rest the one for more.
    ours = teacher_forced_logits(runner, sequences, [len(p) for p in prompts], few=2)
    assert ("few" in runner.policy.decode_graphs) == (runner.policy.few_rows >= 2)
    hf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    rows: dict[tuple, tuple] = {}  # context -> (ours, transformers bfloat16, float32)
    for seq, logits in zip(sequences, ours):
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([seq[:-1]])).logits[0].float()
            theirs = hf16(torch.tensor([seq[:-1]])).logits[0].float()
        for i in range(len(seq) - 1):
            rows.setdefault(tuple(seq[: i + 1]), (logits[i], theirs[i], ref[i]))
    a, b, ref = (torch.stack(t) for t in zip(*rows.values()))
    top_a, top_b = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
    agree = (b.gather(1, top_a) == b.amax(-1, keepdim=True)) | (
        a.gather(1, top_b) == a.amax(-1, keepdim=True)
    )
    assert agree.float().mean() >= 0.99, f"{int(agree.sum())} of {len(agree)} positions agree"
    scale = ref.abs().amax(-1)
    assert ((a - ref).abs().amax(-1) / scale).mean() <= ((b - ref).abs().amax(-1) / scale).mean()
    assert (a - ref).norm() <= (b - ref).norm()


def module_state(model: torch.nn.Module) -> dict:
    """Every module's own attributes (tensors, modules and callables by identity, the rest by value) and
    the attributes of its class: what would change if a step's choices were kept on the modules."""
    state = {}
    for name, m in model.named_modules():
        attrs = {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")}
        for table in ("_parameters", "_buffers", "_modules"):
            attrs.update({(table, k): v for k, v in getattr(m, table).items()})
        state[name] = {
            k: id(v) if isinstance(v, torch.Tensor | torch.nn.Module) or callable(v) else v
            for k, v in attrs.items()
        }
        state[name, "class"] = {k: id(v) for k, v in vars(type(m)).items()}
        # No method is replaced on the instance: an instance attribute never shadows its class's method.
        assert not [k for k in vars(m) if callable(getattr(type(m), k, None)) and not k.startswith("__")]
    return state


@pytest.mark.parametrize("quantization", ["none", "int4", "int4-sliced-head"])
def test_no_recompile_after_warmup(tiny_llama, monkeypatch, quantization):
    """Every kind of step (one row, a few, more, mixed with chunks) after the warm-up: nothing compiles,
    and no module or module class changes: a step's choices travel in its plan. A quantized head without
    its float copy (where oneDNN cannot pack one) de-quantizes slice by slice."""
    # Decode steps skip Dynamo's guards after the warm-up: check them anyway, on every call.
    monkeypatch.setattr(GuardFreeGraph, "check_guards", True)
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    monkeypatch.setattr(quant, "CHUNK_ROWS", 64)  # a quantized LM head of 320 rows in five slices
    sliced = quantization == "int4-sliced-head"
    if sliced:
        monkeypatch.setattr(quant, "packable", lambda device, dtype: False)
    runner = build_runner(
        tiny_llama,
        dtype="float32",
        max_num_seqs=12,
        num_kv_blocks=512,
        max_num_batched_tokens=64,
        max_model_len=256,
        quantization=quantization.removesuffix("-sliced-head"),
    )
    runner.initialize_kv_cache(512)
    before = module_state(runner.model)
    runner.warmup()
    graphs = runner.policy.decode_graphs
    # Decode graphs for one row and for more, and for a few: quantized up to 4 or 8 rows, reduced together;
    # in float32 on packed weights 2 rows, whose matmuls run on the weights as stored.
    few = quantization != "none" or runner.model.layers[0].attention.wqkv.prepacked is not None
    assert set(graphs) == ({"one", "few", "more"} if few else {"one", "more"})
    assert all(isinstance(g, guard_free.LayerGraphs) for g in graphs.values())
    # One graph for every layer of a kind: the layers differ in nothing their graphs specialise on.
    assert all(len({id(x) for x in g.graphs.values()}) == 1 for g in graphs.values())
    assert all(g.direct for g in graphs.values())  # straight into Inductor's modules
    if quantization != "none":  # one row reduces over the head's blocks, more multiply its float copy
        kernels = runner.policy.head.args[0]
        assert (runner.model.output.gemm is None) == sliced
        # Sliced, the five slices share one graph, called the same way, and a few rows reduce.
        assert [g.direct for g in kernels.slice_product.graphs.values()] == ([True] if sliced else [])
        assert [g.direct for g in kernels.matvec.graphs.values()] == ([True, True] if sliced else [True])
    # The step's ends likewise: the final norm (and a quantized embedding) for one row and for more.
    calls = runner.policy.calls
    ends = [c for c in (calls.norm, calls.embed) if isinstance(c, compile_policy._GuardFreeCalls)]
    assert calls.norm in ends
    assert all([g.direct for g in c.graphs.values()] == [True, True] for c in ends)
    torch.manual_seed(0)
    drv = RunnerDriver(runner, chunk=40)
    threads = torch.get_num_threads()  # changed on the way, as the load would: no step recompiles for it
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(12):  # each new prompt prefills beside the running decodes: mixed steps
            torch.set_num_threads(1 if i % 2 else threads)
            drv.add(str(i), torch.randint(0, 320, (3 + 7 * i,)).tolist())
            drv.step()
        for b in range(12, 0, -1):  # every decode batch size, contexts growing past a block-table bucket
            torch.set_num_threads(1 if b % 2 else threads)
            for _ in range(3):
                drv.step([str(i) for i in range(b)])
        torch.set_num_threads(threads)
    assert all(len(r["out"]) >= 1 for r in drv.reqs.values())
    assert module_state(runner.model) == before
    # Layers whose wrapper runs C++ kernels only are replayed on buffers recorded (KernelReplay): the
    # quantized reductions for a row or a few; not those calling oneDNN's or MKL's products.
    replays = {kind: _replays(g) for kind, g in graphs.items()}
    assert replays["more"] == []
    if quantization != "none":
        assert replays["one"] and replays["few"]
    assert all(any(isinstance(p, tuple) for p in r.plans.values()) for rs in replays.values() for r in rs)
    # The check can fail: the one-row graph's guards refuse a two-row step.
    two = [runner.batch.requests["0"], runner.batch.requests["1"]]
    step = runner.batch.prepare(two, [], {"0": 1, "1": 1})
    with pytest.raises(AssertionError, match="guards"):
        plan = runner.policy.plan(2, decode_only=True)
        runner.model(step.token_ids, step.positions, step.meta, plan, PartCalls(block=graphs["one"]))


def _replays(layer_graphs: guard_free.LayerGraphs) -> list[guard_free.KernelReplay]:
    graphs = set(layer_graphs.graphs.values())
    return [v for g in graphs for v in g.call.__globals__.values() if isinstance(v, guard_free.KernelReplay)]


def test_step_inputs_are_written_in_place_and_grow():
    inputs = StepInputs(torch.device("cpu"))
    first = inputs.put("x", [1, 2, 3])
    second = inputs.put("x", np.array([[4, 5], [6, 7]]))
    assert second.tolist() == [[4, 5], [6, 7]]
    assert second.data_ptr() == first.data_ptr() and first.tolist() == [4, 5, 6]  # one buffer, rewritten
    assert inputs.put("x", list(range(1000))).tolist() == list(range(1000))  # past the buffer: it grows
    assert inputs.put("y", []).shape == (0,) and inputs.put("z", np.zeros((0, 2))).shape == (0, 2)


def test_decode_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert decode_buckets(3) == [1, 2, 3]


@pytest.mark.parametrize(
    "fallback", ["dynamo compiled no graph", "inductor's module disagrees", "no guard-free calls"]
)
def test_decode_falls_back_to_the_wrapped_calls(fallback, tiny_llama, monkeypatch, caplog):
    if fallback == "dynamo compiled no graph":
        monkeypatch.setattr(GuardFreeGraph, "lookup", classmethod(lambda cls, fn, *args: None))
    elif fallback == "no guard-free calls":  # as on a torch that compiled/guard_free.py does not know
        monkeypatch.setattr(compile_policy, "GUARD_FREE", False)
    else:
        monkeypatch.setattr(guard_free, "_inductor_module", lambda compiled_fn: lambda *args: torch.zeros(1))
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    runner.initialize_kv_cache(64)
    drv = RunnerDriver(runner, chunk=64)
    drv.add("a", torch.randint(0, 320, (9,)).tolist())
    for _ in range(3):
        drv.step()
    assert len(drv.reqs["a"]["out"]) == 3
    if fallback == "dynamo compiled no graph":
        assert runner.policy.decode_graphs == {"one": call_module}
        assert caplog.text.count("keep Dynamo's guarded calls") == 1  # looked up once, not every step
    elif fallback == "no guard-free calls":
        assert runner.policy.decode_graphs == {} and runner.policy.calls == PartCalls()
    else:
        assert [g.direct for g in runner.policy.decode_graphs.values()] == [False]
        assert "keep AOTAutograd's runtime wrapper" in caplog.text


def test_the_direct_call_self_check_catches_a_lost_kv_write(tiny_llama):
    """A direct call that returns the right hidden states but leaves the cache unwritten fails the check."""
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=4, num_kv_blocks=16, enforce_eager=True)
    runner.initialize_kv_cache(16)
    drv = RunnerDriver(runner)
    drv.add("a", torch.randint(0, 320, (9,)).tolist())
    drv.step()
    so = drv.build()
    runner.batch.update(so)
    step = runner.batch.prepare(
        *runner.batch.split(so.num_scheduled_tokens, so.spec_tokens), so.num_scheduled_tokens
    )
    layer = runner.model.layers[0]
    h = runner.model.tok_embeddings(step.token_ids)
    model = runner.model
    plan = runner.policy.plan(1, decode_only=True)
    args = (layer, h, model.rope_cos[step.positions], model.rope_sin[step.positions], step.meta, plan)

    def layer_step(layer, *rest):
        return layer(*rest)

    def lost_write(layer, *rest):
        attn = layer.attention
        kept = attn.k_cache, attn.v_cache
        attn.k_cache, attn.v_cache = kept[0].clone(), kept[1].clone()  # the write lands in a copy
        try:
            return layer(*rest)
        finally:
            attn.k_cache, attn.v_cache = kept

    with torch.no_grad():
        assert guard_free.same_layer_step(layer_step, layer_step, *args)
        assert not guard_free.same_layer_step(layer_step, lost_write, *args)


def test_the_vector_isa_probe_imports_nothing_on_its_thread():
    """The probe runs while the engine core imports transformers' lazy config classes: a module imported on
    two threads at once can reach one of them half-made ("Could not import module 'LlamaConfig'")."""
    code = textwrap.dedent("""
        import sys, threading
        from compiled import compile_policy
        imports = []
        class Recorder:
            def find_spec(self, name, path=None, target=None):
                imports.append((threading.current_thread().name, name))
        sys.meta_path.insert(0, Recorder())
        compile_policy.probe_vector_isa().join()
        print([name for thread, name in imports if thread.startswith("kiln-isa")], len(imports))
    """)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    on_probe, total = run.stdout.rsplit(" ", 1)
    assert on_probe == "[]"
    assert int(total) > 0  # the recorder saw the caller's imports


def test_an_eager_worker_imports_neither_dynamo_nor_inductor(tiny_llama, tmp_path, monkeypatch):
    """An engine core that runs its model eagerly prepares no compile: its worker's modules and its steps
    (chunks, decodes) import neither Dynamo nor Inductor, seconds of every eager start, nor transformers
    once the model's config is kept; one that compiles imports what its first compile needs while it waits
    for its config."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # the subprocess's too
    load_config(tiny_llama)  # a first start's
    code = textwrap.dedent(f"""
        import sys
        from engine.executor import prepare_worker
        from server.bench.driver import RunnerDriver, build_runner
        prepare_worker("eager")
        runner = build_runner({tiny_llama!r}, max_num_seqs=4, num_kv_blocks=8, enforce_eager=True)
        runner.initialize_kv_cache(8)
        drv = RunnerDriver(runner, chunk=8)
        drv.add("a", list(range(1, 20)))
        drv.add("b", [5, 6, 7])
        for _ in range(4):
            drv.step()
        heavy = ("torch._dynamo", "torch._inductor", "transformers")
        print(sorted({{m for m in sys.modules if m.startswith(heavy)}}))
        prepare_worker("compile")
        print("torch._inductor.compile_fx" in sys.modules)
    """)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["[]", "True"]
