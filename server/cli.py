"""The `kiln` command line: generate, serve, and `kiln bench ...` (handed to server/bench/cli.py)."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from engine.cluster import new_secret
from engine.config import cli_fields

MODEL_HELP = "HF directory or .gguf file (default: the embedded SmolLM2)"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them: one per EngineConfig field with command-line help."""
    g = parser.add_argument_group("engine")
    for name, (kind, default, text) in cli_fields().items():
        flag = "--" + name.replace("_", "-")
        typed = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        if issubclass(kind, msgspec.Struct):  # JSON, which the config decodes
            typed = {"type": str}
        g.add_argument(flag, default=default, help=text, **typed)


def engine_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in cli_fields()}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from the defaults, as `kiln serve` takes them."""
    flags = []
    for name, (_, default, _) in cli_fields().items():
        if (value := getattr(args, name)) != default:
            flag = "--" + ("no-" if value is False else "") + name.replace("_", "-")
            flags += [flag] if isinstance(value, bool) else [flag, str(value)]
    return flags


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio

    from engine.async_llm import AsyncLLM
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
    if args.headless:
        from engine.headless import serve_headless

        key_file = args.cluster_key_file
        args.cluster_key_file = None  # this host's own, not an engine flag from the front end
        if args.model_path or args.model or engine_flags(args):
            raise ValueError(
                "a headless engine core takes the model and engine flags from the front end that connects "
                "to it (kiln serve MODEL ... --engine-core-addresses tcp://HOST:PORT); give only "
                "--host, --port and --cluster-key-file"
            )
        return serve_headless(f"tcp://{args.host}:{args.port}", key_file)
    from server.api import serve

    return serve(
        args.model_path or args.model,
        host=args.host,
        port=args.port,
        api_server_count=args.api_server_count,
        api_server=args.api_server,
        argv=args.argv,
        api_key=args.api_key,
        engine_args={**engine_args(args), "served_model_name": args.served_model_name},
        max_body_bytes=args.max_request_body_bytes,
        log_level=args.uvicorn_log_level,
        trust_request_chat_template=args.trust_request_chat_template,
        sanitize_special_tokens=args.sanitize_special_tokens,
        tool_call_parser=args.tool_call_parser,
        shutdown_timeout=args.shutdown_timeout,
        exit_on_engine_death=args.exit_on_engine_death,
        allowed_origins=_names(args.allowed_origins),
        allowed_hosts=_names(args.allowed_hosts),
    )


def _names(flag: str) -> list[str]:
    return [name.strip() for name in flag.split(",") if name.strip()]


def add_serve_parser(sub) -> None:
    import os

    from server.api import DEFAULT_MAX_BODY_BYTES
    from server.tools import PARSERS

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    serve.add_argument("--model", default=None, help="same as MODEL")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: MODEL's)"
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KILN_API_KEY)",
    )
    serve.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight get to finish after SIGTERM or Ctrl-C, then end with an error",
    )
    serve.add_argument(
        "--exit-on-engine-death",
        action="store_true",
        help="exit (code 1) when the engine core dies, for a supervisor to restart; default: answer 503",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP server processes on the port, each tokenizing and detokenizing for its own requests, all "
        "reaching every engine core (scale it with --data-parallel-size)",
    )
    serve.add_argument("--api-server", default=None, help=argparse.SUPPRESS)  # one of those, started by it
    serve.add_argument(
        "--headless",
        action="store_true",
        help="run an engine core alone, listening at --host:--port (and the port after it) for a front "
        "end started elsewhere with --engine-core-addresses; no HTTP",
    )
    serve.add_argument(
        "--sanitize-special-tokens",
        action="store_true",
        help="remove special-token strings (e.g. <|im_start|>) from every string a request gives the chat "
        "template (contents, tool calls and definitions, chat_template_kwargs), so that a user cannot type "
        "role markers; default: kept, as vLLM does",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGIN[,ORIGIN...]",
        help="web pages (e.g. http://localhost:3000) whose requests are answered, with CORS headers; '*' "
        "allows any; default: none, so a request carrying an Origin header is a 403",
    )
    serve.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAME[,NAME...]",
        help="Host names the server answers to besides IP addresses, localhost and --host (DNS-rebinding "
        "protection, only without --api-key); '*' allows any",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=list(PARSERS),
        default=None,
        help="how the model writes tool calls, for tool_choice 'auto' (default: what the chat template "
        "implies: hermes for <tool_call>, llama3_json for <|python_tag|>)",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own Jinja chat template (chat_template_kwargs.chat_template)",
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: a compile-first LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_serve_parser(sub)
    key = sub.add_parser("cluster-key", help="print a new cluster secret, for --cluster-key-file")
    key.set_defaults(func=lambda _: print(new_secret()) or 0)
    bench = sub.add_parser("bench", help="benchmarks (numbers to record in BENCHMARKS.md)", add_help=False)
    bench.set_defaults(func=None)

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmarks parse their own flags; nothing else imports them
        from server.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv  # what `kiln serve --api-server-count` runs again in each API server
    api = getattr(args, "api_server", None)  # one of several API servers: its lines say which
    where = f"[api {api.split(':')[-4]}] " if api else ""
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s %(asctime)s {where}%(message)s", datefmt="%H:%M:%S"
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        parser.error(str(e))  # exits with status 2


if __name__ == "__main__":
    sys.exit(main())
