"""The OpenAI-compatible HTTP server: Starlette routes over AsyncLLM, and `kiln serve`'s process lifecycle.

Request and response bodies are msgspec Structs (server/protocol.py): unknown fields are ignored, a
wrong type is a 400 that names the field; every error leaves in OpenAI's shape (server/errors.py).
`build_app(llm)` is the whole HTTP surface (tests drive it with a fake llm); `serve(...)` builds the
engine first, then listens: the port accepts connections only once the model is loaded and compiled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import resource
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from engine.errors import EngineDeadError
from engine.processes import die_with_parent
from server.errors import APIError, as_api_error, json_response
from server.guard import APIKeyMiddleware, RequestGuard
from server.memory import ReleaseWhenIdle, return_large_buffers_to_the_system
from server.protocol import HealthResponse, ModelCard, ModelList, TokenizerInfoResponse, VersionResponse
from server.serving import DEFAULT_MAX_BODY_BYTES, SHUTTING_DOWN, Disconnected, Serving
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing
from server.serving_embedding import EmbeddingServing
from server.serving_responses import ResponsesServing
from server.serving_tokenize import TokenizeServing
from server.transport import uvicorn_config

logger = logging.getLogger("kiln.server")
STATS_MAX_AGE_S = 1.0  # /metrics answers from engine stats at most this old
HEALTH_MAX_AGE_S = 5.0  # /health answers from stats this old while fresher ones are fetched
# Why the core died (a worker's exception, paths, exit codes) goes to the log, not to clients.
UNAVAILABLE = "the engine core is unavailable"


class Routes:
    """The endpoints besides the generating ones and (de)tokenizing: health, version, models, metrics."""

    def __init__(self, serving: Serving) -> None:
        self.s = serving
        self._stats_call: asyncio.Future | None = None
        self._stats_at = -float("inf")
        self._reported: str | None = None

    async def stats(self, timeout: float, max_age: float = STATS_MAX_AGE_S) -> dict:
        """The engine core's stats, refreshed once they are STATS_MAX_AGE_S old: a flood of /health or
        /metrics calls costs the core at most one stats call a second, and concurrent callers share the
        one in flight. Stats younger than `max_age` answer at once, the refresh running behind them."""
        age = time.monotonic() - self._stats_at
        if age >= STATS_MAX_AGE_S and (self._stats_call is None or self._stats_call.done()):
            self._stats_call = asyncio.ensure_future(self._refresh_stats())
            self._stats_call.add_done_callback(lambda call: call.cancelled() or call.exception())
        if age < max_age:
            return self.s.metrics.engine.stats
        return await asyncio.wait_for(asyncio.shield(self._stats_call), timeout)  # type: ignore[arg-type]

    async def _refresh_stats(self) -> dict:
        self.s.metrics.engine.stats = await self.s.llm.get_stats()
        self._stats_at = time.monotonic()
        return self.s.metrics.engine.stats

    async def health(self, request: Request) -> Response:
        """Ready and alive: the engine core answered a stats call in the last HEALTH_MAX_AGE_S (a dead core
        is noticed within ~0.2 s), so /health never waits for a step to end. 503 while the server
        drains for shutdown, so a load balancer sends nothing new."""
        if self.s.draining:
            raise APIError(503, SHUTTING_DOWN)
        if not self.s.llm.dead:
            try:
                await self.stats(timeout=10.0, max_age=HEALTH_MAX_AGE_S)
            except (EngineDeadError, TimeoutError, RuntimeError) as e:
                self._unhealthy(f"the engine core is not responding: {self.s.llm.dead or e!r}")
        if self.s.llm.dead:
            self._unhealthy(f"the engine core is dead: {self.s.llm.dead}")
        if dead := self.s.llm.dead_cores:
            # The live cores still serve, but the server is short of capacity until it is restarted.
            names = ", ".join(m.group() if (m := re.match(r"engine core \d+", d)) else "a core" for d in dead)
            self._unhealthy("; ".join(dead), f"{names} unavailable; the other engine cores still serve")
        return json_response(HealthResponse(status="ok"))

    def _unhealthy(self, detail: str, message: str = UNAVAILABLE) -> NoReturn:
        if detail != self._reported:  # a load balancer polls: each reason is logged once
            logger.warning("/health: %s", detail)
            self._reported = detail
        raise APIError(503, message)

    async def version(self, request: Request) -> Response:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            v = package_version("kiln-llm")
        except PackageNotFoundError:
            v = "unknown"
        return json_response(VersionResponse(version=v))

    async def models(self, request: Request) -> Response:
        card = ModelCard(
            id=self.s.model_name,
            object="model",
            created=self.s.created,
            owned_by="kiln",
            root=getattr(self.s.llm, "model_dir", None),
            max_model_len=self.s.llm.max_model_len,
        )
        return json_response(ModelList(object="list", data=[card]))

    async def metrics_route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        if not self.s.llm.dead:
            try:
                await self.stats(timeout=5.0)
            except Exception as e:  # keep serving the last known values
                logger.warning("could not refresh engine stats: %s", e)
        return Response(self.s.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenizer_info(self, request: Request) -> Response:
        """What a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it)."""
        tok, optional = self.s.llm.tokenizer, ("bos_token", "eos_token", "pad_token", "chat_template")
        return json_response(
            TokenizerInfoResponse(
                tokenizer_class=type(tok).__name__,
                model_max_length=self.s.llm.max_model_len,
                vocab_size=self.s.llm.processor.vocab_size,
                **{k: getattr(tok, k, None) for k in optional},
            )
        )


def _route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every way a request can fail becomes an OpenAI-shaped error; a client that left gets a bare 499.
    Once the engine core is gone every route is a 503: nothing a client asks can be answered right."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            if request.app.state.server.llm.dead:
                raise APIError(503, UNAVAILABLE)
            return await handler(request)
        except (Disconnected, ClientDisconnect):
            return Response(status_code=499)
        except Exception as e:
            return as_api_error(e, f"in {request.method} {request.url.path}").response()

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}").response()


async def _server_error(request: Request, exc: Exception) -> Response:
    return APIError(500, "internal server error").response()


def build_app(
    llm,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    trust_request_chat_template: bool = False,
    sanitize_special_tokens: bool = False,
    tool_call_parser: str | None = None,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The HTTP app over an AsyncLLM (or anything with its attributes: tokenizer, processor, max_model_len,
    model_name, dead, dead_cores, generate, chat_prompt, get_stats, check_capacity, embedding_params).
    `allowed_hosts` None: any Host (an app that serve() did not bind to an address of its own)."""
    serving = Serving(
        llm, max_body_bytes, trust_request_chat_template, sanitize_special_tokens, tool_call_parser
    )
    misc, completion, chat = Routes(serving), CompletionServing(serving), ChatServing(serving)
    responses = ResponsesServing(chat)
    embeddings, tokenizing = EmbeddingServing(serving), TokenizeServing(serving)
    routes = [
        Route("/health", _route(misc.health), methods=["GET"]),
        Route("/version", _route(misc.version), methods=["GET"]),
        Route("/metrics", _route(misc.metrics_route), methods=["GET"]),
        Route("/v1/models", _route(misc.models), methods=["GET"]),
        Route("/v1/completions", _route(completion.create), methods=["POST"]),
        Route("/v1/chat/completions", _route(chat.create), methods=["POST"]),
        Route("/v1/responses", _route(responses.create), methods=["POST"]),
        Route("/v1/embeddings", _route(embeddings.create), methods=["POST"]),
        Route("/tokenize", _route(tokenizing.tokenize), methods=["POST"]),
        Route("/detokenize", _route(tokenizing.detokenize), methods=["POST"]),
        Route("/tokenizer_info", _route(misc.tokenizer_info), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = serving
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # With a key, a page that reached the server by a rebound name still cannot authenticate.
    hosts = None if api_key else allowed_hosts
    app.add_middleware(RequestGuard, allowed_origins=allowed_origins, allowed_hosts=hosts)
    app.add_middleware(ReleaseWhenIdle)  # outermost: refused requests count as work too
    return app


# ---- kiln serve ----------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    """Bind now (a taken port fails before the model loads); uvicorn listens only once the engine is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def raise_open_file_limit(target: int = 65536) -> int:
    """Lift the soft limit on open files toward the hard one: each connection holds a descriptor, and
    a default soft limit of 1024 refuses connections long before the engine is busy. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(max(target, soft), hard)
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def serve(
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    engine_args: dict[str, Any] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    trust_request_chat_template: bool = False,
    sanitize_special_tokens: bool = False,
    tool_call_parser: str | None = None,
    shutdown_timeout: float = 30.0,
    exit_on_engine_death: bool = False,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    api_server_count: int = 1,
    api_server: str | None = None,
    argv: Sequence[str] = (),
) -> int:
    """`api_server_count` > 1: this process launches that many API servers (server/launcher.py), each
    `kiln serve` run again from `argv` with `api_server` ("DIR:CLIENT:CLIENTS:FD:PID": the launcher's
    directory, its client index and count, the listening socket it inherits, and the launcher's pid)."""
    import uvicorn

    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig

    engine_args = dict(engine_args or {})
    # Bad engine flags fail here, before anything starts.
    c = EngineConfig(model=model, **{"usage": "serving", **engine_args})
    if api_server_count > 1 and c.engine_core_addresses:
        raise ValueError(
            "--api-server-count starts its engine cores itself: not with --engine-core-addresses"
        )
    try:
        if api_server:  # one of the launcher's (server/launcher.py): it goes with it
            attach, fd, launcher = api_server.rsplit(":", 2)
            die_with_parent(int(launcher))
            sock, engine_args["api_server"] = socket.socket(fileno=int(fd)), attach
        else:
            sock = _bind(host, port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", host, port, e)
        return 1
    if api_server_count > 1 and not api_server:
        from server.launcher import launch

        try:
            return launch(
                model, sock, api_server_count, {**engine_args, "usage": "serving"}, argv, shutdown_timeout
            )
        finally:
            sock.close()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    raise_open_file_limit()
    return_large_buffers_to_the_system()

    class _Server(uvicorn.Server):
        exit_code = 0

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("serving %s at %s (Ctrl-C to stop)", llm.model_name, url)
                if host in ("0.0.0.0", "::") and not api_key and "*" not in allowed_hosts:
                    logger.info("Host names besides IP addresses and localhost need --allowed-hosts")
                if exit_on_engine_death:
                    self.watch = asyncio.get_running_loop().create_task(self.exit_when_engine_dies())

        async def exit_when_engine_dies(self) -> None:
            while not self.should_exit:
                if dead := llm.dead or "; ".join(llm.dead_cores):
                    logger.error("an engine core died (%s): exiting, as --exit-on-engine-death asks", dead)
                    self.exit_code, self.should_exit = 1, True
                await asyncio.sleep(0.5)

        def handle_exit(self, sig: int, frame) -> None:
            if api_server and sig == signal.SIGINT:  # Ctrl-C is the launcher's, which sends SIGTERM
                return
            if serving.draining or not self.started:  # a second signal, or none served yet: stop now
                super().handle_exit(sig, frame)
                return
            serving.draining = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(self.drain()))

        async def drain(self) -> None:
            """Let requests in flight finish (new ones get 503, /health too); a second before the deadline
            end the rest with an error event, then stop."""
            logger.info("draining %d requests for at most %.0f s", len(llm.queues), shutdown_timeout)
            deadline = time.monotonic() + max(shutdown_timeout - 1, 0)
            while llm.queues and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if llm.queues:
                llm.fail_all(APIError(503, SHUTTING_DOWN))
                await asyncio.sleep(0.5)  # time for the error events to go out
            self.should_exit = True

    # uvicorn re-raises the signal it stopped for once it is done; make SIGTERM unwind through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    llm = None
    try:
        logger.info("loading the model and warming up the engine; %s opens once it is ready", url)
        llm = AsyncLLM(model, **engine_args)
        app = build_app(
            llm,
            api_key,
            max_body_bytes,
            trust_request_chat_template,
            sanitize_special_tokens,
            tool_call_parser,
            allowed_origins=allowed_origins,
            allowed_hosts=[host, *allowed_hosts],
        )
        serving = app.state.server
        seqs = c.resolved(on_cuda=False).max_num_seqs  # the device does not change it
        config = uvicorn_config(app, seqs + c.max_pending_requests + 256, log_level)
        server = _Server(config)
        server.run(sockets=[sock])
        if server.exit_code:
            return server.exit_code
    except EngineDeadError as e:
        logger.error("the engine failed to start: %s", e)
        return 1
    finally:
        sock.close()
        if llm is not None:
            llm.shutdown()
    return 0
