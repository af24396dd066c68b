"""The OpenAI-compatible server, live: `python -m server` in a subprocess with the default model,
driven over HTTP by the official `openai` client, httpx and Hypothesis.

One server for the whole module, in eager mode: a first compiled warm-up costs ~45 s on 2 cores and the
engine tests cover the compiled path (KILN_TEST_SERVER_COMPILED=1 runs this module against it too).
The client side does no heavy torch work while the server computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.bench import soak
from server.bench.serve import launch
from tests.conftest import engine_core_of
from tests.test_server_app import JSON, METRIC_NAMES, ROUTES, assert_error, check_response

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--max-num-seqs",
    "16",
    "--kv-cache-memory",
    str(256 << 20),
    "--max-model-len",
    "2048",
    "--api-key",
    KEY,
    "--max-request-body-bytes",
    str(BODY_LIMIT),
]
if os.environ.get("KILN_TEST_SERVER_COMPILED") != "1":
    SERVER_ARGS.append("--enforce-eager")


class LiveServer:
    def __init__(self, url: str, log: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.proc = url, log, proc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def live_server(tmp_path_factory) -> Iterator[LiveServer]:
    """`kiln serve` of the default model (tests/conftest.py: the `server` fixture, one for the session:
    this module's tests and tests/test_responses.py's share it)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
    with launch(None, SERVER_ARGS, timeout=300, log=log, env=env) as (url, proc):
        live = LiveServer(url, log, proc)
        yield live
    assert "Traceback" not in live.log_text(), live.log_text()[-5000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def engine_gauges(http: httpx.Client) -> dict[str, float]:
    return soak.engine_gauges(http.get("/metrics").text)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(http)
        if (len(gauges) == 3 and not any(gauges.values())) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


# ---- the openai client ---------------------------------------------------------------------------


WET = [{"role": "user", "content": "Answer with one word: is water wet?"}]


def test_logit_bias_bans_and_forces_tokens(client):
    def ids(**kw) -> list[int]:
        kw.setdefault("max_tokens", 6)
        extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
        r = client.chat.completions.create(model=MODEL, messages=WET, temperature=0, extra_body=extra, **kw)
        return r.choices[0].token_ids

    greedy = ids()
    banned = ids(logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]
    forced = greedy[0] + 7
    assert ids(logit_bias={str(forced): 100}, max_tokens=3) == [forced] * 3
    assert set(ids(extra_body={"allowed_token_ids": [forced, forced + 1]})) <= {forced, forced + 1}


def test_min_tokens_holds_back_eos(client, http):
    eos = http.get("/tokenizer_info").json()["eos_token"]
    plain = client.chat.completions.create(model=MODEL, messages=WET, temperature=0, max_tokens=64)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 30
    r = client.chat.completions.create(
        model=MODEL,
        messages=WET,
        temperature=0,
        max_tokens=30,
        extra_body={"min_tokens": 30, "skip_special_tokens": False},
    )
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"
    assert eos not in r.choices[0].message.content


def test_bad_words_are_never_written(client):
    kw = dict(model=MODEL, messages=WET, temperature=0, max_tokens=12)
    first = client.chat.completions.create(**kw).choices[0].message.content.split()[0].strip(".,!")
    r = client.chat.completions.create(**kw, extra_body={"bad_words": [first]})
    assert first not in r.choices[0].message.content


def test_embeddings_rank_a_paraphrase_first_and_equal_transformers(client, http, smollm2_hf):
    import torch

    texts = [
        "How do I bake bread?",
        "What is a simple recipe for making bread at home?",
        "The rocket launched.",
    ]
    r = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    floats = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"}).json()
    e = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2] and e.shape == (3, smollm2_hf.config.hidden_size)
    # The same floats but for the batch's kernels: another step may group the prompts otherwise.
    assert torch.allclose(e, torch.tensor([d["embedding"] for d in floats["data"]]), atol=1e-5)
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2]
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for row, t in zip(e, ids):
        with torch.no_grad():
            last = smollm2_hf(torch.tensor([t]), output_hidden_states=True).hidden_states[-1][0, -1].float()
        assert torch.allclose(row, torch.nn.functional.normalize(last, dim=0), atol=1e-4)
    by_ids = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data[0].embedding
    assert torch.allclose(torch.tensor(by_ids), e[0], atol=1e-5)
    for body, param in [({"input": []}, "input"), ({"input": "x", "dimensions": 8}, "dimensions")]:
        assert_error(http.post("/v1/embeddings", json=body), 400, param)


