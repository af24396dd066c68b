"""kiln's "decide" box: front end (LLM, detokenizer, clients) and the engine core
(scheduler, KV-cache manager, block pool). Nothing here imports torch at module level:
the front end must stay light and single-threaded."""

from engine.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in the client and tokenizer stack; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
