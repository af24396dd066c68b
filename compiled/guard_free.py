"""Calling a graph Dynamo compiled without its guard check, and past AOTAutograd's runtime wrapper.

Every call of a compiled decode layer pays Dynamo's guard check and frame hooks, then AOTAutograd's
runtime wrapper (version counters, grad mode, output checks) before Inductor's module runs, once per
layer. A decode step of a given kind always runs the graph the warm-up compiled for that kind, so the
runner looks it up once and calls it directly from then on. This reads Dynamo's cache entries and
Inductor's compiled module, which are not public API: it is used only on the torch versions it was
verified on (`SUPPORTED`), and each direct call path is kept only after a self-check on the lookup's
arguments. Layers that differ in what their graph was specialised on each keep their own (LayerGraphs).
The compile policy imports this module only where it exists: a torch upgrade it breaks deletes the file.

Past that, a CPU module whose wrapper only allocates buffers and runs C++ kernels is replayed
(`KernelReplay`): its kernels called again on the buffers of an earlier call.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
import types
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor, nn

from compiled.attention import AttentionMetadata, write_kv
from compiled.plan import StepPlan

logger = logging.getLogger("kiln.runner")

SUPPORTED = ("2.13.",)


def supported() -> bool:
    return torch.__version__.startswith(SUPPORTED)


class GuardFreeGraph:
    """One graph Dynamo compiled for `fn`, called through Dynamo's own bytecode without its guard check;
    `direct` once that bytecode calls Inductor's module straight (`go_direct`).

    Invariant: the arguments of every call pass that graph's guards (`check_guards` asserts it, in tests).
    """

    check_guards = False

    def __init__(self, fn: Callable, entry: object) -> None:
        self.fn, self.entry = fn, entry
        self.signature = inspect.signature(fn)
        self.guards = entry.guard_manager
        self.call = types.FunctionType(entry.code, fn.__globals__, fn.__name__)
        self.direct = False

    @classmethod
    def lookup(cls, fn: Callable, *args: object) -> GuardFreeGraph | None:
        """The graph Dynamo runs for fn(*args); None when it runs none (e.g. past its recompile limit)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        f_locals = inspect.signature(fn).bind(*args).arguments
        entry = next((e for e in _debug_get_cache_entry_list(fn) if e.guard_manager.check(f_locals)), None)
        return None if entry is None or entry.code.co_freevars else cls(fn, entry)

    def go_direct(self, verify: Callable[[Callable, Callable], bool]) -> None:
        """Call Inductor's module from Dynamo's bytecode, if `verify(wrapped_call, direct_call)` holds."""
        g = self.fn.__globals__
        modules = {
            n: _inductor_module(g[n]) for n in self.entry.code.co_names if n.startswith("__compiled_fn")
        }
        if len(modules) != 1 or None in modules.values():
            return
        direct = types.FunctionType(self.entry.code, {**g, **modules}, self.fn.__name__)
        # A replayed module runs its wrapper, records, then replays: the replay is checked on buffers
        # filled with NaN, so a kernel it skipped or misrouted cannot pass on what the recording left.
        replays = [m for m in modules.values() if isinstance(m, KernelReplay)]
        ok = all(verify(self.call, direct) for _ in range(KernelReplay.CALLS_TO_REPLAY - 1))
        for replay in replays:
            replay.poison = True
        try:
            ok = ok and verify(self.call, direct)
        finally:
            for replay in replays:
                replay.poison = False
        if ok:
            self.call, self.direct = direct, True
        else:
            logger.warning(
                "decode layers keep AOTAutograd's runtime wrapper: Inductor's module failed the self-check"
            )

    def __call__(self, *args: object) -> Tensor:
        if self.check_guards:
            verdict = self.guards.check_verbose(self.signature.bind(*args).arguments)
            assert verdict.result, (
                f"a guard-free call would fail its graph's guards: {verdict.verbose_code_parts}"
            )
        return self.call(*args)


def _inductor_module(compiled_fn: Callable) -> Callable | None:
    """The module Inductor compiled under AOTAutograd's wrappers, as a function of the same arguments."""
    inner = compiled_fn
    while getattr(inner, "__wrapped__", None) is not None:
        inner = inner.__wrapped__
    module = getattr(inner, "current_callable", None)
    if module is None or not getattr(inner, "_boxed_call", False):
        return None
    if KernelReplay.replayable(module):
        return KernelReplay(module)
    return lambda *args: module(list(args))


