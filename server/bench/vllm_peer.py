"""vLLM's offline `LLM.generate` as a throughput peer: run by the peer's own Python (vLLM's CPU backend,
../shared/peers), never imported by kiln. Reads the workload from a JSON file, generates exactly
`output_len` tokens for every prompt (greedy, past EOS) and writes what it measured to another.

    python -P vllm_peer.py REQUEST.json RESULT.json

REQUEST: {"model": dir, "dtype": str, "max_model_len": n, "prompts": [[token ids]], "output_len": n}.
RESULT: {"version", "max_num_seqs", "max_num_batched_tokens", "elapsed_s", "prompt_tokens", "output_tokens"},
or {"error": str}.
The clock runs as kiln's does: from the first submitted prompt to the last finished one, after a warm-up.
"""

import json
import sys
import time


def main() -> None:
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as f:
        req = json.load(f)
    try:
        import vllm
        from vllm.inputs import TokensPrompt

        llm = vllm.LLM(
            model=req["model"],
            dtype=req["dtype"],
            max_model_len=req["max_model_len"],
            generation_config="vllm",
            seed=0,
        )
        params = vllm.SamplingParams(temperature=0.0, max_tokens=req["output_len"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        llm.generate(prompts[:1], vllm.SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        sched = llm.llm_engine.vllm_config.scheduler_config
        result = {
            "version": vllm.__version__,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "elapsed_s": elapsed,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }
    except Exception as e:  # reported beside kiln's figures, not raised into its run
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core by spawning, which imports this file again
    main()
