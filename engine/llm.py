"""The offline Python API: LLM, a blocking front end that generates for a batch of prompts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core_client import SyncCoreClient
from engine.errors import EngineDeadError, InvalidRequestError
from engine.front_end import FrontEnd
from engine.input_processor import Conversation, Prompt
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from engine.params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "EmbeddingRequestOutput",
    "EngineDeadError",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


class LLM(FrontEnd):
    """Offline generation. `LLM()` serves the embedded default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(dtype="float32")
    >>> out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        super().__init__(model, SyncCoreClient, engine_args)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in input order."""
        return self._run(_prompt_list(prompts), sampling_params, use_tqdm)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], normalize: bool = True, use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (its final hidden states pooled as `--pooling` says), in input order."""
        outs = self._run(_prompt_list(prompts), self.embedding_params(normalize), use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
            for o in outs
        ]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (which renders
        `tools`, OpenAI-style function definitions, where it has a syntax for them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = [self.chat_prompt(c, add_generation_prompt, kwargs or None) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[Prompt], params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params)} sampling params for {len(prompts)} prompts", "sampling_params"
            )
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request = self.process(prompt, p)
                order[request.request_id] = i
                self.output_processor.add_request(request)
                self.client.add_request(request.core_request)
            return self._collect(order, use_tqdm)
        except BaseException:
            # Bad input, Ctrl-C or a dead engine: nothing of this call may stay in the engine.
            for rid in order:
                self.client.abort_requests(self.output_processor.abort(rid))
            raise

    def _collect(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(
            total=len(order),
            desc="Processed prompts",
            disable=not use_tqdm or len(order) < 2,
            dynamic_ncols=True,
        )
        generated = done = 0
        with bar:
            while done < len(order):
                updates, to_abort, failed = self.output_processor.process_outputs(self.client.get_outputs())
                self.client.abort_requests(to_abort)
                for error in failed.values():
                    raise error  # the call's other requests are aborted on the way out
                for out in updates:
                    generated += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        results[order[out.request_id]] = out
                        done += 1
                        bar.update(1)
                        bar.set_postfix_str(
                            f"output {generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s"
                        )
        return results  # type: ignore[return-value]

    def get_stats(self) -> dict:
        return self.merge_stats(self.client.call_utility("stats"))

    def reset_prefix_cache(self) -> bool:
        done = self.client.call_utility("reset_prefix_cache")
        self.client.coordinator.reset_prefixes(i for i, ok in done.items() if ok)
        return all(done.values())


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