class KernelReplay:
    """Inductor's CPU module for one graph, its C++ kernels called again on an earlier call's buffers.

    Inductor's wrapper allocates each intermediate buffer of a call afresh (dozens in a decode layer, a
    share of a one-row step). Where it does nothing else (`replayable`: allocations, views of them and
    C++ kernels, no size read from a tensor), every size follows from the call's integer arguments; the
    kernels' arguments are recorded once per set of them, and later calls pass the recorded
    intermediates again with the inputs swapped in and each output allocated anew.

    Invariant: no reused buffer leaves a call (the outputs' allocations are made anew in each replay,
    with their views), so reusing them is safe while calls do not overlap: the engine runs one step at a
    time in a process.
    """

    # Run, record, replay: sizes seen once may not come again (a batch's pages grow step by step).
    CALLS_TO_REPLAY = 3
    PLANS = 16  # sets of sizes kept; each holds its intermediates
    # A call with larger intermediates is not replayed: its kernels outweigh the allocations many times.
    KEPT_BYTES = 1 << 20
    _WRAPPER_CALLS = ("empty_strided_cpu", "reinterpret_tensor")

    def __init__(self, module: Callable) -> None:
        self.module, self.globals = module, module.__func__.__globals__
        self.poison = False  # fill kept and new float buffers with NaN before a replay (its self-check)
        self.plans: OrderedDict[tuple, object] = OrderedDict()  # by the arguments that are not tensors
        self.sizes: list[int] | None = None  # their positions: the graph's dynamic sizes

    @classmethod
    def replayable(cls, module: Callable) -> bool:
        """Whether the wrapper calls nothing but allocations, views and C++ kernels (and `args.clear`), the
        kernels as statements on positional arguments, and reads no attribute but torch's dtypes: no size
        or stride read from a tensor."""
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(module.__func__)))
        except (AttributeError, OSError, TypeError, SyntaxError):
            return False

        # A kernel's result would be replayed as recorded: kernels are called as statements.
        statements = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}

        def allowed(node: ast.AST) -> bool:
            if isinstance(node, ast.Attribute):
                owner = getattr(node.value, "id", "")
                return owner == "torch" or (owner == "args" and node.attr == "clear")
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id.startswith("cpp_fused"):
                    plain = not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
                    return plain and id(node) in statements
                if isinstance(f, ast.Name):
                    return f.id in cls._WRAPPER_CALLS
                return isinstance(f, ast.Attribute) and f.attr == "clear"  # args.clear(), checked above
            return True

        return all(allowed(node) for node in ast.walk(tree))

    def __call__(self, *args: object) -> tuple[Tensor, ...]:
        if self.sizes is None:
            self.sizes = [i for i, a in enumerate(args) if not isinstance(a, Tensor)]
        key = tuple([args[i] for i in self.sizes])
        plan = self.plans.get(key)
        if isinstance(plan, tuple):
            self.plans.move_to_end(key)
            return self._replay(plan, args)
        if plan is None:  # sizes not seen before
            self._keep(key, _SEEN)
            return self.module(list(args))
        if plan is _NEVER:
            return self.module(list(args))
        outputs, plan = self._record(args)
        self._keep(key, plan)
        return outputs

    def _keep(self, key: tuple, plan: object) -> None:
        self.plans[key] = plan
        while len(self.plans) > self.PLANS:
            self.plans.popitem(last=False)

    def _replay(self, plan: tuple, args: tuple) -> tuple[Tensor, ...]:
        making, calls, outputs = plan
        empty, view = self.globals["empty_strided_cpu"], self.globals["reinterpret_tensor"]
        made: list[Tensor] = []
        for base, spec in making:
            made.append(empty(*spec) if base is None else view(made[base], *spec))
        if self.poison:
            for t in made + [x for _, template, _, _ in calls for x in template if isinstance(x, Tensor)]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        for kernel, template, inputs, fresh in calls:
            a = template.copy()
            for at, i in inputs:
                a[at] = args[i]
            for at, j in fresh:
                a[at] = made[j]
            kernel(*a)
        return tuple(made[j] for j in outputs)

    def _record(self, args: tuple) -> tuple[tuple[Tensor, ...], object]:
        """One call through the wrapper, its allocations, views and kernel calls logged, and the plan to
        replay it. The outputs' allocations, and the views of them, are made anew in each replay; _NEVER
        where an output or a view is not of an allocation (one of an input would keep the recorded one),
        where one tensor is two inputs, or where the intermediates are large."""
        names = [n for n in self.globals if n in self._WRAPPER_CALLS or n.startswith("cpp_fused")]
        saved = {n: self.globals[n] for n in names}
        made, kernel_calls = [], []  # (base or None, spec, tensor): the objects kept, their ids unique

        def allocate(*spec: object) -> Tensor:
            made.append((None, spec, saved["empty_strided_cpu"](*spec)))
            return made[-1][2]

        def view(base: Tensor, *spec: object) -> Tensor:
            made.append((base, spec, saved["reinterpret_tensor"](base, *spec)))
            return made[-1][2]

        def logged(kernel: Callable) -> Callable:
            return lambda *a: (kernel_calls.append((kernel, a)), kernel(*a))[1]

        self.globals.update({n: logged(f) for n, f in saved.items() if n.startswith("cpp_fused")})
        self.globals.update(empty_strided_cpu=allocate, reinterpret_tensor=view)
        try:
            outputs = self.module(list(args))
        finally:
            self.globals.update(saved)
        root = {}  # id of each allocation and view -> id of the allocation under it
        for base, _, t in made:
            root[id(t)] = id(t) if base is None else root.get(id(base))
        if None in root.values() or not all(id(o) in root for o in outputs):
            return outputs, _NEVER
        anew = {root[id(o)] for o in outputs}
        kept = sum(t.untyped_storage().nbytes() for base, _, t in made if base is None and id(t) not in anew)
        if kept > self.KEPT_BYTES:
            return outputs, _NEVER
        making, index = [], {}  # what each replay makes, in the recorded order
        for base, spec, t in made:
            if root[id(t)] in anew:
                index[id(t)] = len(making)
                making.append((None if base is None else index[id(base)], spec))
        inputs = {id(a): i for i, a in enumerate(args) if isinstance(a, Tensor)}
        if len(inputs) < sum(isinstance(a, Tensor) for a in args):  # one tensor at two positions
            return outputs, _NEVER
        calls = []
        for kernel, a in kernel_calls:
            ins = [(at, inputs[id(x)]) for at, x in enumerate(a) if id(x) in inputs]
            fresh = [(at, index[id(x)]) for at, x in enumerate(a) if id(x) in index]
            template = list(a)
            for at, _ in ins + fresh:
                template[at] = None
            calls.append((kernel, template, ins, fresh))
        return outputs, (making, calls, [index[id(o)] for o in outputs])


