"""KernelReplay: an Inductor CPU module's kernels called again on an earlier call's intermediate buffers."""

import pytest
import torch

from compiled import guard_free
from compiled.compile_policy import INDUCTOR_FLAGS
from compiled.guard_free import GuardFreeGraph, KernelReplay


def _norm_and_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reductions and a softmax: a wrapper with several intermediate buffers and C++ kernels only."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = (h[:, :, None] * w[None]).sum(1)
    return torch.softmax(y, -1) + h.sum()


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w)  # the product is an extern kernel's call in the wrapper


def _exp_and_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.exp(x) + 1
    return y, y[1:]  # the second output a view of the first


def _direct(fn, *args) -> tuple[GuardFreeGraph, list[KernelReplay]]:
    """fn compiled as the runner compiles, its graph called directly (verified as the runner verifies it),
    and its replays."""
    torch.compile(fn, dynamic=True, fullgraph=True, options=dict(INDUCTOR_FLAGS))(*args)
    graph = GuardFreeGraph.lookup(fn, *args)
    graph.go_direct(lambda wrapped, direct: all(map(torch.allclose, wrapped(*args), direct(*args))))
    assert graph.direct
    return graph, [v for v in graph.call.__globals__.values() if isinstance(v, KernelReplay)]


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.setattr(GuardFreeGraph, "check_guards", True)
    torch._dynamo.reset()


def _allocations(replay: KernelReplay, monkeypatch) -> list[tuple]:
    made = []
    empty = replay.globals["empty_strided_cpu"]
    monkeypatch.setitem(replay.globals, "empty_strided_cpu", lambda *a: made.append(a) or empty(*a))
    return made


def test_replayed_calls_compute_what_the_wrapper_does_into_fresh_outputs(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    graph, [replay] = _direct(lambda x, w: (_norm_and_project(x, w),), torch.randn(3, 8), w)
    made = _allocations(replay, monkeypatch)
    kept = []
    # Sizes seen first run the wrapper, then record, then replay (3 rows: already in go_direct's check).
    for rows, allocations in ((3, 1), (5, None), (5, None), (5, 1), (3, 1), (5, 1)):
        made.clear()
        x = torch.randn(rows, 8)
        (y,) = graph(x, w)
        torch.testing.assert_close(y, _norm_and_project(x, w))
        if allocations is not None:  # a replay allocates its output, nothing else
            assert len(made) == allocations
        else:
            assert len(made) > 1
        kept.append((y, y.clone()))
    assert all(torch.equal(y, copy) for y, copy in kept)  # no later call wrote an earlier output
    assert sum(isinstance(plan, tuple) for plan in replay.plans.values()) == 2  # both sizes recorded


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(KernelReplay, "PLANS", 2)
    w = torch.randn(8, 16)
    graph, [replay] = _direct(lambda x, w: (_norm_and_project(x, w),), torch.randn(3, 8), w)
    for rows in (4, 4, 5, 5, 6, 6, 7):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(graph(x, w)[0], _norm_and_project(x, w))
    assert [key[0] for key in replay.plans] == [6, 7]  # the latest two sizes


def test_a_wrapper_calling_other_kernels_is_not_replayed():
    x, w = torch.randn(3, 8), torch.randn(8, 16)
    graph, replays = _direct(lambda x, w: (_matmul(x, w),), x, w)
    assert replays == []  # called directly, through its wrapper
    torch.testing.assert_close(graph(x, w)[0], _matmul(x, w))


def test_outputs_that_view_another_are_made_anew_with_their_views():
    graph, [replay] = _direct(_exp_and_view, torch.randn(4, 3))
    kept = []
    for _ in range(4):
        x = torch.randn(4, 3)
        y, tail = graph(x)
        torch.testing.assert_close(y, torch.exp(x) + 1)
        assert tail.data_ptr() == y[1:].data_ptr()  # a view of the first output, as the wrapper's was
        kept.append((y, y.clone()))
    assert all(torch.equal(y, copy) for y, copy in kept)
    assert [isinstance(plan, tuple) for plan in replay.plans.values()] == [True]


def test_calls_with_large_intermediates_run_their_wrapper(monkeypatch):
    monkeypatch.setattr(KernelReplay, "KEPT_BYTES", 0)
    w = torch.randn(8, 16)
    graph, [replay] = _direct(lambda x, w: (_norm_and_project(x, w),), torch.randn(3, 8), w)
    made = _allocations(replay, monkeypatch)
    x = torch.randn(3, 8)
    torch.testing.assert_close(graph(x, w)[0], _norm_and_project(x, w))
    assert len(made) > 1 and list(replay.plans.values()) == [guard_free._NEVER]


empty_strided_cpu = cpp_fused_0 = None  # the names the wrappers below call


class _Wrappers:
    """Wrapper sources as Inductor writes them: one reads a size from a tensor, one gets it as an argument."""

    def reads_a_size(self, args):
        arg0_1 = args[0]
        args.clear()
        s0 = arg0_1.shape[0]
        buf0 = empty_strided_cpu((s0,), (1,), torch.float32)
        cpp_fused_0(arg0_1, buf0, s0)
        return (buf0,)

    def uses_a_kernels_result(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        buf0 = empty_strided_cpu((arg1_1,), (1,), torch.float32)
        done = cpp_fused_0(arg0_1, buf0, arg1_1)
        return (buf0, done)

    def passes_a_keyword(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        buf0 = empty_strided_cpu((arg1_1,), (1,), torch.float32)
        cpp_fused_0(arg0_1, out=buf0)
        return (buf0,)

    def takes_its_size(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        s0 = arg1_1
        buf0 = empty_strided_cpu((s0,), (1,), torch.float32)
        cpp_fused_0(arg0_1, buf0, s0)
        return (buf0,)


def test_a_wrapper_that_reads_a_tensors_size_is_not_replayed():
    """Its sizes would not all come from the arguments the plans are keyed by."""
    assert not KernelReplay.replayable(_Wrappers().reads_a_size)
    assert KernelReplay.replayable(_Wrappers().takes_its_size)


def test_a_wrapper_that_uses_a_kernels_result_or_keywords_is_not_replayed():
    assert not KernelReplay.replayable(_Wrappers().uses_a_kernels_result)
    assert not KernelReplay.replayable(_Wrappers().passes_a_keyword)


def test_the_self_check_catches_a_replay_that_skips_its_kernels(monkeypatch):
    """The replaying call is checked (on buffers filled with NaN): a replay that runs no kernel fails it,
    and the graph keeps its wrapper."""
    replay = KernelReplay._replay
    monkeypatch.setattr(
        KernelReplay, "_replay", lambda self, plan, args: replay(self, (plan[0], [], plan[2]), args)
    )

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (_norm_and_project(x, w),)

    x, w = torch.randn(3, 8), torch.randn(8, 16)
    torch.compile(fn, dynamic=True, fullgraph=True, options=dict(INDUCTOR_FLAGS))(x, w)
    graph = GuardFreeGraph.lookup(fn, x, w)
    graph.go_direct(lambda wrapped, direct: all(map(torch.allclose, wrapped(x, w), direct(x, w))))
    assert not graph.direct
