"""The CUDA compile decisions, checked on a CPU: what is compiled and how, what the CUDA graphs may treat as
fixed, and which shapes the warm-up captures. A CUDA policy is built around a model that lives on the CPU;
nothing here launches a CUDA kernel."""

from __future__ import annotations

import operator

import pytest
import torch

from compiled import compile_policy
from compiled.compile_policy import CUDA_GRAPH_RUNS, CompilePolicy
from compiled.input_batch import InputBatch
from compiled.models import linear
from compiled.plan import MatmulPlan
from server.bench.driver import RunnerDriver, build_runner

CUDA = torch.device("cuda")


def cuda_policy(runner, monkeypatch, backend=None) -> tuple[CompilePolicy, list[tuple]]:
    """A CUDA compile policy over `runner`'s CPU model, with every torch.compile call recorded (what it
    compiled and with which options) and run by `backend` in place of Inductor."""
    calls, real_compile = [], torch.compile

    def recording_compile(fn, **options):
        calls.append((fn, options))
        if backend is None:
            return fn
        return real_compile(fn, backend=backend, fullgraph=options.get("fullgraph", False))

    monkeypatch.setattr(torch, "compile", recording_compile)
    policy = CompilePolicy(runner.model, CUDA, enforce_eager=False, dtype=runner.dtype)
    monkeypatch.setattr(torch, "compile", real_compile)
    return policy, calls


def test_the_cuda_decode_forward_is_compiled_whole_under_cuda_graphs(tiny_llama, monkeypatch):
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=4, num_kv_blocks=16, enforce_eager=True)
    policy, calls = cuda_policy(runner, monkeypatch)
    whole = [options for fn, options in calls if fn == runner.model.forward]
    assert whole == [{"mode": "reduce-overhead", "fullgraph": True}]
    # Every per-layer graph (prefill and mixed steps) is one graph too: a break would run eagerly between.
    assert all(options.get("fullgraph") for _, options in calls)
    assert all(plan.decode_attention == "reduction" for plan in policy.plans.values())