_SEEN, _NEVER = object(), object()  # KernelReplay's plans: sizes seen once; a call it cannot replay


class LayerGraphs:
    """Each layer's guard-free graph for one kind of decode step: layers that differ in what their graph
    was specialised on (a local attention window beside global ones) have graphs of their own."""

    def __init__(self, graphs: dict[nn.Module, GuardFreeGraph]) -> None:
        self.graphs = graphs

    @classmethod
    def lookup(cls, calls: list[tuple]) -> LayerGraphs | None:
        """The graphs of these layer calls (layer, *args) of one step, each distinct graph verified once
        (`go_direct`, by `same_layer_step`); None when Dynamo runs no graph for one of them."""
        graphs: dict[object, GuardFreeGraph] = {}  # by Dynamo's compiled code: one per graph
        layers = {}
        for call in calls:
            graph = GuardFreeGraph.lookup(type(call[0]).forward, *call)
            if graph is None:
                return None
            if graph.entry.code not in graphs:
                graph.go_direct(lambda wrapped, direct, call=call: same_layer_step(wrapped, direct, *call))
                graphs[graph.entry.code] = graph
            layers[call[0]] = graphs[graph.entry.code]
        return cls(layers)

    def __call__(self, layer: nn.Module, *args: object) -> Tensor:
        return self.graphs[layer](layer, *args)

    @property
    def direct(self) -> bool:
        """Every layer's graph calls Inductor's module directly."""
        return all(graph.direct for graph in self.graphs.values())


def same_layer_step(
    wrapped: Callable,
    direct: Callable,
    layer: nn.Module,
    h: Tensor,
    cos: Tensor,
    sin: Tensor,
    meta: AttentionMetadata,
    plan: StepPlan,
) -> bool:
    """Whether `direct` computes what `wrapped` does on one layer step: the same hidden states, and the
    same K/V in the slots it writes (poisoned with NaN first, so a lost write cannot pass)."""
    attn, slots = layer.attention, meta.slot_mapping
    blocks = (slots // attn.v_cache.shape[3]).unique()
    expected = wrapped(layer, h, cos, sin, meta, plan)
    kv = attn.k_cache[blocks].clone(), attn.v_cache[blocks].clone()
    nan = torch.full(
        (slots.shape[0], attn.n_kv_heads, attn.head_dim), float("nan"), dtype=h.dtype, device=h.device
    )
    write_kv(attn.k_cache, attn.v_cache, nan, nan, slots)
    got = direct(layer, h, cos, sin, meta, plan)
    # Close, not equal: BLAS may round differently from call to call. Slots nobody wrote may hold NaN
    # garbage on both sides; a lost write leaves NaN where the wrapped call wrote a number.
    same_kv = all(
        torch.allclose(a, b, equal_nan=True) for a, b in zip((attn.k_cache[blocks], attn.v_cache[blocks]), kv)
    )
    ok = isinstance(got, Tensor) and got.shape == expected.shape and torch.allclose(got, expected) and same_kv
    if not same_kv:  # leave the cache as the wrapped call wrote it
        attn.k_cache[blocks], attn.v_cache[blocks] = kv
    return ok
