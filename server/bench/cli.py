"""`kiln bench ...`: the benchmarks' command line (server/cli.py hands `bench` over to `main`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from server.cli import add_engine_args, engine_args, engine_flags


def run(args: argparse.Namespace) -> int:
    if args.bench == "scheduler":
        from server.bench.scheduler import run

        result = run(num_requests=args.num_requests, steps=args.steps)
        print(json.dumps(result, indent=2))
    elif args.bench == "startup":
        from server.bench.startup import run

        result = run(args.model, args.dtype, tuple(args.engine_arg))
        print(f"time to first token: cold {result['cold_s']:.1f} s, warm {result['warm_s']:.1f} s")
    elif args.bench == "runner":
        from server.bench import runner as bench

        batches = tuple(int(b) for b in args.batches.split(","))
        result = bench.run(
            args.model,
            args.dtype,
            batches,
            args.context,
            args.steps,
            args.prefill_len,
            compare=not args.no_compare,
            num_threads=args.num_threads,
            quantization=args.quantization,
            against=args.against,
        )
        print(bench.format_report(result))
    elif args.bench == "gpu-check":
        from server.bench import gpu_check

        result = gpu_check.run(
            args.model,
            args.dtype,
            args.device,
            args.max_num_seqs,
            args.context,
            args.steps,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        print(gpu_check.format_report(result))
    elif args.bench == "throughput":
        from server.bench import throughput as bench_throughput

        result = bench_throughput.run(
            args.model,
            engine_args(args),
            args.num_prompts,
            args.input_len_min,
            args.input_len_max,
            args.output_len,
            args.dataset,
            args.seed,
            args.compare,
            args.hf_continuous,
            args.vllm_python,
        )
        print(bench_throughput.format_report(result))
    elif args.bench == "latency":
        from server.bench import latency as bench_latency

        lens = tuple(int(n) for n in args.input_lens.split(","))
        result = bench_latency.run(
            args.model,
            engine_args(args),
            lens,
            args.output_len,
            args.iters,
            args.seed,
            args.compare,
            args.llama_cpp_python,
        )
        print(bench_latency.format_report(result))
    elif args.bench == "serve":
        from server.bench import serve as bench_serve
        from server.bench import vllm_cpu

        def serve_run(base_url: str) -> dict:
            return bench_serve.run(
                base_url,
                args.model,
                args.endpoint,
                args.num_prompts,
                args.input_len_min,
                args.input_len_max,
                args.output_len,
                args.dataset,
                args.tokenizer or args.launch or None,
                args.request_rate,
                args.max_concurrency,
                args.seed,
                args.api_key,
                args.ignore_eos,
            )

        if args.launch is None:
            if args.compare:
                raise ValueError("--compare vllm launches both servers: it needs --launch")
            result = serve_run(args.base_url)
        else:
            vllm_python = vllm_cpu.python(args.vllm_python) if args.compare else None
            flags = engine_flags(args) + (["--api-key", args.api_key] if args.api_key else [])
            flags += ["--api-server-count", str(args.api_server_count)]
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
            with bench_serve.launch(args.launch or None, flags) as (url, _):
                result = serve_run(url)
                card = bench_serve.model_card(url, headers)
            if vllm_python:
                import torch

                from compiled.loader import resolve_dtype

                dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
                threads = args.num_threads or len(os.sched_getaffinity(0))
                result = bench_serve.against_vllm(result, card, dtype, threads, vllm_python, serve_run)
        print(bench_serve.format_report(result))
    elif args.bench == "structured":
        from server.bench import structured

        result = structured.run(args.model, engine_args(args), args.output_len, args.rounds)
        print(structured.format_report(result))
    elif args.bench == "spec":
        from server.bench import spec

        concurrency = tuple(int(n) for n in args.concurrency.split(","))
        flags = engine_args(args)
        result = spec.run(
            args.model,
            flags,
            args.spec,
            args.output_len,
            concurrency,
            args.rounds,
            args.compare,
            args.llama_cpp_python,
        )
        print(spec.format_report(result))
    elif args.bench == "soak":
        from server.bench import soak

        log = Path(args.server_log) if args.server_log else None
        flags = engine_flags(args)
        result = soak.run(args.model, flags, args.requests, args.duration, args.clients, args.seed, log)
        print(soak.format_report(result))
    elif args.bench == "random-model":
        from server.bench.models import random_model

        result = {"model": random_model(args.shape, args.out)}
        print(result["model"])
    elif args.bench == "attack":
        from server.bench import attack

        log = Path(args.server_log) if args.server_log else None
        result = attack.run(args.model, engine_flags(args), args.duration, args.baseline, args.good, log)
        print(attack.format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result.get("ok", True) else 1


def parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(
        prog="kiln bench", description="benchmarks (numbers to record in BENCHMARKS.md)"
    )
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
    runner.add_argument("--quantization", default="none", help="none, gguf, int8, int4 or w8a8 (not auto)")
    runner.add_argument(
        "--against", default=None, help="QUANTIZATION:DTYPE: compiled kiln on those weights instead of eager"
    )
    shape = kinds.add_parser("random-model", help="write a random-weight model of a larger shape, once")
    shape.add_argument("--shape", default="llama-3.2-1b")
    shape.add_argument("--out", default=None, help="directory (default: under the cache)")
    startup = kinds.add_parser("startup", help="process start to first token, cold and warm compile cache")
    startup.add_argument("--model", default=None)
    startup.add_argument("--dtype", default="auto")
    startup.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra `kiln generate` flag, e.g. --engine-arg=--max-num-seqs=16",
    )
    gpu = kinds.add_parser(
        "gpu-check",
        help="on CUDA: greedy exactness, CUDA graphs per decode bucket, "
        "compiled vs eager decode tok/s per bucket",
    )
    gpu.add_argument("--model", default=None)
    gpu.add_argument("--dtype", default="float32")
    gpu.add_argument("--device", default="cuda", help="cuda, or cpu to run it without CUDA graphs")
    gpu.add_argument("--max-num-seqs", type=int, default=64)
    gpu.add_argument("--context", type=int, default=512)
    gpu.add_argument("--steps", type=int, default=8)
    gpu.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run the whole engine split over this many devices: exactness and decode tok/s",
    )
    throughput = kinds.add_parser(
        "throughput", help="offline batch through LLM.generate: requests/s and tokens/s"
    )
    latency = kinds.add_parser(
        "latency", help="batch 1: time to first token and decode tok/s against the roofline"
    )
    serve = kinds.add_parser(
        "serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, E2E and throughput"
    )
    for p in (throughput, latency):
        p.add_argument(
            "--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)"
        )
        p.add_argument("--output-len", type=int, default=128)
        add_engine_args(p)
    throughput.add_argument(
        "--compare",
        choices=["transformers", "vllm"],
        default=None,
        help="also run transformers, or vLLM's CPU backend, on the same prompts, weights, dtype and threads",
    )
    throughput.add_argument(
        "--no-continuous-batching-baseline",
        dest="hf_continuous",
        action="store_false",
        help="with --compare: only transformers' static batches (its continuous batching takes "
        "tens of minutes on a small CPU)",
    )
    for p in (throughput, serve):
        p.add_argument(
            "--vllm-python",
            default=None,
            help="the vLLM peer's Python (default: $KILN_VLLM_PYTHON, else the venv "
            "../shared/peers/setup-vllm-cpu.sh makes)",
        )
        p.add_argument("--input-len-min", type=int, default=32, help="random prompts: shortest, in tokens")
        p.add_argument("--input-len-max", type=int, default=512, help="random prompts: longest, in tokens")
        p.add_argument(
            "--dataset", default=None, help="JSONL file whose lines have a 'prompt' field, instead"
        )
    for p in (throughput, latency, serve):
        p.add_argument(
            "--seed", type=int, default=0, help="seed of the random prompts (and of serve's arrivals)"
        )
    throughput.add_argument("--num-prompts", type=int, default=256)
    latency.add_argument(
        "--input-lens", default="128,512,2048", help="prompt lengths, capped by max_model_len"
    )
    latency.add_argument("--iters", type=int, default=3, help="timed requests per length, after one warm-up")
    latency.add_argument(
        "--compare",
        choices=["transformers", "llama.cpp"],
        default=None,
        help="also run transformers (same weights), or llama.cpp on the same GGUF file",
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second, or inf"
    )
    serve.add_argument("--max-concurrency", type=int, default=16)
    serve.add_argument(
        "--compare",
        choices=["vllm"],
        default=None,
        help="with --launch: then run `vllm serve` (vLLM's CPU backend) on the same model, dtype, context "
        "and threads, load it the same way, and print both and the ratios",
    )
    serve.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens (an extension; --no-ignore-eos for servers without it, "
        "e.g. transformers serve)",
    )
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="model directory or .gguf whose tokenizer makes the random prompts (default: the launched "
        "model, else the embedded SmolLM2)",
    )
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or None)
    serve.add_argument("--api-server-count", type=int, default=1, help="with --launch: kiln's HTTP servers")
    serve.add_argument(
        "--launch",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL",
        help="start `kiln serve MODEL` (default model if none) on a free port with the engine flags "
        "below, run against it, then stop it",
    )
    add_engine_args(serve)
    soak = kinds.add_parser(
        "soak", help="launch `kiln serve` and soak it with misbehaving clients; then check it recovered"
    )
    soak.add_argument("model", nargs="?", default=None, help="what to serve (default: the embedded SmolLM2)")
    soak.add_argument("--requests", type=int, default=2000)
    soak.add_argument("--duration", type=float, default=300.0, help="seconds the requests are spread over")
    soak.add_argument("--clients", type=int, default=64)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--server-log", default=None, help="keep the server's output in this file")
    add_engine_args(soak)
    attack = kinds.add_parser(
        "attack", help="good streaming clients alone, then beside every hostile client at once; then recovery"
    )
    attack.add_argument(
        "model", nargs="?", default=None, help="what to serve (default: the embedded SmolLM2)"
    )
    attack.add_argument("--duration", type=float, default=600.0, help="seconds the attackers run")
    attack.add_argument("--baseline", type=float, default=120.0, help="seconds the good clients run alone")
    attack.add_argument("--good", type=int, default=4, help="well-behaved streaming clients")
    attack.add_argument("--server-log", default=None, help="keep the server's output in this file")
    add_engine_args(attack)
    structured = kinds.add_parser(
        "structured", help="a JSON schema's cost per output token at batch 1 and 16, and its TTFT"
    )
    structured.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    structured.add_argument("--output-len", type=int, default=128)
    structured.add_argument("--rounds", type=int, default=3, help="timed runs of each kind, taking turns")
    add_engine_args(structured)
    spec = kinds.add_parser(
        "spec", help="speculative decoding off against n-gram drafts: input-grounded and open-ended chat"
    )
    spec.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    spec.add_argument(
        "--spec",
        default='{"method": "ngram", "num_speculative_tokens": 16, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
        help="the speculative config of the drafting engine (on a CPU most of a verify step's cost comes "
        "with its first draft)",
    )
    spec.add_argument("--output-len", type=int, default=256, help="longest answer, in tokens")
    spec.add_argument("--concurrency", default="1,4,16", help="streams served at once")
    spec.add_argument("--rounds", type=int, default=2, help="timed runs of each engine, taking turns")
    spec.add_argument(
        "--compare",
        choices=["llama.cpp"],
        default=None,
        help="also run llama.cpp on the same GGUF file, a request at a time, plain and by its prompt lookup",
    )
    for p in (latency, spec):
        p.add_argument(
            "--llama-cpp-python",
            default=None,
            help="the llama.cpp peer's Python (default: $KILN_LLAMA_CPP_PYTHON, else the venv "
            "../shared/peers/setup-llama-cpp.sh makes)",
        )
    add_engine_args(spec)
    for p in (sched, runner, startup, gpu, throughput, latency, serve, soak, attack, structured, spec):
        p.add_argument("--json", default=None, help="also write the results to this file")
    return bench


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        p.error(str(e))
        return 2