def test_unknown_fields_are_logged_once_by_name(server, client):
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"frobnicate": 1})
    lines = [line for line in server.log_text().splitlines() if "frobnicate" in line]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_health_version_models(server, http, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == 5 and full.usage.total_tokens == 5 + full.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # usage only when asked for
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n_stop_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0.8, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens <= 16
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0.8, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded

    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=["."]
    )
    assert (
        r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text and "Paris" in r.choices[0].text
    )
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=["."], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text

    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and 2 <= len(top) <= 3
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely


def test_chat_stream_equals_non_stream(client):
    kw = dict(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=12,
        temperature=0,
    )
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == msg.content
    assert [c.choices[0].finish_reason for c in body][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_logprobs_parts_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say something."}]}],
        max_completion_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert 1 <= len(content) <= 5
        assert all(len(t.top_logprobs) == 2 and t.bytes is not None for t in content)
    assert r.usage.completion_tokens <= 10


def test_greedy_is_token_exact_with_transformers(http, smollm2_hf):
    from server.bench.driver import hf_greedy

    prompt, n = "The quick brown fox", 24
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()
    choice = r["choices"][0]
    assert len(choice["token_ids"]) == n and choice["finish_reason"] == "length"
    assert hf_greedy(smollm2_hf, choice["prompt_token_ids"], n) == choice["token_ids"]


# ---- load and disconnects ------------------------------------------------------------------------


def test_64_concurrent_streams(server, http, client):
    import openai

    prompts = ["Hello, my name is", "The best way to learn is", "def fibonacci(n):", "In 1969, the first"]
    expected = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in prompts
    ]

    async def one(aclient, i: int):
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompts[i % 4],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return i, chunks

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    for i, chunks in asyncio.run(run()):
        ref = expected[i % 4]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 10
    assert wait_idle(http) == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}


def test_dropped_clients_free_their_kv_blocks(server, http):
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    before = server.log_text().count("finish_reason=abort")

    async def drop_stream(c: httpx.AsyncClient, path: str, payload: dict):
        async with c.stream("POST", path, json={**payload, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # hang up after the first chunk

    async def time_out(c: httpx.AsyncClient):
        with pytest.raises(httpx.TimeoutException):
            await c.post("/v1/completions", json=body, timeout=1.5)

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60, limits=limits) as c:
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell me everything."}],
                "max_tokens": 1500,
            }
            await asyncio.gather(
                *(drop_stream(c, "/v1/completions", body) for _ in range(40)),
                *(drop_stream(c, "/v1/chat/completions", chat) for _ in range(10)),
            )
            await asyncio.gather(*(time_out(c) for _ in range(50)))

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 60
    assert wait_idle(http) == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}
    deadline = time.monotonic() + 5
    while server.log_text().count("finish_reason=abort") - before < 100 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log_text().count("finish_reason=abort") - before == 100
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "ERROR" not in server.log_text(), server.log_text()[-3000:]


