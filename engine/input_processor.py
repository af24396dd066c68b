"""Prompts into engine-core requests: the one place a prompt and its params are checked against the model.

A prompt (text, token ids or a conversation) becomes validated token ids and one EngineCoreRequest, whose
n samples the core runs as n requests sharing the prompt (and its cached blocks).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from engine import structured_output
from engine.errors import InvalidRequestError
from engine.messages import EngineCoreRequest
from engine.params import SamplingParams
from engine.processes import lower_thread_priority

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


@dataclass
class PreparedRequest:
    """A validated request, ready to send: `params.max_tokens` is resolved against the context."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_request: EngineCoreRequest  # what is sent: the prompt once, for all its samples
    core_requests: list[EngineCoreRequest]  # its samples, as the core runs them

    @functools.cached_property
    def cost(self) -> tuple[int, int, int]:
        """What it holds while in flight: its samples, their prompt tokens, its constraint's bytes (sent and
        compiled once for all samples); computed once, as admission checks it twice."""
        so = self.params.structured_outputs
        size = 0 if so is None else len(msgspec.json.encode(so))
        n = len(self.core_requests)
        return n, n * len(self.prompt_token_ids), size


class InputProcessor:
    """Tokenize, apply the chat template and validate against the model's limits."""

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        eos_token_ids: list[int],
        model_vocab_size: int,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self._tokenizer, self._local = tokenizer, threading.local()
        self._local.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_stop_ids = eos_token_ids[1:]  # e.g. Llama 3's <|eot_id|> besides <|end_of_text|>
        # Ids the model can embed and the tokenizer can read back; either may be the larger.
        self.vocab_size = min(len(tokenizer), model_vocab_size)

    @property
    def tokenizer(self):
        """This thread's tokenizer: HF fast tokenizers must not be used from two threads at once, so each
        thread but the one that made the processor works on a copy of its own."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tokenizer

    def encode_at_low_priority(self) -> None:
        """From now on this thread's `encode` runs the tokenizer's own encoding on a thread at the lowest CPU
        priority: for work that can wait while the model's threads take the cores (huge prompts)."""
        self._local.background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kiln-encode", initializer=lower_thread_priority
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids. After `encode_at_low_priority`, the fast tokenizer's encoding, which releases
        the GIL, runs at low priority, and the Python around it, which holds the GIL, stays on this thread:
        a thread at low priority that holds the GIL while the model's threads keep the cores would stall
        every other thread of the process (the event loop's included) until it gets a core back."""
        tokenizer, background = self.tokenizer, getattr(self._local, "background", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if background is None or backend is None:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        from transformers import PreTrainedTokenizerFast  # loaded with the tokenizer

        # As the fast tokenizer's own encode calls it (a class of its own may encode otherwise): no
        # truncation, no padding, its special tokens kept whole.
        own = type(tokenizer)._encode_plus is not PreTrainedTokenizerFast._encode_plus
        split = backend.encode_special_tokens != tokenizer.split_special_tokens
        if own or split or backend.truncation or backend.padding:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # The batch call releases the GIL while it encodes; the single one does not.
        batch = background.submit(backend.encode_batch, [text], add_special_tokens=add_special_tokens)
        return batch.result()[0].ids

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def chat_prompt(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template", "messages")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return self.encode(text, add_special_tokens=False)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check the prompt fits; return params with max_tokens resolved against the context."""
        n, limit = len(prompt_ids), self.max_model_len
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        room = limit - n
        if room < 1:
            raise InvalidRequestError(
                f"prompt has {n} tokens; the model's context is {limit} tokens, leaving none to generate",
                "prompt",
            )
        if params.priority and self.scheduling_policy != "priority":
            # Refused rather than ignored, in vLLM's words, which clients match to retry without it.
            raise InvalidRequestError(
                f"Got priority {params.priority} but Priority scheduling is not enabled "
                "(the engine runs with --scheduling-policy fcfs)",
                "priority",
            )
        for field in ("min_tokens", "max_tokens"):
            value = getattr(params, field)
            if value is not None and value > room:
                raise InvalidRequestError(
                    f"{field}={value} plus the prompt's {n} tokens exceeds the model's "
                    f"context of {limit} tokens",
                    field,
                )
        if params.structured_outputs is not None:
            try:
                structured_output.check(params.structured_outputs)
            except ValueError as e:
                raise InvalidRequestError(str(e), "structured_outputs") from None
        for field, ids in (
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            if any(not 0 <= t < self.vocab_size for t in ids or ()):
                raise InvalidRequestError(f"{field} token ids must be in [0, {self.vocab_size})", field)
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=room)
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_words_token_ids(params))
        return params

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's tokens at the start of a text and after a space, where tokenizers differ."""
        variants = {
            tuple(self.tokenizer.encode(prefix + word.strip(), add_special_tokens=False))
            for word in params.bad_words
            for prefix in ("", " ")
        }
        return sorted(list(ids) for ids in variants if ids and max(ids) < self.vocab_size)

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Validate `prompt` and build its core requests; sample i of a seeded request uses seed + i."""
        prompt_ids = self.tokenize(prompt)
        params = self.validate(prompt_ids, params)
        core = msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *self.extra_stop_ids])
        request = EngineCoreRequest(request_id, prompt_ids, core, arrival_time, self.eos_token_id, cache_salt)
        text = prompt if isinstance(prompt, str) else None
        return PreparedRequest(request_id, text, prompt_ids, params, request, request.samples())
