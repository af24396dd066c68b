"""What LLM and AsyncLLM share: the engine-core process, the tokenizer, and the request bookkeeping."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.input_processor import InputProcessor, PreparedRequest, Prompt
from engine.model_files import (
    DEFAULT_MODEL_NAME,
    check_quantization,
    default_model_path,
    eos_token_ids,
    load_tokenizer,
    locate_model,
)
from engine.output_processor import OutputProcessor
from engine.params import PoolingParams, SamplingParams


class FrontEnd:
    """Starts the engine core; tokenizes, validates, registers and detokenizes in the caller's process."""

    client: CoreClient

    def __init__(self, model: str | None, client_cls: type[CoreClient], engine_args: dict[str, Any]) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        check_quantization(model, self.config.quantization)
        # The core process starts first: its imports overlap ours and the model's resolution, and its
        # weight load and warm-up overlap the tokenizer's load.
        self.client = client_cls(self.config)
        try:
            self.model_dir, gguf_file = locate_model(model)
            # The core reads a GGUF file's blocks itself under quantization gguf: it gets the file's path.
            model_file = msgspec.structs.replace(self.config, model=model or default_model_path())
            self.client.start(model_file, self.model_dir, gguf_file)
            self.model_name = self.config.served_model_name or (model or DEFAULT_MODEL_NAME)
            # A GGUF's first start: its tokenizer is in the directory the core is converting it into.
            self.tokenizer = load_tokenizer(self.model_dir) if gguf_file is None else None
            ready = self.client.wait_ready()
            self.tokenizer = self.tokenizer or load_tokenizer(self.model_dir)
        except BaseException:
            self.client.shutdown()
            raise
        self.config = ready.config
        self.max_model_len = ready.max_model_len
        eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.processor = InputProcessor(
            self.tokenizer, ready.max_model_len, eos_ids, ready.vocab_size, self.config.scheduling_policy
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.chat_prompt = self.processor.chat_prompt  # conversation -> prompt token ids
        self._ids = itertools.count()

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Validate one prompt (InvalidRequestError names what is wrong); nothing is sent yet. Requests
        share cached prefixes only with requests of the same `cache_salt`."""
        request_id = request_id or f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        return self.processor.process(request_id, prompt, params, time.time(), cache_salt)

    def embedding_params(self, normalize: bool = True) -> SamplingParams:
        """An embedding request's params: its prompt computed and pooled as configured, nothing sampled."""
        pooling = PoolingParams(pooling=self.config.pooling, normalize=normalize)
        return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)

    @staticmethod
    def merge_stats(per_core: dict[int, dict]) -> dict:
        """The live cores' scheduler stats summed (KV-cache usage averaged), each core's under "engines"."""
        total: dict = {}
        for stats in per_core.values():
            for key, value in stats.items():
                total[key] = _summed(total.get(key), value)
        if per_core:
            total["kv_cache_usage"] /= len(per_core)
        total["engines"] = {str(i): stats for i, stats in sorted(per_core.items())}
        return total

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _summed(a: object, b: object) -> object:
    """Two cores' values of one stat added: numbers, lists by position, dicts by key; None is nothing."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, dict):
        return {key: _summed(a.get(key), b.get(key)) for key in a.keys() | b.keys()}
    if isinstance(a, list):
        return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]
    return a + b
