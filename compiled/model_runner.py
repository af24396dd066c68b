"""ModelRunner: turns a SchedulerOutput into input tensors, runs the compiled model, samples.

Compile decisions live here, in `_compile`. The model runner keeps per-request state (token ids,
a row of the persistent block table) across steps, so a step only carries what changed.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from compiled.attention import AttentionMetadata
from compiled.loader import load_model, resolve_dtype, resolve_model
from compiled.models.llama import TransformerBlock
from compiled.sampler import SamplingMetadata, sample
from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kiln.runner")


WARMUP_CHUNK = 64  # tokens of the multi-token chunks the warm-up runs
WARMUP_CONTEXT = 512  # keys each single-query row of the warm-up attends to


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a single-query batch is padded to: 1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 32)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def _bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def _pow2(n: int, cap: int) -> int:
    return min(1 << max(n - 1, 0).bit_length(), cap)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt, then every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    row: int  # row of the persistent block table
    num_blocks: int
    num_computed_tokens: int


class GuardFreeGraph:
    """One graph Dynamo compiled for `fn`, called through Dynamo's own bytecode without its guard check,
    straight into the module Inductor compiled.

    Every call of a compiled layer passes Dynamo's guard check and frame hooks, then AOTAutograd's
    runtime wrapper (version counters of mutated inputs, grad mode, output checks) before Inductor's
    module runs; one call per layer. On the 2-core CPU the guard checks cost 1.3-3 ms of a 27-30 ms
    batch-1 decode step, and the runtime wrapper another 4 % (28.9 vs 28.1 ms, ten alternations in
    one process; batch 32 the same 4 %, 167 vs 156 ms).
    A decode step of a given kind always runs the graph the warm-up compiled for that kind, so the
    runner looks it up once, with Dynamo's guard check on the warm-up's arguments, and calls it
    directly from then on. What the runtime wrapper does is bookkeeping for autograd and later
    compiles; the KV-cache writes happen inside Inductor's kernels. `direct` says whether the calls
    skip it: only when Inductor's module, called on the lookup's arguments, returns what the wrapped
    call returns.
    Invariant: the arguments of every call pass that graph's guards (`check_guards` asserts it, in tests).
    """

    check_guards = False

    def __init__(self, fn: Callable, entry: object, args: tuple) -> None:
        self.signature = inspect.signature(fn)
        self.guards = entry.guard_manager
        self.call = types.FunctionType(entry.code, fn.__globals__, fn.__name__)
        self.direct = False
        modules = {n: _inductor_module(fn.__globals__[n]) for n in entry.code.co_names if n.startswith("__compiled_fn")}
        if len(modules) == 1 and None not in modules.values():
            direct = types.FunctionType(entry.code, {**fn.__globals__, **modules}, fn.__name__)
            # Running a layer again on the same arguments writes the same K/V to the same slots.
            expected, got = self.call(*args), direct(*args)
            if isinstance(got, Tensor) and got.shape == expected.shape and torch.allclose(got, expected):
                self.call, self.direct = direct, True
            else:
                logger.warning("decode layers keep AOTAutograd's runtime wrapper: Inductor's module returned another output")

    @classmethod
    def lookup(cls, fn: Callable, *args: object) -> GuardFreeGraph | None:
        """The graph Dynamo runs for fn(*args); None when it runs none (e.g. past its recompile limit).
        Runs that graph on args twice more."""
        f_locals = inspect.signature(fn).bind(*args).arguments
        entry = next((e for e in _debug_get_cache_entry_list(fn) if e.guard_manager.check(f_locals)), None)
        return None if entry is None or entry.code.co_freevars else cls(fn, entry, args)

    def __call__(self, *args: object) -> Tensor:
        if self.check_guards:
            verdict = self.guards.check_verbose(self.signature.bind(*args).arguments)
            assert verdict.result, f"a guard-free call would fail its graph's guards: {verdict.verbose_code_parts}"
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


def _guarded_block(layer: TransformerBlock, *args: object) -> Tensor:
    return layer(*args)


class StepInputs:
    """The persistent buffers a step's inputs are written into, in place: one int64 host tensor per input,
    filled through its numpy view; on CUDA the host tensor is pinned and copied, without blocking, into
    a device tensor of the same size. The runner hands the model leading slices of these, viewed to the
    step's shapes, so no step allocates memory for its inputs or copies them from pageable memory. A
    buffer grows (doubling) only when a step needs more than it holds.
    Invariants: an input is valid until the next `put` of its name; on CUDA a host buffer is rewritten
    only after the copy out of it has completed (an event per buffer).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, tuple[np.ndarray, Tensor, Tensor, torch.cuda.Event | None]] = {}

    def put(self, name: str, values: np.ndarray | list) -> Tensor:
        values = np.asarray(values, dtype=np.int64)
        n = values.size
        buffer = self.buffers.get(name)
        if buffer is None or buffer[0].size < n:
            buffer = self._grow(name, max(n, 2 * buffer[0].size if buffer else 0))
        host_np, host, dev, copied = buffer
        if copied is not None:
            copied.synchronize()
        host_np[:n] = values.reshape(-1)
        if copied is not None:
            dev[:n].copy_(host[:n], non_blocking=True)
            copied.record()
        return dev[:n].view(values.shape)

    def _grow(self, name: str, size: int) -> tuple[np.ndarray, Tensor, Tensor, torch.cuda.Event | None]:
        cuda = self.device.type == "cuda"
        host = torch.zeros(max(size, 64), dtype=torch.int64, pin_memory=cuda)
        dev = torch.zeros_like(host, device=self.device) if cuda else host
        self.buffers[name] = (host.numpy(), host, dev, torch.cuda.Event() if cuda else None)
        return self.buffers[name]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            # Set once, first: changing the thread count later invalidates every compiled graph.
            torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        self.model_dir = resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device)
        start = time.perf_counter()
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())
        self.model.pack_output()
        logger.info("weights: %.2f GiB %s loaded in %.1f s from %s", self.weight_bytes / 2**30,
                    str(self.dtype).removeprefix("torch."), time.perf_counter() - start, self.model_dir)
        args = self.model.args
        self.vocab_size = args.vocab_size
        limit = min(args.max_position_embeddings, args.sliding_window or args.max_position_embeddings)
        if config.max_model_len and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        self.block_size = config.block_size
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        self.buckets = decode_buckets(config.max_num_seqs)
        # One block-table row per live request, plus a last all-zero row for padding tokens.
        self.table_width = max(self.max_blocks_per_seq, 2)
        self.block_table = torch.zeros(config.max_num_seqs + 1, self.table_width, dtype=torch.int64)
        self.inputs = StepInputs(self.device)
        self.null_row = config.max_num_seqs
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.num_blocks = 0
        self.forward = self.model.forward
        self.decode_forward = self.model.forward
        self.decode_graphs: dict[bool, Callable] = {}  # one row or more -> how its layers run
        if not config.enforce_eager:
            self._compile()

    def _compile(self) -> None:
        """Every compile decision of kiln is here.

        CPU: each TransformerBlock is compiled with dynamic shapes; all layers share one Dynamo cache
        entry (same code, weights are graph inputs), so a whole step costs a few graphs, ~5-10 s each
        cold and about a second from the Inductor cache. Measured on the 2-core CPU, SmolLM2 float32
        (batch 32, context 480): per-layer 322 ms/step after 10 s of compiling; the whole model as one
        dynamic graph compiled in 90 s and ran 4 s/step; eager 592 ms/step.
        CUDA: decode-only steps (padded to a bucket) run the whole model under mode="reduce-overhead";
        steps with multi-token chunks use the per-layer graphs. Shapes are left to automatic dynamic:
        the first bucket compiles static, the next one compiles a graph with a symbolic batch and
        block-table width, and CUDA-graph trees record one graph per concrete (bucket, width), so
        neither the buckets nor the power-of-two table widths run into Dynamo's recompile limit.
        """
        # Dynamo specialises sizes 0 and 1, so inputs keep dynamic sizes at 2 or more (see
        # _prepare_inputs) except a decode of one sequence; the graphs are: decode of one sequence
        # (Linear is a matrix-vector reduction there) and of more, and steps with chunks (one chunk,
        # or more). Each graph costs ~5 s cold and ~1 s warm, so the count is kept low.
        # Sizes that happen to be equal when traced must not be assumed equal.
        torch.fx.experimental._config.use_duck_shape = False
        # Float attributes (norm eps) as constants, not as tensors built on every call.
        torch._dynamo.config.specialize_float = True
        # The fake-tensor dispatch cache costs more than it saves when tracing these dynamic graphs,
        # and most of a warm start is Dynamo re-tracing them. Without it, SmolLM2 float32 on the
        # 2-core CPU, in-process warm-up: warm cache 6.9-7.2 → 4.7-5.2 s; empty cache unchanged within
        # the noise (47.9-53.9 vs 43.8-51.3 s).
        torch._dynamo.config.fake_tensor_cache_enabled = False
        # By default Dynamo's bytecode times every call it makes (two disabled-function calls a layer),
        # for logs kiln does not read.
        torch._dynamo.config.record_runtime_overhead = False
        for layer in self.model.layers:
            layer.compile(dynamic=True)
        self.model.output.compile(dynamic=True)  # the LM head: one more weight stream per step
        if self.device.type == "cuda":
            self.decode_forward = torch.compile(self.model.forward, mode="reduce-overhead")
        else:
            self.decode_forward = self._decode_guard_free

    def _decode_guard_free(self, token_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """CPU decode: every layer through the graph of its kind of step (one row, or more), no guards.

        The first decode step of a kind (in the warm-up) runs through Dynamo and looks the graph up.
        """
        one_row = token_ids.shape[0] == 1
        graph = self.decode_graphs.get(one_row)
        if graph is not None:
            return self.model.forward(token_ids, positions, meta, block=graph)
        seen: list[tuple] = []

        def block(layer: TransformerBlock, *args: object) -> Tensor:
            seen.append((layer, *args))
            return layer(*args)

        hidden = self.model.forward(token_ids, positions, meta, block=block)
        graph = GuardFreeGraph.lookup(TransformerBlock.forward, *seen[-1])
        if graph is None:
            logger.warning("decode steps of %s rows keep Dynamo's guarded calls: it compiled no graph for them",
                           "one" if one_row else "several")
        self.decode_graphs[one_row] = graph or _guarded_block
        return hidden

    # ---- KV cache -------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.n_layers * self.block_size * a.n_kv_heads * a.head_dim * self.dtype.itemsize

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV-cache budget, never more than max_num_seqs full-length sequences need."""
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = int(_available_ram() * c.cpu_kv_cache_fraction)
        useful = c.max_num_seqs * self.max_blocks_per_seq + 1
        num_blocks = min(budget // self.kv_bytes_per_block(), useful)
        if num_blocks < 2:
            raise ValueError(f"KV-cache budget of {budget} bytes holds no block ({self.kv_bytes_per_block()} bytes each)")
        return int(num_blocks)

    def _cuda_kv_budget(self) -> int:
        """Device memory left after weights and the peak activations of the largest step."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.initialize_kv_cache(2)
        n = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        self._dummy_step(num_single=0, chunk_lens=[n])
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.model.allocate_kv_cache(num_blocks, self.block_size, self.device, self.dtype)
        if not self.config.enforce_eager:
            for layer in self.model.layers:
                for cache in (layer.attention.k_cache, layer.attention.v_cache):
                    # Page geometry is fixed per model: as constants, Inductor's index arithmetic in the
                    # attention loops is shifts and multiplies instead of 64-bit divisions by symbols
                    # (decode attention 3x faster on CPU). The block count stays symbolic.
                    for dim in range(1, cache.dim()):
                        torch._dynamo.mark_static(cache, dim)
                    if self.device.type == "cuda":
                        # CUDA graphs may only mutate inputs whose address never changes.
                        torch._dynamo.mark_static_address(cache)
        gib = num_blocks * self.kv_bytes_per_block() / 2**30
        concurrency = (num_blocks - 1) / self.max_blocks_per_seq
        logger.info("KV cache: %d blocks × %d tokens = %.2f GiB; max concurrency at max_model_len %d: %.2f",
                    num_blocks, self.block_size, gib, self.max_model_len, concurrency)

    def warmup(self) -> None:
        """Run every step shape serving meets, so that none compiles while requests wait."""
        if self.config.enforce_eager:
            return
        start = time.perf_counter()
        # Graphs are dynamic in the token count, so a short chunk compiles the same graph as a long
        # one and does not spend seconds computing it.
        chunk = min(WARMUP_CHUNK, self.max_model_len - 1)
        # On CUDA every bucket records its own CUDA graph. On CPU one row and more rows are the only
        # distinct decode graphs, so the larger buckets would only spend time computing.
        buckets = self.buckets if self.device.type == "cuda" else self.buckets[:2]
        shapes = [(b, []) for b in buckets] + [(2, [chunk]), (2, [chunk, 2])]
        for num_single, chunk_lens in shapes:
            t = time.perf_counter()
            self._dummy_step(num_single, chunk_lens)
            logger.debug("warm-up step singles=%d chunks=%s: %.1f s", num_single, chunk_lens, time.perf_counter() - t)
        logger.info("compile/warm-up: %d step shapes (decode buckets %s, prefill and mixed) in %.1f s",
                    len(shapes), buckets, time.perf_counter() - start)

    def _dummy_step(self, num_single: int, chunk_lens: list[int]) -> None:
        """A step over throw-away sequences whose KV all lands in the null block.

        Single-query rows attend to WARMUP_CONTEXT keys: Inductor decides which loops to spread over
        threads from the sizes it compiles with, and a one-key attention would be compiled serial.
        """
        greedy = SamplingParams(temperature=0.0)
        ctx = min(WARMUP_CONTEXT, self.max_model_len)
        singles = [CachedRequestState(f"dummy{i}", [0] * ctx, ctx, greedy, 0, self.null_row, 0, ctx - 1)
                   for i in range(num_single)]
        chunks = [CachedRequestState(f"dummy{num_single + i}", [0] * n, n, greedy, 0, self.null_row, 0, 0)
                  for i, n in enumerate(chunk_lens)]
        scheduled = {s.req_id: (1 if i < num_single else len(s.token_ids)) for i, s in enumerate(singles + chunks)}
        self._run(singles, chunks, scheduled)

    # ---- one step -------------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.block_table[state.row].zero_()
                self.free_rows.append(state.row)
        for new in so.new_reqs:
            row = self.free_rows.pop()
            self.block_table[row, : len(new.block_ids)] = torch.tensor(new.block_ids, dtype=torch.int64)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.seed, row,
                len(new.block_ids), new.num_computed_tokens)
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                n = len(cached.new_block_ids)
                self.block_table[state.row, state.num_blocks : state.num_blocks + n] = torch.tensor(
                    cached.new_block_ids, dtype=torch.int64)
                state.num_blocks += n
            state.num_computed_tokens = cached.num_computed_tokens

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        singles = [s for s in states if so.num_scheduled_tokens[s.req_id] == 1]
        chunks = [s for s in states if so.num_scheduled_tokens[s.req_id] > 1]
        sampled, tokens, logprobs = self._run(singles, chunks, so.num_scheduled_tokens)
        out_tokens: dict[str, list[int]] = {}
        out_logprobs: dict[str, list] = {}
        for i, s in enumerate(sampled):
            s.token_ids.append(tokens[i])
            out_tokens[s.req_id] = [tokens[i]]
            if logprobs is not None and s.sampling_params.logprobs is not None:
                out_logprobs[s.req_id] = [logprobs[i]]
        order = singles + chunks
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in order],
            sampled_token_ids=[out_tokens.get(s.req_id, []) for s in order],
            logprobs=[out_logprobs.get(s.req_id) for s in order] if out_logprobs else None,
        )

    def _run(self, singles, chunks, num_scheduled):
        """Forward one packed step and sample; returns the sampled states, their tokens and logprobs."""
        (token_ids, positions), meta, logits_index, sampled = self._prepare_inputs(singles, chunks, num_scheduled)
        forward = self.decode_forward if not chunks else self.forward
        tokens, logprobs = self._sample(forward(token_ids, positions, meta), logits_index, sampled)
        return sampled, tokens, logprobs

    def _prepare_inputs(self, singles, chunks, num_scheduled):
        bs = self.block_size
        # Batch 1 is its own graph (sizes of 1 are specialised) only where it pays: decode alone. A
        # step with chunks always carries at least two decode rows (padding ones cost a 32-key
        # attention each), so chunk-only and mixed steps share graphs.
        n_dec = _bucket(len(singles), self.buckets) if singles else 0
        n_pad = (max(n_dec, 2) if chunks else n_dec) - len(singles)
        rows: list[int] = []
        positions: list[int] = []
        token_ids: list[int] = []
        logits_index: list[int] = []
        sampled: list[CachedRequestState] = []
        for s in singles:
            pos = s.num_computed_tokens
            rows.append(s.row)
            positions.append(pos)
            token_ids.append(s.token_ids[pos])
            if pos + 1 == len(s.token_ids):
                logits_index.append(len(token_ids) - 1)
                sampled.append(s)
        rows += [self.null_row] * n_pad
        positions += [0] * n_pad
        token_ids += [0] * n_pad
        num_dec = len(rows)
        seq_lens = [p + 1 for p in positions]
        # Decode attention computes over every column of the table. On CPU the width is a dynamic size,
        # so it is exact; CUDA graphs need few distinct shapes, so there it is rounded to a power of two.
        dec_width = cdiv(max(seq_lens, default=1), bs)
        dec_width = max(_pow2(dec_width, self.table_width) if self.device.type == "cuda" else dec_width, 2)

        query_index: list[list[int]] = []
        query_pos: list[list[int]] = []
        chunk_lens = [num_scheduled[s.req_id] for s in chunks]
        q_max = max(chunk_lens, default=2)
        pre_width = 2
        for s, n in zip(chunks, chunk_lens):
            start, first = s.num_computed_tokens, len(token_ids)
            rows += [s.row] * n
            positions += range(start, start + n)
            token_ids += s.token_ids[start : start + n]
            query_index.append(list(range(first, first + n)) + [first] * (q_max - n))
            query_pos.append(list(range(start, start + n)) + [0] * (q_max - n))
            pre_width = max(pre_width, cdiv(start + n, bs))
            if start + n == len(s.token_ids):
                logits_index.append(len(token_ids) - 1)
                sampled.append(s)
        out_index = [p * q_max + j for p, n in enumerate(chunk_lens) for j in range(n)]

        rows_a, pos_a, table, put = np.array(rows), np.array(positions), self.block_table.numpy(), self.inputs.put
        chunk_rows = [s.row for s in chunks]
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", table[rows_a, pos_a // bs] * bs + pos_a % bs),
            decode_block_tables=put("decode_block_tables", table[rows_a[:num_dec], :dec_width]),
            decode_seq_lens=put("decode_seq_lens", seq_lens),
            prefill_block_tables=put("prefill_block_tables", table[chunk_rows, :pre_width]),
            prefill_query_index=put("prefill_query_index", np.array(query_index).reshape(len(chunks), q_max)),
            prefill_query_pos=put("prefill_query_pos", np.array(query_pos).reshape(len(chunks), q_max)),
            prefill_out_index=put("prefill_out_index", out_index),
        )
        inputs = (put("token_ids", token_ids), put("positions", pos_a))
        return inputs, meta, logits_index, sampled

    def _sample(self, hidden: Tensor, logits_index: list[int], states: list[CachedRequestState]):
        if not states:
            return [], None
        logits = self.model.compute_logits(hidden[self.inputs.put("logits_index", logits_index)])
        m = self._sampling_metadata(states)
        out = sample(logits, m)
        tokens = out.token_ids.tolist()
        if out.logprobs is None:
            return tokens, None
        lp = out.logprobs.tolist()
        top_ids = out.topk_ids.tolist() if out.topk_ids is not None else [[] for _ in states]
        top_lp = out.topk_logprobs.tolist() if out.topk_logprobs is not None else [[] for _ in states]
        logprobs = []
        for i, s in enumerate(states):
            n = s.sampling_params.logprobs or 0
            logprobs.append((lp[i], list(zip(top_ids[i][:n], top_lp[i][:n]))))
        return tokens, logprobs

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        dev = self.device
        params = [s.sampling_params for s in states]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)  # noqa: E731
        m = SamplingMetadata(
            temperature=f32([0.0 if p.greedy else p.temperature for p in params]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            top_p=f32([p.top_p for p in params]),
            min_p=f32([p.min_p for p in params]),
            seeds=torch.tensor([s.seed for s in states], dtype=torch.int64, device=dev),
            steps=torch.tensor([len(s.token_ids) - s.num_prompt_tokens for s in states], dtype=torch.int64, device=dev),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )
        if any(p.logprobs is not None for p in params):
            m.max_num_logprobs = max(p.logprobs or 0 for p in params)
        if any(p.has_penalties for p in params):
            m.presence = f32([p.presence_penalty for p in params])
            m.frequency = f32([p.frequency_penalty for p in params])
            m.repetition = f32([p.repetition_penalty for p in params])
            counts = torch.zeros(len(states), self.vocab_size, dtype=torch.int32)
            seen = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
            for i, s in enumerate(states):
                out = torch.tensor(s.token_ids[s.num_prompt_tokens :], dtype=torch.int64)
                counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
                seen[i, torch.tensor(s.token_ids, dtype=torch.int64)] = True
            m.output_counts, m.seen_mask = counts.to(dev), seen.to(dev)
        return m


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
