"""Continuous batching in the vLLM V1 style: no prefill or decode phases, one token budget per step.

Each ``schedule()`` spends ``max_num_batched_tokens`` over at most ``max_num_seqs`` requests: running ones
first (decodes and unfinished prefill chunks alike), then waiting ones, both in the scheduling policy's
order (engine/request_queue.py): fcfs, or by priority then arrival. A request is just
``num_computed_tokens`` chasing ``num_tokens``, which advances in ``schedule()`` (as in vLLM): the runner
receives the value the step starts from. So a request is still prefilling after a step iff
``num_computed_tokens < num_tokens``; it gets a sampled token in ``update_from_output()`` otherwise.

With ``async_scheduling``, step N+1 is scheduled before step N's tokens are back: a sampling step leaves an
output placeholder, whose position the next step computes all the same (the runner appends what it samples).
A request that may stop on the pending token, or whose grammar must see it, waits for it. With pipeline
stages every request waits for its token (the last stage samples it, the next step sends it to all), and
each of the steps in flight takes a share of the sampling requests.

Preemption is by recompute: the last running request in the policy's order (fcfs: the most recently
admitted; priority: the lowest priority) gives up its blocks, keeps its tokens (prompt and outputs) and
goes back to the waiting queue, at its front (fcfs) or at its own priority and arrival.

Fairness: sample i waits behind every other request's sample i - 1 (request_queue.py), the last quarter of
the seats is kept for first samples, a chunk or a further sample's decode leaves room for the leads' decodes
after it and up to half the step to waiting first samples (unless none of them can take it and the step would
carry nothing); where several requests' streams share a measured step, work is priced by the context its
attention reads, bulk work (a further sample's, a fresh prompt longer than a step) stretches the step less
than prompts do and waits while it has no bulk room left, others going past it (step_budget.py).

Speculative decoding: a decoding request also computes the tokens its proposer drafts (engine/proposer.py),
within the budget; once verified, ``num_computed_tokens`` steps back over the rejected ones, whose slots
the next step computes again. No block hash covers a draft: only known tokens are hashed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.messages import EngineCoreOutput
from engine.proposer import Proposer
from engine.request import Request, RequestStatus
from engine.request_queue import RequestQueue
from engine.stat_logger import SchedulerStats
from engine.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.step_budget import StepBudget, prompt_caps, step_tokens

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputManager


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_id: int | None = None,
        structured: StructuredOutputManager | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer  # drafts tokens for decoding requests to verify (speculative decoding)
        self.eos_token_id = eos_token_id
        self.structured = structured  # computes the grammar bitmasks of constrained requests
        self.failed: list[EngineCoreOutput] = []  # requests ended before they ran, not yet reported
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue(config.scheduling_policy, prompt_caps(config)[1])
        self.running: list[Request] = []  # in the policy's order: the last one is preempted first
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.step_budget = StepBudget.of(config)  # CPU serving: the decoding budget follows step times
        # A request also stops ("length") once its KV would outgrow the whole pool (its last token
        # needs no KV, hence +1). Without this cap a lone request that outgrew the pool would
        # preempt itself forever; with it, the first running request can always get its blocks.
        self.max_len = min(config.max_model_len, (config.num_blocks - 1) * config.block_size + 1)

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it is a duplicate or its prompt could never be served."""
        cfg, rid, n = self.config, request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if n == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if n >= cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens but max_model_len is {cfg.max_model_len}, "
                "which leaves no room for an output token"
            )
        if n >= self.max_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens, needing {-(-n // cfg.block_size)} KV blocks "
                f"of {cfg.block_size} tokens, but the cache has only {cfg.num_blocks - 1}"
            )
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens, more than max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}), and chunked prefill is disabled"
            )
        if request.seed is None:
            request.seed = random.getrandbits(63)
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish the live ones among ``request_ids`` with ``status``, free their blocks; returns them."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        assert status.finished, status
        done, queued = [], []  # the finished, and those of them still in the waiting queue
        for rid in request_ids:
            if (req := self.requests.get(rid)) is None or req.status.finished:  # unknown or ended: idempotent
                continue
            if req.status != RequestStatus.RUNNING:
                queued.append(req)
            req.status = status
            done.append(req)
        self._release(done, queued)
        return done

    def _release(self, done: list[Request], queued: list[Request]) -> None:
        """Forget finished requests (`queued`: those of them still in the waiting queue) and free their
        blocks (full ones stay in the prefix cache)."""
        for req in done:
            del self.requests[req.request_id]
            self.kv_cache_manager.free(req)
            if self.proposer is not None:
                self.proposer.finished(req)
            if req.grammar is not None and self.structured is not None:
                self.structured.release(req.grammar)
            self.finished_req_ids.add(req.request_id)
        if len(done) > len(queued):
            self.running = [r for r in self.running if not r.status.finished]
        self.waiting.note_finished(queued)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Abort live requests (unknown or finished ids are ignored); one "abort" output per abort."""
        return [
            EngineCoreOutput(r.request_id, [], finish_reason="abort", num_cached_tokens=self._cached(r, True))
            for r in self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        ]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        kv, spec = self.kv_cache_manager, None if self.proposer is None else self.proposer.stats.copy()
        counts = (kv.usage, kv.prefix_cache_queries, kv.prefix_cache_hits, self.num_preemptions, spec)
        return SchedulerStats(len(self.running), len(self.waiting), *counts)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, hold: bool = True) -> SchedulerOutput:
        cfg, kv, running = self.config, self.kv_cache_manager, self.running
        # Each client request's first running sample leads; its others are bulk work (engine/step_budget.py).
        leads = {r.parent_id: r for r in reversed(running)}
        step = step_tokens(cfg, running, leads, self.waiting, self.step_budget)
        # Bulk work no room holds costs all of it, so it runs alone: `most` a sample, `chunks` a chunk.
        budget, _, bulk, samples_bulk = step
        chunks, most = min(bulk, budget), min(samples_bulk, budget)
        cap, whole = prompt_caps(cfg)  # a chunk's most tokens; a prompt longer than `whole` is bulk work
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        preempted = False
        # While first samples wait, a running prompt's chunk leaves them up to half the step; a step that then
        # carries nothing (none of them can go in: no free blocks) is planned again without (`hold`).
        held = min(budget // 2, self.waiting.first_tokens) if hold and self._admitting() else 0
        seats = -(-len(running) // cfg.pipeline_parallel_size)  # the steps in flight share the sampling
        # A chunk or a further sample's decode leaves room for the leads' decodes still to come.
        rows = sum(r.num_known_tokens - r.num_computed_tokens == 1 for r in leads.values())
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            left, lead = req.num_known_tokens - req.num_computed_tokens, leads[req.parent_id] is req
            rows -= left == 1 and lead
            further, start = not lead, req.num_computed_tokens
            room = budget if left == 1 and lead else budget - held - rows
            # Bulk work: a further sample's, or a fresh prompt's that costs more than a step, to its end.
            bulky = further or step.long(req, max(req.num_cached_tokens, 0), whole)
            room = min(room, samples_bulk if further else bulk) if bulky else room
            # A lead's decode is in the budget; other work is priced by the context its attention reads,
            # a further sample's decode less its prompt's, which its lead's reads.
            alone, shared = (most, req.num_prompt_tokens) if further else (chunks if bulky else room, 0)
            n, cost = (1, 1) if left == 1 and lead else step.take(start, min(left, cap), room, alone, shared)
            if n <= 0 or cost > room or self._awaits_output(req) or (n == left and not seats):
                i += 1  # no room, its sampled token still to come, or no seat for its sample
                continue
            seats -= n == left
            drafts = []  # a decoding request's next tokens, drafted
            if self.proposer is not None and left == 1:
                drafts = self.proposer.propose(req, (room if further else budget) - cost, self.max_len)
            n += len(drafts)
            while (new_blocks := kv.allocate_slots(req, n)) is None:
                victim = running.pop()  # last in the policy's order; never one already scheduled (index < i)
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:  # req preempted itself: it was the last running request
                break
            blocks = [b.block_id for b in new_blocks]
            data = CachedRequestData(req.request_id, blocks, req.num_computed_tokens)
            if cfg.pipeline_parallel_size > 1:
                data.new_token_ids = req.all_token_ids[req.num_sent_tokens :]
                req.num_sent_tokens = req.num_tokens
            out.cached_reqs.append(data)
            if drafts:
                out.spec_tokens[req.request_id] = drafts
            self._advance(req, n, out)
            budget -= cost + len(drafts)
            samples_bulk -= cost + len(drafts) if further else 0
            bulk -= cost if bulky and not further else 0
            i += 1

        # Admitting after a preemption would only take blocks the preempted requests need back.
        waiting, skipped = self.waiting, []
        while not preempted and budget > 0 and self._admitting():
            req = waiting.peek()
            # The last quarter of the seats is kept for first samples (by priority, one may follow this).
            kept = req.sample_index and len(running) >= cfg.max_num_seqs - cfg.max_num_seqs // 4
            if kept and not waiting.num_first:
                break
            if kept or (req.grammar is not None and not req.grammar.ready):  # compiling: the others go first
                skipped.append(waiting.pop())
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self._fail(waiting.pop(), f"structured_outputs: {req.grammar.error}")
                continue
            if req.num_steps_in_flight:  # preempted with a step in flight: resumed once it is back
                break
            lead = leads.get(req.parent_id) if req.sample_index else None  # a further sample's: bulk work
            # It goes in once its lead's prompt is scheduled, which the prefix cache then holds for it.
            further = lead is not None
            long = not further and step.long(req, 0, whole)  # a fresh prompt that costs more than a step
            unshared = further and kv.enable_caching and lead.num_computed_tokens < lead.num_prompt_tokens
            if (long and bulk <= 0) or (further and samples_bulk <= 0) or unshared:  # the others go first
                skipped.append(waiting.pop())
                continue
            computed_blocks, num_hit = kv.get_computed_blocks(req)
            left = req.num_tokens - num_hit
            bulky = long and step.long(req, num_hit, whole)
            room = min(budget, bulk if bulky else samples_bulk if further else budget)
            n, cost = step.take(num_hit, min(left, cap), room, chunks if bulky else most if further else room)
            # Without chunked prefill the whole rest must fit this step; a request resumed after
            # preemption may have outgrown the full budget, and only chunking lets it run at all.
            if n < left and not cfg.enable_chunked_prefill and left <= cfg.max_num_batched_tokens:
                break
            if cost > room:  # bulk work with too little room left: the others go first
                skipped.append(waiting.pop())
                continue
            if kv.allocate_slots(req, n, computed_blocks, num_hit) is None:
                break
            waiting.pop_into(running)
            req.status = RequestStatus.RUNNING
            req.num_cached_tokens = num_hit if req.num_cached_tokens < 0 else req.num_cached_tokens
            out.new_reqs.append(NewRequestData.of(req, kv.get_block_ids(req.request_id), num_hit))
            req.num_computed_tokens, req.num_sent_tokens = num_hit, req.num_tokens
            self._advance(req, n, out)
            leads.setdefault(req.parent_id, req)
            budget -= cost
            bulk -= cost if bulky else 0
            samples_bulk -= cost if further else 0

        waiting.prepend_all(skipped)
        if held and running and not out.num_scheduled_tokens and not preempted:  # none could (no blocks)
            self.finished_req_ids |= out.finished_req_ids  # with any request failed meanwhile
            return self.schedule(hold=False)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if constrained := [
            r for r in map(self.requests.get, out.num_scheduled_tokens) if r.grammar is not None
        ]:
            out.grammar_bitmasks = self.structured.step_bitmasks(constrained)
        return out

    def _admitting(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _advance(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """Schedule ``n`` more tokens of ``req`` (async_scheduling: a sampling step leaves a placeholder,
        except where the next step may verify drafts, which must follow every token)."""
        out.num_scheduled_tokens[req.request_id] = n
        req.num_computed_tokens += n
        req.num_steps_in_flight += 1
        overlapped = self.config.async_scheduling or self.config.pipeline_parallel_size > 1
        if overlapped and req.num_computed_tokens == req.num_known_tokens:
            req.num_output_placeholders += self.proposer is None or req.grammar is not None

    def _awaits_output(self, req: Request) -> bool:
        """Whether a request with tokens in flight must see them before it computes more (always, across
        pipeline stages: the last samples, the first needs the token)."""
        if not req.num_output_placeholders:
            return False
        sp, known = req.sampling_params, req.num_known_tokens
        past_max = sp.max_tokens is not None and known - req.num_prompt_tokens >= sp.max_tokens
        pipelined = self.config.pipeline_parallel_size > 1
        return pipelined or req.grammar is not None or known >= self.max_len or past_max

    def _fail(self, req: Request, why: str) -> None:
        """Finish a waiting request (already out of the queue) that cannot run; reported by take_failed()."""
        req.status, req.stop_reason = RequestStatus.FINISHED_ABORTED, why
        self._release([req], queued=[])
        self.failed.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=why))

    def take_failed(self) -> list[EngineCoreOutput]:
        failed, self.failed = self.failed, []
        return failed

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        out.finished_req_ids.add(req.request_id)  # the runner drops it; it comes back as a new request

    def update_from_output(
        self, so: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests; one output per request
        that got tokens or finished. (``num_computed_tokens`` already advanced in schedule().)"""
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        queued: list[Request] = []  # of the finished: preempted while their step ran (overlapped scheduling)
        all_logprobs = runner_output.logprobs
        for req in filter(None, map(self.requests.get, so.num_scheduled_tokens)):
            req.num_steps_in_flight = max(req.num_steps_in_flight - 1, 0)  # 0: an id used again meanwhile
        for rid, (start, entries) in runner_output.prompt_logprobs.items():
            if (req := self.requests.get(rid)) is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs[start : start + len(entries)] = entries
        for i, (rid, token_ids) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            if not token_ids:  # still prefilling
                continue
            if (req := self.requests.get(rid)) is None:  # finished or aborted since it was scheduled
                continue
            first = req.num_output_tokens == 0
            req.num_output_placeholders = max(req.num_output_placeholders - len(token_ids), 0)
            if (drafts := so.spec_tokens.get(rid)) is not None:
                if req.status == RequestStatus.RUNNING:  # else preempted meanwhile: nothing computed is kept
                    req.num_computed_tokens -= len(drafts) + 1 - len(token_ids)  # rejected drafts' KV
                self.proposer.verified(req, len(drafts), len(token_ids) - 1)
            status = None
            for k, token in enumerate(token_ids):
                req.append_output_token(token)
                status = req.check_stop(token, self.max_len)
                if req.grammar is not None and req.grammar.accept(token):
                    if req.grammar.error is not None:
                        status = RequestStatus.FINISHED_ABORTED
                        req.stop_reason = f"structured_outputs: {req.grammar.error}"
                    elif status is None:
                        status = RequestStatus.FINISHED_STOPPED  # past a complete grammar (EOS ignored)
                if status is not None:
                    token_ids = token_ids[: k + 1]
                    break
            logprobs = all_logprobs[i] if all_logprobs is not None else None
            spec = None  # the request's drafted and accepted tokens, reported as it ends
            if status is not None:
                spec = (req.num_draft_tokens, req.num_accepted_tokens) if req.num_draft_tokens else None
                if req.status == RequestStatus.PREEMPTED:
                    queued.append(req)
                req.status = status
                finished.append(req)
            outputs.append(
                EngineCoreOutput(
                    rid,
                    list(token_ids),
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=req.stop_reason,
                    new_logprobs=None if logprobs is None else logprobs[: len(token_ids)],
                    num_cached_tokens=self._cached(req, first),
                    prompt_logprobs=req.prompt_logprobs if first else None,
                    spec_decoding=spec,
                )
            )
        for rid, embedding in runner_output.pooled.items():  # a pooling request ends with its prompt
            if (req := self.requests.get(rid)) is not None:
                if req.status == RequestStatus.PREEMPTED:
                    queued.append(req)
                req.status = RequestStatus.FINISHED_STOPPED
                finished.append(req)
                cached = self._cached(req, True)
                outputs.append(EngineCoreOutput(rid, [], "stop", num_cached_tokens=cached, pooled=embedding))
        self._release(finished, queued)
        return outputs

    @staticmethod
    def _cached(req: Request, first: bool) -> int:
        # Reported once, with the request's first output.
        return max(req.num_cached_tokens, 0) if first else 0
