"""kiln's "decide" box: the front end (LLM, AsyncLLM, input and output processing, the core client) and
the engine core (scheduler, KV-cache manager, block pool). Nothing here imports torch: the worker is
reached by name (engine/executor.py), so a server or `LLM` process never pays for it."""

import importlib

from engine.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams"]
# The front ends pull in the client and tokenizer stack; import them only when asked for.
_LAZY = {"LLM": "engine.llm", "AsyncLLM": "engine.async_llm"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(_LAZY[name]), name)
