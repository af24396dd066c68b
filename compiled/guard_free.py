"""Calling a graph Dynamo compiled without its guard check, and past AOTAutograd's runtime wrapper.

Every call of a compiled decode layer pays Dynamo's guard check and frame hooks, then AOTAutograd's
runtime wrapper (version counters, grad mode, output checks) before Inductor's module runs, once per
layer. A decode step of a given kind always runs the graph the warm-up compiled for that kind, so the
runner looks it up once and calls it directly from then on. This reads Dynamo's cache entries and
Inductor's compiled module, which are not public API: it is used only on the torch versions it was
verified on (`SUPPORTED`), and each direct call path is kept only after a self-check on the lookup's
arguments.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable

import torch
from torch import Tensor

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
