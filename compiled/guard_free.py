"""Calling a graph Dynamo compiled without its guard check, and past AOTAutograd's runtime wrapper.

Every call of a compiled decode layer pays Dynamo's guard check and frame hooks, then AOTAutograd's
runtime wrapper (version counters, grad mode, output checks) before Inductor's module runs, once per
layer. A decode step of a given kind always runs the graph the warm-up compiled for that kind, so the
runner looks it up once and calls it directly from then on. This reads Dynamo's cache entries and
Inductor's compiled module, which are not public API: it is used only on the torch versions it was
verified on (`SUPPORTED`), and each direct call path is kept only after a self-check on the lookup's
arguments. Layers that differ in what their graph was specialised on each keep their own (LayerGraphs).
The compile policy imports this module only where it exists: a torch upgrade it breaks deletes the file.
"""

from __future__ import annotations

import inspect
import logging
import types
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
        if verify(self.call, direct):
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
    return lambda *args: module(list(args))


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