def test_metrics_and_access_log(server, http):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 4, "ignore_eos": True},
    ).json()
    text = http.get("/metrics").text
    for name in METRIC_NAMES:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    generated = float(re.search(r"^kiln:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    assert generated >= 4
    assert float(re.search(r"^kiln:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M).group(1)) > 0
    line = next(li for li in server.log_text().splitlines() if r["id"] in li)
    assert re.search(
        r"prompt_tokens=\d+ generation_tokens=4 ttft=[\d.]+s total=[\d.]+s finish_reason=length", line
    )


# ---- bad input -----------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = [
    # (path, body: dict or raw bytes, status, param)
    (C, b'{"prompt": "hi", ', 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b'{"prompt": "\xff\xfe"}', 400, None),
    (C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[1, 2], "x"]}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    (C, {"prompt": [True, False]}, 400, "prompt"),
    (C, {"prompt": "hello " * 2100}, 400, "prompt"),
    (C, {"prompt": "hello " * 30, "max_tokens": 2040}, 400, "max_tokens"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 1000}, 400, "n"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {"prompt": "hi", "min_tokens": 8, "max_tokens": 4}, 400, "min_tokens"),
    (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    (C, {"prompt": "x" * (BODY_LIMIT + 10)}, 413, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
    ),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "n": "two"}, 400, "n"),
    (CHAT, {"messages": USER, "min_tokens": 5000}, 400, "min_tokens"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


def test_bad_input_is_a_clear_4xx(server, http):
    for path, body, status, param in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        err = assert_error(r, status, param)
        if param is not None:
            assert param.split("[")[0].split(".")[0] in err["message"], (
                path,
                body if len(content) < 200 else "...",
                err,
            )
        assert "Traceback" not in err["message"]
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get("/v1/completions"), 405)
    # The API key: /v1 needs it, the health check does not.
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert_error(
        httpx.post(server.url + C, json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert httpx.get(server.url + "/health").status_code == 200
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _cheap(body):
    """Keep a random body's generation short: what would run long is cut to 2 tokens, invalid values stay."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if (key == "max_tokens" and v is None) or (type(v) is int and 4 < v <= 4096):
            body[key] = 2
    if type(body.get("n")) is int and 2 < body["n"] <= 128:
        body["n"] = 2
    if (
        isinstance(body.get("prompt"), list)
        and len(body["prompt"]) > 2
        and all(isinstance(p, list | str) for p in body["prompt"])
    ):
        body["prompt"] = body["prompt"][:2]
    return body


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(ROUTES)), data=st.data())
def test_random_bodies_never_500(http, route, data):
    body = _cheap(data.draw(ROUTES[route]))
    if isinstance(body, dict) and body.get("model") == "fake-model":
        body["model"] = MODEL
    check_response(http.post(route, content=msgspec.json.encode(body), headers=JSON))


DEEP = b"[" * 5000 + b"]" * 5000
NASTY = [
    (C, {"prompt": "hi", "stop": ["x" * 100_000]}),
    (C, {"prompt": "hi", "stop": ["y" * 1024] * 64, "max_tokens": 2}),
    (C, {"prompt": "hi", "n": 10**6}),
    (C, {"prompt": [1, 49152, 60_000]}),  # past the vocabulary
    (C, {"prompt": [[1, 2]] * 300, "max_tokens": 1}),  # prompts x n
    (C, {"prompt": "hi", "n": 128, "max_tokens": 2000, "logprobs": 20}),  # a gigabyte of logprobs
    (C, {"prompt": "hi", "cache_salt": ""}),
    (
        CHAT,
        {
            "messages": USER,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        },
    ),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"tokenize": True, "padding": "max_length"}}),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 300_000}]}),
]


def _greedy(http) -> str:
    body = {"prompt": "The history of the kiln", "max_tokens": 24, "temperature": 0, "stream": True}
    with http.stream("POST", C, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_bad_input_costs_a_greedy_stream_running_beside_it_nothing(http):
    reference, texts, stop = _greedy(http), [], threading.Event()

    def keep_streaming() -> None:
        while not stop.is_set():
            texts.append(_greedy(http))

    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(sorted(ROUTES)), data=st.data())
    def bodies(route, data):  # random bodies of any route (test_random_bodies_never_500 draws more, alone)
        body = _cheap(data.draw(ROUTES[route]))
        if isinstance(body, dict) and body.get("model") == "fake-model":
            body["model"] = MODEL
        check_response(http.post(route, content=msgspec.json.encode(body), headers=JSON))

    thread = threading.Thread(target=keep_streaming)
    thread.start()
    try:
        for path, body in NASTY:
            check_response(http.post(path, json=body), in_hypothesis=False)
        assert_error(http.post(C, content=DEEP, headers={"Content-Type": "application/json"}), 400)
        bodies()
        deadline = time.monotonic() + 60
        while len(texts) < 2 and time.monotonic() < deadline:  # streams that overlapped the bad input
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(60)
    assert len(texts) >= 2 and all(t == reference for t in texts), (reference, texts)


def test_prompt_logprobs_on_chat_and_completions_are_transformers(http, smollm2_hf):
    import torch

    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 2,
        "prompt_logprobs": 2,
    }
    r = http.post("/v1/chat/completions", json=body).json()
    ids = http.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    with torch.no_grad():
        expected = smollm2_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    entries = r["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        own = next(iter(entries[pos].items()))
        assert own[0] == str(ids[pos]) and own[1]["decoded_token"]
        assert own[1]["logprob"] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-3)
        best = expected[pos - 1].topk(2)
        ranked = {int(t): e for t, e in entries[pos].items() if e["rank"] is not None}
        assert sorted(ranked) == sorted(best.indices.tolist())
        assert ranked[best.indices[0].item()]["rank"] == 1
    completion = http.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    ).json()
    # The same entries; a prompt's chunks follow the load, and sums in another order round apart.
    again = completion["choices"][0]["prompt_logprobs"]
    assert again[0] is None and len(again) == len(entries)
    for got, want in zip(again[1:], entries[1:]):
        assert {t: (e["rank"], e["decoded_token"]) for t, e in got.items()} == {
            t: (e["rank"], e["decoded_token"]) for t, e in want.items()
        }
        assert all(e["logprob"] == pytest.approx(want[t]["logprob"], abs=1e-4) for t, e in got.items())
    assert (
        "prompt_logprobs"
        not in http.post("/v1/chat/completions", json={**body, "prompt_logprobs": None}).json()
    )
    assert_error(http.post("/v1/chat/completions", json={**body, "stream": True}), 400, "prompt_logprobs")


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(http, smollm2_hf):
    import torch

    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France is Paris."}).json()[
        "tokens"
    ]
    with torch.no_grad():
        expected = smollm2_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "The capital of France is Paris." and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-3)
        top = max(lp["top_logprobs"][pos].values())
        assert top == pytest.approx(expected[pos - 1].max().item(), abs=1e-3)
    assert r.json()["usage"]["completion_tokens"] == 0
    # lm-eval's greedy check asks for one token more: the prompt's entries, then the generated one.
    one = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]
    assert len(one["logprobs"]["tokens"]) == len(ids) + 1
    scored = one["logprobs"]["token_logprobs"]
    assert scored[1 : len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    # Streamed, the first chunk carries the echo and the prompt's logprobs.
    streamed = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: "))["choices"])
    first = next(c for cs in streamed for c in cs)
    assert first["text"] == choice["text"]
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


# ---- structured outputs ----------------------------------------------------------------------------


def _pydantic_cases():
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str
        country: str

    class Person(BaseModel):
        name: str
        age: int

    class Sentiment(BaseModel):
        label: Literal["positive", "negative", "neutral"]

    class Primes(BaseModel):
        primes: list[int] = Field(max_length=3)

    class Answer(BaseModel):
        answer: int

    class Country(BaseModel):
        name: str
        continent: str

    class Book(BaseModel):
        title: str
        author: str

    class Color(BaseModel):
        name: str
        hex: str

    class Flag(BaseModel):
        is_true: bool

    class Planet(BaseModel):
        name: str
        moons: int

    return [
        ("What is the capital of France?", City),
        ("Make up a person named Tom who is 30.", Person),
        ("Classify the sentiment: I love this movie!", Sentiment),
        ("List the first three prime numbers.", Primes),
        ("What is 2 + 3?", Answer),
        ("Which continent is Japan in?", Country),
        ("Name a famous book and its author.", Book),
        ("What color is the sky? Give its hex code.", Color),
        ("Is water wet? Answer true or false.", Flag),
        ("Tell me about Mars.", Planet),
    ]


def test_openai_parse_returns_the_pydantic_object(client):
    """The SDK's structured outputs (a strict json_schema from a Pydantic model), ten at once."""
    from concurrent.futures import ThreadPoolExecutor

    def parse(case):
        question, model = case
        r = client.beta.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=model,
            temperature=0,
            max_tokens=200,
        )
        return model, r.choices[0]

    with ThreadPoolExecutor(10) as pool:
        for model, choice in pool.map(parse, _pydantic_cases()):
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model)
            assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_structured_outputs_on_both_endpoints_and_streams(http, client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(full.choices[0].message.content)["n"], int)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )
    r = client.chat.completions.create(**{**kw, "response_format": {"type": "json_object"}}, n=2, seed=1)
    assert all(isinstance(json.loads(c.message.content), dict) for c in r.choices)

    body = {"model": MODEL, "prompt": "The answer is", "max_tokens": 8, "temperature": 0.7, "n": 3}
    r = http.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["yes", "no"]}})
    assert {c["text"] for c in r.json()["choices"]} <= {"no", "yes"}, r.text
    r = http.post("/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c["text"]) for c in r.json()["choices"]), r.text


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format", "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "unknown name"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None, "exactly one"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
         "response_format", "not both"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_that_cost_nothing(http, extra, param, says):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert says in err["message"], err
    assert not any(wait_idle(http).values())


def test_tool_calls_on_a_model_without_tool_syntax(client, http):
    """SmolLM2's template renders no tools: a named or required call still comes back well formed (the
    grammar writes the syntax), and `auto`, which would need the model to know of the tools, is a 400."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    messages = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[weather], tool_choice=choice, temperature=0, max_tokens=60
        )
        (call,) = r.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        assert isinstance(arguments["city"], str) and arguments["days"] >= 1
    body = {"model": MODEL, "messages": messages, "tools": [weather], "max_tokens": 8}
    assert (
        "does not render tools"
        in assert_error(http.post("/v1/chat/completions", json=body), 400, "tools")["message"]
    )


def test_still_serving_after_everything(server, http, client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    assert wait_idle(http) == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}
    assert "ERROR" not in server.log_text() and "Traceback" not in server.log_text(), server.log_text()[
        -3000:
    ]


def test_engine_death_is_503_not_a_hang(server, http):
    """Last in the module: it kills the server's engine core."""
    os.kill(engine_core_of(server.proc.pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (
        r := httpx.get(server.url + "/health", timeout=15)
    ).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert assert_error(r, 503)["message"] == "the engine core is unavailable"
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
    assert err["type"] == "server_error"
    for path in ("/metrics", "/version", "/v1/models"):
        assert_error(http.get(path), 503)
    assert_error(http.post("/tokenize", json={"prompt": "hi"}), 503)