def attentions(runner) -> list:
    return [layer.attention for layer in runner.model.layers]


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The graph input a view chain starts from."""
    while node.op != "placeholder" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def test_the_cuda_decode_forward_is_one_graph_whose_mutated_inputs_are_static(tiny_llama, monkeypatch):
    """CUDA graphs replay into fixed addresses: every input the decode graph writes (the KV caches) must be
    a static input of the graph, or its writes would land in a copy."""
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=4, num_kv_blocks=16, enforce_eager=True)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    policy, _ = cuda_policy(runner, monkeypatch, backend)
    runner.policy = policy
    runner.initialize_kv_cache(16)
    caches = [c for a in attentions(runner) for c in (a.k_cache, a.v_cache)]
    assert all(torch._dynamo.utils.get_static_address_type(c) for c in caches)
    drv = RunnerDriver(runner)
    for i, n in enumerate((5, 9, 3)):
        drv.add(str(i), list(range(1, n + 1)))
    drv.step()  # prefill, through the per-layer graphs
    graphs.clear()
    drv.step()  # a decode step of three rows, through the whole-model graph
    assert len(graphs) == 1, f"the decode forward compiled to {len(graphs)} graphs"
    graph = graphs[0].graph
    written = {
        _root(node.args[0])
        for node in graph.nodes
        if node.target is operator.setitem
        or (node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__"))
        or (node.op == "call_function" and getattr(node.target, "__name__", "").endswith("_"))
    }
    assert len(written) == len(caches) and all(n.op == "placeholder" for n in written)
    static = [n for n in written if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    assert len(static) == len(caches), f"{len(caches) - len(static)} written inputs are not static"
    torch._dynamo.reset()


def test_the_warmup_captures_every_cuda_decode_shape_serving_can_meet(tiny_llama, monkeypatch):
    """Every (bucket, block-table width) a decode step can take on CUDA is run at least twice in the warm-up
    (cudagraph trees record a shape on its second call), so no step records or compiles while serving."""
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=24, max_model_len=300, enforce_eager=True)
    policy, _ = cuda_policy(runner, monkeypatch)
    batch = InputBatch(24, runner.max_blocks_per_seq, runner.block_size, CUDA)
    served = {
        (batch.decode_rows(n), batch.decode_width(length))
        for n in range(1, 25)
        for length in range(1, runner.max_model_len + 1)
    }
    runs: dict[tuple[int, int], int] = {}
    for step in policy.warmup_shapes(batch, runner.max_model_len):
        if not step.chunk_lens:
            shape = (batch.decode_rows(step.num_single), batch.decode_width(step.context))
            runs[shape] = runs.get(shape, 0) + step.runs
    assert served == set(runs)
    assert min(runs.values()) >= 2 and CUDA_GRAPH_RUNS >= 2
    assert len(batch.decode_widths()) > 2  # the widths really vary over this context


def test_flags_leave_out_settings_the_running_torch_lacks(monkeypatch):
    monkeypatch.setitem(compile_policy.DYNAMO_FLAGS, "a_setting_no_torch_has", True)
    with compile_policy.flags():
        assert torch._dynamo.config.specialize_float is True
    assert not hasattr(torch._dynamo.config, "a_setting_no_torch_has")


def test_every_warmup_step_fits_a_batch_of_one_sequence(tiny_llama, monkeypatch):
    runner = build_runner(tiny_llama, dtype="float32", max_num_seqs=1, num_kv_blocks=16, enforce_eager=True)
    cpu = CompilePolicy(runner.model, torch.device("cpu"), enforce_eager=False, dtype=runner.dtype)
    cuda, _ = cuda_policy(runner, monkeypatch)
    for policy in (cpu, cuda):
        batch = InputBatch(1, runner.max_blocks_per_seq, runner.block_size, policy.device)
        plan = policy.warmup_shapes(batch, runner.max_model_len)
        assert plan and all(batch.decode_rows(s.num_single) == 1 for s in plan)


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_each_kind_of_step_has_the_plan_its_device_and_dtype_call_for(tiny_llama, monkeypatch, fast_bf16):
    """bfloat16 on packed weights: where the CPU lacks bfloat16 arithmetic every matmul multiplies in
    float32, the few-row ones on the weights as stored; on CUDA nothing is packed, upcast or weight-left."""
    if fast_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs bfloat16 only where every CPU with bfloat16 arithmetic can: not this one")
    monkeypatch.setattr(linear, "CPU_HAS_FAST_BF16", fast_bf16)
    runner = build_runner(tiny_llama, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=16, enforce_eager=True)
    assert runner.model.layers[0].attention.wqkv.prepacked is not None
    cpu = CompilePolicy(runner.model, torch.device("cpu"), enforce_eager=False, dtype=torch.bfloat16)
    plans = {kind: plan.linear for kind, plan in cpu.plans.items()}
    upcast = not fast_bf16
    assert plans["one"] == MatmulPlan(matvec=True)
    assert plans["more"] == MatmulPlan(packed=True, weight_left=True, upcast=upcast)
    assert plans["few"] == (
        MatmulPlan(matvec=True) if fast_bf16 else MatmulPlan(weight_left=True, upcast=True)
    )
    assert plans["prefill"] == MatmulPlan(packed=fast_bf16, upcast=upcast)
    assert cpu.few_rows == 2 and cpu.plan(2, decode_only=True).kind == "few"
    assert cpu.head_plan(1) == plans["one"] and cpu.head_plan(2) == plans["more"]  # the head is packed
    cuda, _ = cuda_policy(runner, monkeypatch)
    assert {kind: plan.linear for kind, plan in cuda.plans.items()} == {
        "one": MatmulPlan(matvec=True),
        "few": MatmulPlan(matvec=True),
        "more": MatmulPlan(packed=True),  # nothing is packed on CUDA: F.linear
        "prefill": MatmulPlan(),
    }
    assert cuda.few_rows == 1
    eager = CompilePolicy(runner.model, torch.device("cpu"), enforce_eager=True, dtype=torch.bfloat16)
    assert eager.plans["one"].linear == eager.plans["more"].linear == plans["more"]
    assert {plan.decode_attention for plan in eager.plans.values()} == {"matmul"}
