"""The Python API: LLM (blocking, batch) and AsyncLLM (asyncio streaming, used by the server).

Both are front ends: they tokenize and validate in the caller's process, send requests to the
engine-core process, and detokenize what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.client import AsyncCoreClient, CoreClient, EngineDeadError, SyncCoreClient
from engine.config import EngineConfig
from engine.output_processor import InvalidRequestError, OutputProcessor, Processor, RequestOutput
from engine.params import SamplingParams

logger = logging.getLogger("kiln")

Prompt = str | list[int]
Conversation = list[dict[str, Any]]

__all__ = ["LLM", "AsyncLLM", "EngineDeadError", "InvalidRequestError", "RequestOutput", "SamplingParams"]


class _FrontEnd:
    """What LLM and AsyncLLM share: model resolution, tokenizer, the core client, request state."""

    client: CoreClient

    def __init__(self, model: str | None, client_cls: type[CoreClient], engine_args: dict[str, Any]) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        # The core process starts first: its imports overlap ours and the model's resolution, and its
        # weight load and warm-up overlap the tokenizer's load.
        self.client = client_cls()
        try:
            import torch

            # The engine core owns the cores; this process only tokenizes and waits.
            torch.set_num_threads(1)
            from compiled.loader import DEFAULT_MODEL_NAME, load_tokenizer, resolve_model

            self.model_dir = resolve_model(model)
            self.client.start(self.config, self.model_dir)
            self.model_name = self.config.served_model_name or (model or DEFAULT_MODEL_NAME)
            self.tokenizer = load_tokenizer(self.model_dir)
            ready = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.max_model_len = ready.max_model_len
        self.processor = Processor(self.tokenizer, ready.max_model_len, _eos_token_ids(self.model_dir, self.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _prepare(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None):
        """Validate and register one prompt; returns the core requests to send."""
        prompt_ids = self.processor.tokenize(prompt)
        params = self.processor.validate(prompt_ids, params)
        request_id = request_id or f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        core_reqs = self.processor.core_requests(request_id, prompt_ids, params, time.time())
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, core_reqs)
        return request_id, core_reqs

    def chat_prompt(self, conversation: Conversation, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template", "messages")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **(chat_template_kwargs or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()


def _eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """The tokenizer's EOS first, then any others the generation config lists (Llama 3 has several)."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        extra = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        extra = None
    for t in [extra] if isinstance(extra, int) else (extra or []):
        if t not in ids:
            ids.append(t)
    return ids


class LLM(_FrontEnd):
    """Offline generation. `LLM()` serves the embedded default model (SmolLM2-135M-Instruct).

    >>> llm = LLM(dtype="float32")
    >>> out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        super().__init__(model, SyncCoreClient, engine_args)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[Prompt], params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} sampling params for {len(prompts)} prompts", "sampling_params")
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid, core_reqs = self._prepare(prompt, p)
                order[rid] = i
                for req in core_reqs:
                    self.client.add_request(req)
            return self._collect(order, use_tqdm)
        except BaseException:
            # Bad input, Ctrl-C or a dead engine: nothing of this call may stay in the engine.
            for rid in order:
                self.client.abort_requests(self.output_processor.abort(rid))
            raise

    def _collect(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm or len(order) < 2,
                   dynamic_ncols=True)
        generated = done = 0
        with bar:
            while done < len(order):
                updates, to_abort = self.output_processor.process_outputs(self.client.get_outputs())
                self.client.abort_requests(to_abort)
                for out in updates:
                    generated += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        results[order[out.request_id]] = out
                        done += 1
                        bar.update(1)
                        bar.set_postfix_str(f"output {generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
        return results  # type: ignore[return-value]

    def get_stats(self) -> dict:
        return self.client.call_utility("stats")

    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")


class AsyncLLM(_FrontEnd):
    """Streaming front end for asyncio code: `async for out in llm.generate(...)`."""

    client: AsyncCoreClient

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Streams are read as they are generated: defaults favour smooth inter-token latency.
        super().__init__(model, AsyncCoreClient, {"usage": "serving", **engine_args})
        self.queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    @property
    def dead(self) -> str | None:
        """Why the engine core is gone, or None while it runs (checked now, not only by the reader)."""
        with contextlib.suppress(EngineDeadError):
            self.client.check_alive()
        return self.client.dead

    def _ensure_reader(self) -> None:
        # One reader per event loop: a task on a loop that no longer runs would deliver nothing.
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done() or self._reader.get_loop() is not loop:
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            self._reader = loop.create_task(self.client.run_reader(self._on_outputs, self._on_dead))

    def _on_outputs(self, outputs) -> None:
        updates, to_abort = self.output_processor.process_outputs(outputs)
        self.client.abort_requests(to_abort)
        for out in updates:
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_dead(self, message: str) -> None:
        logger.error("engine core died: %s", message)
        self.output_processor.fail_all()
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(message))

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's state each time it changes; the last one has `finished` set.
        Closing the generator early (a client went away) aborts the request in the engine."""
        self._ensure_reader()
        if self.client.dead:
            raise EngineDeadError(self.client.dead)
        rid, core_reqs = self._prepare(prompt, sampling_params or SamplingParams(), request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        finished = False
        try:
            for req in core_reqs:
                self.client.add_request(req)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(rid, None)
            if not finished:
                live = self.output_processor.abort(rid)
                if not self.client.dead:
                    self.client.abort_requests(live)

    async def abort(self, request_id: str) -> None:
        self.client.abort_requests(self.output_processor.abort(request_id))
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def get_stats(self) -> dict:
        self._ensure_reader()
        return await self.client.call_utility("stats")

    async def reset_prefix_cache(self) -> bool:
        self._ensure_reader()
        return await self.client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.cancel()
        super().shutdown()
