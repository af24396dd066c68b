"""Structured outputs: a request's schema, regex, choice or grammar turned into a token mask per step.

llguidance (Rust, no torch) matches the output against the grammar and, before each sampled token,
computes which vocabulary entries keep it inside the grammar: a bitmask of 32-bit words per row, which
the sampler applies on the logits' device. The engine core owns the matchers. Grammars compile on a
thread pool (llguidance drops the GIL), never in the core's step: a request waits, skipped by the
scheduler, until its grammar is ready. Compiled grammars are cached by their text; each request gets a
copy of the cached matcher, so a schema seen before costs a copy, not a compile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

from engine.params import StructuredOutputsParams
from engine.processes import lower_thread_priority

if TYPE_CHECKING:
    from engine.request import Request

logger = logging.getLogger("kiln.structured")

# JSON as json.dumps writes it: `{"a": 1, "b": [2, 3]}`. Free whitespace lets a small model stall in an
# endless run of newlines inside a valid document, and bounded runs make the parser's steps too complex.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_EXCERPT = re.compile(r"\d+ \|")  # "   1 | start: /a(b/": the grammar line an error points into
CACHE_SIZE = 256  # compiled grammars kept
COMPILE_THREADS = 2
# A grammar's text at most (a schema of a few thousand fields is ~200 KB and compiles in about a second).
MAX_GRAMMAR_BYTES = 512 << 10
COMPILE_TIMEOUT_S = 60.0  # a request whose grammar has not compiled by then fails, naming this limit


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's constraint; ValueError (naming the field) if it is malformed."""
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else so.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        else:
            text = llguidance.grammar_from(kind, getattr(so, kind))  # "choice", "regex" or "grammar"
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None
    if len(text) > MAX_GRAMMAR_BYTES:
        size, limit = len(text), MAX_GRAMMAR_BYTES
        raise ValueError(f"structured_outputs.{kind}: its grammar is {size} bytes, past the limit of {limit}")
    return text


def _key(text: str) -> bytes:
    """Caches are keyed by a digest, so that what they hold is bounded by their entries, not their texts."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


_errors: OrderedDict[bytes, str] = OrderedDict()  # grammar digest -> validate_grammar's error ("" if none)
_errors_lock = threading.Lock()


def _grammar_error(grammar: str) -> str:
    key = _key(grammar)
    with _errors_lock:
        if key in _errors:
            _errors.move_to_end(key)
            return _errors[key]
    error = llguidance.LLMatcher.validate_grammar(grammar)
    with _errors_lock:
        _errors[key] = error
        if len(_errors) > CACHE_SIZE:
            _errors.popitem(last=False)
    return error


def check(so: StructuredOutputsParams) -> None:
    """ValueError naming the field unless the grammar compiles (without the tokenizer: the front end's
    check, so that a bad schema never reaches the engine core)."""
    error = _grammar_error(grammar_text(so))
    if error:
        raise ValueError(f"structured_outputs.{so.kind}: {one_line(error)}")


def one_line(error: str) -> str:
    """llguidance's message without the source excerpt and caret lines it draws under it."""
    lines = (line.strip() for line in error.splitlines())
    return " ".join(line for line in lines if line and line.strip("^ ") and not _EXCERPT.match(line))


class Grammar:
    """One request's matcher. Until `ready`, the grammar may still be compiling; once ready, either
    `matcher` is set or `error` says why the grammar could not compile."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None
        self.since = time.monotonic()

    @property
    def ready(self) -> bool:
        if self.matcher is None and self.error is None:
            if not self.future.done():
                if time.monotonic() - self.since < COMPILE_TIMEOUT_S:
                    return False
                self.error = f"the grammar did not compile within {COMPILE_TIMEOUT_S:.0f} s"
                return True
            try:
                self.matcher = self.future.result().deep_copy()
            except Exception as e:
                self.error = str(e) or type(e).__name__
        return True

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; True when the output must end here: past a complete grammar (which
        admits only EOS, so the sequence still ends on a token as an unconstrained one does), or on an error
        (`error` says which)."""
        if self.error is not None:
            return True
        complete = self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            self.fail()
            return True
        return complete

    def fail(self) -> None:
        self.error = one_line(self.matcher.get_error()) or "the grammar failed"
        logger.warning("structured output ended by a grammar error: %s", self.error)


