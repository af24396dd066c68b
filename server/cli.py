"""The `kiln` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default=d.dtype, help="auto (bfloat16 where fast, else float32), float32, bfloat16")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 1024 on CPU, 8192 on CUDA or without chunked prefill)")
    g.add_argument("--max-num-batched-tokens-decoding", type=int, default=None,
                   help="tokens per step while requests decode (default: 128 when serving on CPU, else no limit)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes for the KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    g.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    g.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="only 1 is supported")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine core")


def engine_args(args: argparse.Namespace) -> dict:
    names = ["dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "max_num_batched_tokens_decoding", "block_size",
             "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching", "enable_chunked_prefill",
             "long_prefill_token_threshold", "enforce_eager", "tensor_parallel_size", "num_threads"]
    return {n: getattr(args, n) for n in names}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from the defaults, as `kiln serve` takes them."""
    defaults = argparse.ArgumentParser()
    add_engine_args(defaults)
    flags = []
    for name, value in engine_args(args).items():
        if value != defaults.get_default(name):
            flag = "--" + name.replace("_", "-")
            flags += [flag] if value is True else ["--no-" + flag[2:]] if value is False else [flag, str(value)]
    return flags


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio

    from engine.llm import AsyncLLM
    from engine.params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    llm = AsyncLLM(args.model, **engine_args(args))
    prompt = args.prompt if args.raw else llm.chat_prompt([{"role": "user", "content": args.prompt}])

    async def stream() -> None:
        async for out in llm.generate(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(stream())
    finally:
        llm.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from server.api import serve

    return serve(args.model_path or args.model, host=args.host, port=args.port, api_key=args.api_key,
                 engine_args={**engine_args(args), "served_model_name": args.served_model_name},
                 max_body_bytes=args.max_request_body_bytes, log_level=args.uvicorn_log_level)


def add_serve_parser(sub) -> None:
    import os

    from server.api import DEFAULT_MAX_BODY_BYTES

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF directory or .gguf file (default: the embedded SmolLM2)")
    serve.add_argument("--model", default=None, help="same as MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL's)")
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KILN_API_KEY)")
    serve.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    serve.add_argument("--uvicorn-log-level", default="info")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    if args.bench == "scheduler":
        from engine.bench_scheduler import run

        result = run(num_requests=args.num_requests, steps=args.steps)
        print(json.dumps(result, indent=2))
    elif args.bench == "startup":
        from engine.bench_startup import run

        result = run(args.model, args.dtype, tuple(args.engine_arg))
        print(f"time to first token: cold {result['cold_s']:.1f} s, warm {result['warm_s']:.1f} s")
    elif args.bench == "runner":
        from compiled import bench

        batches = tuple(int(b) for b in args.batches.split(","))
        result = bench.run(args.model, args.dtype, batches, args.context, args.steps, args.prefill_len,
                           compare=not args.no_compare, num_threads=args.num_threads)
        print(bench.format_report(result))
    elif args.bench == "gpu-check":
        from compiled import gpu_check

        result = gpu_check.run(args.model, args.dtype, args.device, args.max_num_seqs, args.context, args.steps)
        print(gpu_check.format_report(result))
    elif args.bench == "throughput":
        from engine import bench_throughput

        result = bench_throughput.run(args.model, engine_args(args), args.num_prompts, args.input_len_min,
                                      args.input_len_max, args.output_len, args.dataset, args.seed, bool(args.compare),
                                      args.hf_continuous)
        print(bench_throughput.format_report(result))
    elif args.bench == "latency":
        from engine import bench_latency

        lens = tuple(int(n) for n in args.input_lens.split(","))
        result = bench_latency.run(args.model, engine_args(args), lens, args.output_len, args.iters, args.seed,
                                   bool(args.compare))
        print(bench_latency.format_report(result))
    elif args.bench == "serve":
        from server import bench_serve

        def serve_run(base_url: str) -> dict:
            return bench_serve.run(base_url, args.model, args.endpoint, args.num_prompts, args.input_len_min,
                                   args.input_len_max, args.output_len, args.dataset,
                                   args.tokenizer or args.launch or None, args.request_rate, args.max_concurrency,
                                   args.seed, args.api_key, args.ignore_eos)

        if args.launch is None:
            result = serve_run(args.base_url)
        else:
            flags = engine_flags(args) + (["--api-key", args.api_key] if args.api_key else [])
            with bench_serve.launch(args.launch or None, flags) as (url, _):
                result = serve_run(url)
        print(bench_serve.format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result.get("ok", True) else 1


def add_bench_parser(sub) -> None:
    import os

    bench = sub.add_parser("bench", help="benchmarks (numbers to record in BENCHMARKS.md)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    sched = kinds.add_parser("scheduler", help="schedule + update cost per step with a fake runner")
    sched.add_argument("--num-requests", type=int, default=256)
    sched.add_argument("--steps", type=int, default=200)
    runner = kinds.add_parser("runner", help="model runner decode/prefill: compiled vs eager vs transformers")
    runner.add_argument("--model", default=None)
    runner.add_argument("--dtype", default="float32")
    runner.add_argument("--batches", default="1,8,32,64")
    runner.add_argument("--context", type=int, default=512)
    runner.add_argument("--steps", type=int, default=8)
    runner.add_argument("--prefill-len", type=int, default=512)
    runner.add_argument("--num-threads", type=int, default=None)
    runner.add_argument("--no-compare", action="store_true", help="skip transformers")
    startup = kinds.add_parser("startup", help="process start to first token, cold and warm compile cache")
    startup.add_argument("--model", default=None)
    startup.add_argument("--dtype", default="auto")
    startup.add_argument("--engine-arg", action="append", default=[],
                         help="extra `kiln generate` flag, e.g. --engine-arg=--max-num-seqs=16")
    gpu = kinds.add_parser("gpu-check", help="on CUDA: greedy exactness, CUDA graphs per decode bucket, "
                                             "compiled vs eager decode tok/s per bucket")
    gpu.add_argument("--model", default=None)
    gpu.add_argument("--dtype", default="float32")
    gpu.add_argument("--device", default="cuda", help="cuda, or cpu to run it without CUDA graphs")
    gpu.add_argument("--max-num-seqs", type=int, default=64)
    gpu.add_argument("--context", type=int, default=512)
    gpu.add_argument("--steps", type=int, default=8)
    throughput = kinds.add_parser("throughput", help="offline batch through LLM.generate: requests/s and tokens/s")
    latency = kinds.add_parser("latency", help="batch 1: time to first token and decode tok/s against the roofline")
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, E2E and throughput")
    for p in (throughput, latency):
        p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--compare", choices=["transformers"], default=None,
                       help="also run transformers on the same prompts, weights, dtype and device")
        add_engine_args(p)
    throughput.add_argument("--no-continuous-batching-baseline", dest="hf_continuous", action="store_false",
                            help="with --compare: only transformers' static batches (its continuous batching takes "
                                 "tens of minutes on a small CPU)")
    for p in (throughput, serve):
        p.add_argument("--input-len-min", type=int, default=32, help="random prompts: shortest, in tokens")
        p.add_argument("--input-len-max", type=int, default=512, help="random prompts: longest, in tokens")
        p.add_argument("--dataset", default=None, help="JSONL file whose lines have a 'prompt' field, instead")
    for p in (throughput, latency, serve):
        p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (and of serve's arrivals)")
    throughput.add_argument("--num-prompts", type=int, default=256)
    latency.add_argument("--input-lens", default="128,512,2048", help="prompt lengths, capped by max_model_len")
    latency.add_argument("--iters", type=int, default=3, help="timed requests per length, after one warm-up")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second, or inf")
    serve.add_argument("--max-concurrency", type=int, default=16)
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="ask for exactly --output-len tokens (an extension; --no-ignore-eos for servers without it, "
                            "e.g. transformers serve)")
    serve.add_argument("--tokenizer", default=None,
                       help="model directory or .gguf whose tokenizer makes the random prompts (default: the launched "
                            "model, else the embedded SmolLM2)")
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or None)
    serve.add_argument("--launch", nargs="?", const="", default=None, metavar="MODEL",
                       help="start `kiln serve MODEL` (default model if none) on a free port with the engine flags "
                            "below, run against it, then stop it")
    add_engine_args(serve)
    for p in (sched, runner, startup, gpu, throughput, latency, serve):
        p.add_argument("--json", default=None, help="also write the results to this file")
    bench.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: a compile-first LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_serve_parser(sub)
    add_bench_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
