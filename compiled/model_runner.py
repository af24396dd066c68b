"""ModelRunner: a SchedulerOutput into input tensors, the model run as the compile policy says, then sampling.

The runner keeps per-request state (token ids, a row of the persistent block table) across steps
(compiled/input_batch.py), so a step only carries what changed.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiled import compile_policy, parallel
from compiled.compile_policy import WARMUP_CONTEXT, CompilePolicy
from compiled.host_memory import available_ram, move_weights
from compiled.input_batch import CachedRequestState, InputBatch, StepBatch, cdiv, sampling_inputs
from compiled.loader import load_model
from compiled.models.linear import Linear
from compiled.pipeline import Pipe
from compiled.quant import describe
from compiled.sampler import sample, verify
from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

logger = logging.getLogger("kiln.runner")
PACKED_COPY_RAM_FRACTION = 0.25  # of the RAM available once the weights are loaded
PROMPT_LOGITS_ROWS = 256  # rows of prompt logits computed at once: 256 x vocab floats (~50 MB for 49k)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        gguf_path: str | None = None,
        rank: int = 0,
    ) -> None:
        """`config.model` is an HF directory (`gguf_path` the file it came from, if any); `config`'s
        budgets are resolved for `device`. Under tensor parallelism this is rank `rank`'s runner: every
        rank runs each step, rank 0 samples and hands its tokens to the others. Under pipeline parallelism
        (compiled/pipeline.py) the ranks of the last stage sample; the scheduler sends every stage the
        tokens, and none appends its own."""
        self.config, self.device, self.dtype = config, device, dtype
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tensor_parallel = tp > 1
        self.pipe = Pipe(rank, tp) if pp > 1 else None
        compiles_on_cpu = device.type == "cpu" and not config.enforce_eager
        self.isa_probe = compile_policy.probe_vector_isa() if compiles_on_cpu else None
        start = time.perf_counter()
        self.model = load_model(
            config.model,
            dtype,
            device,
            config.quantization,
            gguf_path,
            tp_rank=rank % tp,
            tp_size=tp,
            pp_rank=rank // tp,
            pp_size=pp,
            layer_partition=config.pipeline_layer_partition,
        )
        self.stage = self.model.stage
        move_weights(self.model)
        params = {id(p): p for p in self.model.parameters()}.values()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params)
        # Copies for several rows, made only where most of the RAM stays for the KV cache: a float model's
        # packed weights (their size again), then a quantized model's float layers (several times its size).
        room = available_ram() * PACKED_COPY_RAM_FRACTION
        if device.type == "cpu" and self.weight_bytes <= room:
            self.model.pack_weights(dtype, dense=self.model.dense_bytes(dtype) <= room - self.weight_bytes)
        dense = [m.gemm for m in self.model.modules() if isinstance(getattr(m, "gemm", None), Linear)]
        move_weights(nn.ModuleList(dense))  # on 2 MiB pages, as the float model's weights are
        packed = [m.prepacked for m in self.model.modules() if getattr(m, "prepacked", None) is not None]
        packed_bytes = sum(w.numel() * w.element_size() for w in packed + [m.weight for m in dense])
        logger.info(
            "weights: %.2f GiB %s%s loaded in %.1f s from %s%s",
            self.weight_bytes / 2**30,
            str(dtype).removeprefix("torch."),
            f" with {describe(list(self.model.modules()))} weights" if config.quantization != "none" else "",
            time.perf_counter() - start,
            gguf_path if config.quantization == "gguf" else config.model,
            f"; {packed_bytes / 2**30:.2f} GiB more in copies for several rows" if packed else "",
        )
        args = self.model.args
        self.vocab_size = args.vocab_size
        limit = args.max_position_embeddings
        if config.max_model_len and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        self.max_model_len = config.max_model_len or limit
        self.model.cache_rope(self.max_model_len, dtype)
        self.block_size = config.block_size
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        spec = config.speculative_config
        drafts = spec.num_speculative_tokens if spec is not None else 0
        self.batch = InputBatch(config.max_num_seqs, self.max_blocks_per_seq, self.block_size, device, drafts)
        self.policy = CompilePolicy(self.model, device, config.enforce_eager, dtype)
        split, backend = self.model.split, self.model.layers[0].attention.backend
        if line := backend.choose_paths(split.heads, split.kv_heads, args.head_dim, dtype):
            logger.info("attention: %s", line)

    def kv_bytes_per_block(self) -> int:
        m = self.model  # a pipeline stage caches its own layers' KV
        return 2 * len(m.layers) * self.block_size * m.split.kv_heads * m.args.head_dim * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model.allocate_kv_cache(num_blocks, self.block_size, self.dtype)
        self.policy.mark_kv_cache(
            [c for layer in self.model.layers for c in (layer.attention.k_cache, layer.attention.v_cache)]
        )
        logger.info(
            "KV cache: %d blocks × %d tokens = %.2f GiB; max concurrency at max_model_len %d: %.2f",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_bytes_per_block() / 2**30,
            self.max_model_len,
            (num_blocks - 1) / self.max_blocks_per_seq,
        )

    def warmup(self) -> None:
        """Run every step shape serving meets, so that none compiles while requests wait."""
        shapes = self.policy.warmup_shapes(self.batch, self.max_model_len)
        if not shapes:
            return
        start = time.perf_counter()
        if self.isa_probe is not None:
            self.isa_probe.join()
        for shape in shapes:
            for _ in range(shape.runs):
                self.dummy_step(shape.num_single, list(shape.chunk_lens), shape.context)
        logger.info(
            "compile/warm-up: %d step shapes (decode buckets %s, prefill and mixed) in %.1f s",
            len(shapes),
            sorted({s.num_single for s in shapes if not s.chunk_lens}),
            time.perf_counter() - start,
        )

    def dummy_step(self, num_single: int, chunk_lens: list[int], context: int = WARMUP_CONTEXT) -> None:
        """A step over throw-away sequences whose KV all lands in the null block; each single-query row
        attends to `context` keys."""
        greedy, null = SamplingParams(temperature=0.0), self.batch.null_row
        ctx = min(context, self.max_model_len)

        def dummy(i: int, n: int, computed: int) -> CachedRequestState:
            return CachedRequestState(f"dummy{i}", [0] * n, n, greedy, 0, null, 0, computed)

        singles = [dummy(i, ctx, ctx - 1) for i in range(num_single)]
        chunks = [dummy(num_single + i, n, 0) for i, n in enumerate(chunk_lens)]
        scheduled = {s.req_id: 1 for s in singles} | {s.req_id: len(s.token_ids) for s in chunks}
        step = self.batch.prepare(singles, chunks, scheduled)
        hidden = self.hidden_states(step)
        if self.stage.last:
            self._run(step, None, hidden)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.batch.update(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        singles, chunks = self.batch.split(so.num_scheduled_tokens, so.spec_tokens)
        step = self.batch.prepare(singles, chunks, so.num_scheduled_tokens, so.spec_tokens)
        received = None
        if not self.stage.first:
            received = self.pipe.recv(step.token_ids.shape[0], self.model.args.dim, self.dtype, self.device)
        hidden = self.hidden_states(step, received)
        if not self.stage.last:
            self.pipe.send(hidden)
            return ModelRunnerOutput([], [])
        tokens, logprobs, prompt_logprobs = self._run(step, so.grammar_bitmasks, hidden)
        out_tokens: dict[str, list[int]] = {}
        out_logprobs: dict[str, list[TokenLogprobs]] = {}
        for i, s in enumerate(step.sampled):
            if self.pipe is None:
                s.token_ids.extend(tokens[i])
            out_tokens[s.req_id] = tokens[i]
            if logprobs is not None and s.sampling_params.logprobs is not None:
                out_logprobs[s.req_id] = logprobs[i]
        order = singles + chunks
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in order],
            sampled_token_ids=[out_tokens.get(s.req_id, []) for s in order],
            logprobs=[out_logprobs.get(s.req_id) for s in order] if out_logprobs else None,
            prompt_logprobs=prompt_logprobs,
            pooled=self._pool(step, hidden),
        )

    @staticmethod
    def _pool(step: StepBatch, hidden: Tensor) -> dict[str, list[float]]:
        """The embeddings of the pooling requests whose prompt this step finishes (mean pooling sums each
        chunk's rows as it goes: a prompt may take several steps)."""
        pooled = {}
        for s, row, start, n in step.pool_rows:
            p, rows = s.sampling_params.pooling, hidden[row : row + n].float()
            if p.pooling == "mean":
                s.pooled_sum = rows.sum(0) + (0.0 if s.pooled_sum is None else s.pooled_sum)
            if start + n == len(s.token_ids):
                v = s.pooled_sum / len(s.token_ids) if p.pooling == "mean" else rows[-1]
                pooled[s.req_id] = (F.normalize(v, dim=0) if p.normalize else v).tolist()
        return pooled

    def hidden_states(self, step: StepBatch, received: Tensor | None = None) -> Tensor:
        """The model's last hidden state for every token of a prepared step, as production computes it (this
        pipeline stage's, from the previous stage's `received`; zeros in a warm-up)."""
        rows = step.token_ids.shape[0]
        if received is None and not self.stage.first:
            received = torch.zeros(rows, self.model.args.dim, dtype=self.dtype, device=self.device)
        plan = self.policy.plan(rows, step.meta.decode_only)
        return self.policy.forward(step.token_ids, step.positions, step.meta, plan, received)

    def _run(
        self, step: StepBatch, grammar_bitmasks: dict[str, np.ndarray] | None, hidden: Tensor
    ) -> tuple[list[list[int]], list[list[TokenLogprobs]] | None, dict]:
        """Sample a step's sampled rows from its `hidden` states (within their grammars, where they have
        one), verifying drafts: each sampled request's tokens and their logprobs, and the prompt logprobs of
        the rows that score prompt tokens."""
        prompt_logprobs = {
            s.req_id: (start + 1, self._prompt_logprobs(s, hidden[row : row + k], start))
            for s, row, start, k in step.prompt_rows
        }
        if not step.sampled:
            return [], None, prompt_logprobs
        logits = self.policy.logits(hidden[self.batch.inputs.put("logits_index", step.logits_index)])
        if logits is None:  # a tensor-parallel rank past 0: it takes rank 0's tokens
            targets = torch.empty(len(step.logits_index), dtype=torch.int64, device=self.device)
            return self._verify(step, parallel.broadcast(targets).tolist()), None, prompt_logprobs
        meta = sampling_inputs(step.sampled, self.vocab_size, self.device, step.drafts)
        if grammar_bitmasks:
            meta.token_bitmask = self._bitmask(step, grammar_bitmasks)
        out = sample(logits, meta)
        tokens = self._verify(
            step, (parallel.broadcast(out.token_ids) if self.tensor_parallel else out.token_ids).tolist()
        )
        if out.logprobs is None:
            return tokens, None, prompt_logprobs
        lp = out.logprobs.tolist()
        top_ids = out.topk_ids.tolist() if out.topk_ids is not None else [[] for _ in lp]
        top_lp = out.topk_logprobs.tolist() if out.topk_logprobs is not None else [[] for _ in lp]
        logprobs, row = [], 0
        for s, d, emitted in zip(step.sampled, step.drafts, tokens):
            n = s.sampling_params.logprobs or 0
            rows = range(row, row + len(emitted))
            logprobs.append([(lp[r], list(zip(top_ids[r][:n], top_lp[r][:n]))) for r in rows])
            row += len(d) + 1
        return tokens, logprobs, prompt_logprobs

    @staticmethod
    def _verify(step: StepBatch, targets: list[int]) -> list[list[int]]:
        """Each sampled request's tokens from its rows' sampled `targets` (compiled/sampler.py: verify)."""
        tokens, row = [], 0
        for d in step.drafts:
            tokens.append(verify(d, targets[row : row + len(d) + 1]))
            row += len(d) + 1
        return tokens

    def _bitmask(self, step: StepBatch, masks: dict[str, np.ndarray]) -> Tensor:
        """[rows, words] int32 on the device: each constrained row's mask, every token allowed elsewhere."""
        words = next(iter(masks.values())).shape[0]
        rows = np.full((len(step.logits_index), words), -1, dtype=np.int32)
        row = 0
        for s, d in zip(step.sampled, step.drafts):
            if (mask := masks.get(s.req_id)) is not None:
                rows[row] = mask  # a constrained request verifies no drafts: one row
            row += len(d) + 1
        return torch.from_numpy(rows).to(self.device, non_blocking=True)

    def _prompt_logprobs(self, s: CachedRequestState, hidden: Tensor, start: int) -> list[TokenLogprobs]:
        """Logprobs of prompt tokens start+1 .. start+len(hidden) from the rows before each, and the top-N;
        the LM head runs on PROMPT_LOGITS_ROWS rows at a time to bound the [rows, vocab] logits."""
        n, out = s.sampling_params.prompt_logprobs or 0, []
        for first in range(0, hidden.shape[0], PROMPT_LOGITS_ROWS):
            h = hidden[first : first + PROMPT_LOGITS_ROWS]
            logits = self.policy.logits(h)
            if logits is None:  # a tensor-parallel rank past 0: its shard went to rank 0
                continue
            logprobs = logits.float().log_softmax(-1)
            at = start + 1 + first
            targets = torch.tensor(s.token_ids[at : at + h.shape[0]], device=logprobs.device)
            chosen = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
            if n:
                top_lp, top_ids = (t.tolist() for t in logprobs.topk(n, dim=-1))
                out += [(c, list(zip(i, lp))) for c, i, lp in zip(chosen, top_ids, top_lp)]
            else:
                out += [(c, []) for c in chosen]
        return out
