"""Scheduler overhead per step with a fake model runner: the CPU cost the engine core pays between
forwards. `kiln bench scheduler` calls run()."""

from __future__ import annotations

import random
import time

from engine.params import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput, SchedulerOutput


def _fake_runner(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    # A request samples when its chunk reached its known tokens (computed already advanced in schedule()).
    req_ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    sampled = [
        [rng.randrange(1, 32000)] if reqs[r].num_computed_tokens == reqs[r].num_tokens else []
        for r in req_ids
    ]
    return ModelRunnerOutput(req_ids, sampled)


def run(
    num_requests: int = 256,
    steps: int = 200,
    prompt_len: int = 128,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    seed: int = 0,
) -> dict:
    """Time schedule() + update_from_output() over `steps` decode steps of `num_requests` requests.

    The prompts are prefilled first (untimed), so every timed step is pure decode at full batch.
    The fake runner's own cost is excluded. Returns microseconds per step and per request-step.
    """
    rng = random.Random(seed)
    blocks_per_req = -(-(prompt_len + steps + 2) // block_size)
    config = SchedulerConfig(
        max_model_len=prompt_len + steps + 16,
        num_blocks=num_requests * blocks_per_req + 1,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(max_num_batched_tokens, num_requests),
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    sched = Scheduler(config, eos_token_id=0)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        sched.add_request(Request(f"req-{i}", prompt, params))

    # Warm up until every request is decoding.
    warmup = 0
    while len(sched.running) < num_requests or any(r.num_output_tokens == 0 for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, _fake_runner(sched, out, rng))
        warmup += 1
        if warmup > 10_000:
            raise RuntimeError("warm-up did not converge")

    t_sched = t_update = 0.0
    num_scheduled = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_out = _fake_runner(sched, out, rng)
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        t_sched += t1 - t0
        t_update += t3 - t2
        num_scheduled += len(out.num_scheduled_tokens)

    us_per_step = (t_sched + t_update) * 1e6 / steps
    return {
        "num_requests": num_requests,
        "steps": steps,
        "avg_batch": num_scheduled / steps,
        "schedule_us_per_step": t_sched * 1e6 / steps,
        "update_us_per_step": t_update * 1e6 / steps,
        "us_per_step": us_per_step,
        "us_per_request": us_per_step * steps / max(num_scheduled, 1),
    }