class StructuredOutputManager:
    """The tokenizer view llguidance needs (built on first use: about a second), the compile pool and the
    cache of compiled grammars; one per engine core."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, parallel_masks: bool = False) -> None:
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        # Compiles run below the model's threads: a request's grammar waits, never another request's step.
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, "kiln-grammar", lower_thread_priority)
        # Masks on a thread pool only where the model leaves the cores free (a GPU): on a CPU the pool's
        # threads would take the cores from the model's, for masks that take microseconds each.
        self.executor = llguidance.LLExecutor() if parallel_masks else None
        self.cache: OrderedDict[bytes, Future] = OrderedDict()  # grammar digest -> its compile
        self.waiters: dict[Future, int] = {}  # a compile -> live requests that took it while it was running
        self._tokenizer: Future | None = None  # llguidance's tokenizer, built on the first compile

    def grammars(self, so: StructuredOutputsParams, eos_token_id: int | None, n: int = 1) -> list[Grammar]:
        """`n` matchers for `so` (a request's samples), compiling it in the background unless the cache
        holds it; its grammar text is made once for all of them."""
        try:
            text = grammar_text(so)
        except ValueError as e:
            future: Future = Future()
            future.set_exception(e)
            return [Grammar(future) for _ in range(n)]
        key = _key(text)
        future = self.cache.get(key)
        if future is None:
            tokenizer = self._llg_tokenizer(eos_token_id)
            future = self.cache[key] = self.pool.submit(self._compile, text, tokenizer)
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        if not future.done():
            self.waiters[future] = self.waiters.get(future, 0) + n
        return [Grammar(future) for _ in range(n)]

    def release(self, grammar: Grammar) -> None:
        """A request with `grammar` ended: a compile no live request waits for any more is cancelled (if
        it has not started), so that aborted requests leave no work queued ahead of others'."""
        future = grammar.future
        if future not in self.waiters:
            return
        self.waiters[future] -= 1
        if self.waiters[future] == 0:
            del self.waiters[future]
            if future.cancel():
                self.cache = OrderedDict((k, f) for k, f in self.cache.items() if f is not future)

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or `timeout` passes (the core's idle wait while one runs)."""
        # With none compiling, wait() returns at once.
        wait_futures([f for f in self.cache.values() if not f.done()], timeout, return_when="FIRST_COMPLETED")

    def step_bitmasks(self, constrained: list[Request]) -> dict[str, np.ndarray]:
        """The token masks, by request id, of the constrained requests that sample in a step: those whose
        computed tokens reach their known ones (a chunk that ends the prompt, or a decode)."""
        sampling = [r for r in constrained if r.num_computed_tokens >= r.num_tokens]
        masks = self.bitmask([r.grammar for r in sampling]) if sampling else []
        return {r.request_id: row for r, row in zip(sampling, masks)}

    def bitmask(self, grammars: list[Grammar]) -> np.ndarray:
        """[len(grammars), words] int32: bit t of row i is set iff token t may come next for grammar i."""
        mask = llguidance.numpy.allocate_token_bitmask(len(grammars), self.vocab_size)
        if self.executor is not None and len(grammars) > 1:
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor, [(g.matcher, i) for i, g in enumerate(grammars)], mask
            )
        else:
            for i, g in enumerate(grammars):
                llguidance.numpy.fill_next_token_bitmask(g.matcher, mask, i)
        for i, g in enumerate(grammars):
            if g.error is None and g.matcher.is_error():  # e.g. the parser's step limits: no mask to trust
                g.fail()
            if g.error is not None:  # only EOS, and accept() ends the request
                eos = self._tokenizer.result().eos_token
                mask[i] = 0
                mask.view(np.uint32)[i, eos // 32] = 1 << (eos % 32)
        return mask

    def _compile(self, text: str, tokenizer: Future) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(tokenizer.result(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(one_line(matcher.get_error()))
        return matcher

    def _llg_tokenizer(self, eos_token_id: int | None) -> Future:
        """Built once, on a thread at the core's priority: building it holds the GIL for most of a second,
        which a compile thread, below the model's, would hold while the model's threads keep the cores,
        and the core's own thread would wait for it."""
        failed = self._tokenizer is not None and self._tokenizer.done() and self._tokenizer.exception()
        if self._tokenizer is None or failed:  # built again after a failure, as the next grammar asks
            builder = ThreadPoolExecutor(1, "kiln-grammar-tokenizer")
            self._tokenizer = builder.submit(self._build_tokenizer, eos_token_id)
            builder.shutdown(wait=False)
        return self._tokenizer

    def _build_tokenizer(self, eos_token_id: int | None) -> llguidance.LLTokenizer:
        import llguidance.hf
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return llguidance.hf.from_tokenizer(hf, self.vocab_size, eos_token_id)
