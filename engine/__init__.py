"""kiln's "decide" box: the front end (LLM, AsyncLLM, input and output processing, the core client) and
the engine core (scheduler, KV-cache manager, block pool). Nothing here imports torch: the worker is
reached by name (engine/executor.py), so a server or `LLM` process never pays for it."""

from engine.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # The front ends pull in the client and tokenizer stack; import them only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
