"""Sockets between hosts (engine/cluster.py): only holders of the cluster key are read from or sent to,
listening beyond loopback needs a key, strangers and junk cost nothing, and a peer that vanishes (killed,
or stopped as a vanished host would be) fails its requests within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine import cluster
from engine import messages as m
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm import LLM, SamplingParams
from server import cli
from tests.conftest import children_of
from tests.test_data_parallel import listening_port
from tests.test_server_lifecycle import ROOT

PROMPTS = ["The kiln was hot", "A potter shapes clay", "Fire the glaze"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory=50_000_000)


def key_file(tmp_path: Path, secret: str | None = None) -> str:
    path = tmp_path / f"cluster-{len(list(tmp_path.glob('cluster-*')))}.key"
    path.write_text((secret or cluster.new_secret()) + "\n")
    path.chmod(0o600)
    return str(path)


def strangers(port: int) -> list[zmq.Socket]:
    """Every way in without the key, at a listener on `port` (inputs) and `port + 1` (outputs): raw
    connections that close, junk bytes, zmq peers with no key and with another cluster's key sending a
    forged StartCore and pulling outputs. Returns the pulling sockets, which must never get a frame."""
    deadline = time.monotonic() + 60
    while True:  # the listener may still be starting
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    for p in (port, port + 1):
        socket.create_connection(("127.0.0.1", p)).close()
        with socket.create_connection(("127.0.0.1", p)) as s:
            s.sendall(os.urandom(512))
    ctx, pulls = zmq.Context.instance(), []
    forged = msgspec.msgpack.encode(m.StartCore(EngineConfig(), "/nonexistent"))
    for key in (None, cluster.ClusterKey(cluster.new_secret())):
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.setsockopt(zmq.LINGER, 0)
        cluster.connect(push, f"tcp://127.0.0.1:{port}", key)
        cluster.connect(pull, f"tcp://127.0.0.1:{port + 1}", key)
        # Queued for a connection that never completes, or refused at once where the failed handshake
        # already dropped it (a PUSH with no peer would wait for one forever).
        with contextlib.suppress(zmq.Again):
            push.send(forged, flags=zmq.NOBLOCK)
        pulls.append(pull)
    return pulls


def test_only_the_key_holders_are_read_from_or_sent_to():
    key = cluster.ClusterKey(cluster.new_secret())
    ctx = zmq.Context()
    auth = cluster.authenticator(ctx, key)
    try:
        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        port = listening_port()
        cluster.listen(inbox, f"tcp://127.0.0.1:{port}", key)
        cluster.listen(outbox, f"tcp://127.0.0.1:{port + 1}", key)
        pulls = strangers(port)
        member, member_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        cluster.connect(member, f"tcp://127.0.0.1:{port}", key)
        cluster.connect(member_pull, f"tcp://127.0.0.1:{port + 1}", key)
        member.send(b"from the cluster")
        assert inbox.poll(5000) and inbox.recv() == b"from the cluster"
        assert not inbox.poll(300)  # nothing from anyone else
        for i in range(4):  # PUSH deals round-robin among its peers: the strangers are not among them
            outbox.send(str(i).encode())
        assert [member_pull.recv() for _ in range(4)] == [b"0", b"1", b"2", b"3"]
        assert not any(pull.poll(300) for pull in pulls)
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_listening_beyond_loopback_needs_a_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(cluster.KEY_ENV, raising=False)
    sock = zmq.Context.instance().socket(zmq.PULL)
    with pytest.raises(ValueError, match="needs a cluster key: make one with `kiln cluster-key"):
        cluster.listen(sock, "tcp://0.0.0.0:7000", None)
    sock.close()
    assert cluster.is_loopback("tcp://localhost:1") and cluster.is_loopback("tcp://[::1]:1")
    assert not cluster.is_loopback("tcp://0.0.0.0:1") and not cluster.is_loopback("tcp://10.1.2.3:1")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--headless", "--host", "0.0.0.0", "--port", str(listening_port())])
    assert exit_.value.code == 2 and "needs a cluster key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="under 16 characters"):
        cluster.load_key(key_file(tmp_path, "short"))
    monkeypatch.setenv(cluster.KEY_ENV, "x" * 20)
    assert cluster.load_key(None).server_public == cluster.ClusterKey("x" * 20).server_public


def headless_core(host: subprocess.Popen) -> int:
    """The pid of the engine core a headless host runs (its child)."""
    (core,) = children_of(host.pid, "engine.core")
    return core


def fails_within(llm: LLM, seconds: float, address: str) -> None:
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=address):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < seconds


def test_a_headless_core_serves_only_its_cluster_and_its_vanishing_fails_requests_within_seconds(
    tiny_chat_model, tmp_path
):
    """Strangers at a headless core's ports read and steer nothing, nor does another key holder; a front
    end with the key gets the one-process output; a core stopped (as a vanished host would be) or killed
    fails requests within 10 s; a stopped core, resumed, gives way to the next front end's fresh core."""
    with LLM(tiny_chat_model, **ENGINE) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    port, key = listening_port(), key_file(tmp_path)
    address = f"tcp://127.0.0.1:{port}"
    with open(tmp_path / "host.log", "wb") as log:
        host = subprocess.Popen(
            [sys.executable, "-m", "server", "--headless", "--port", str(port), "--cluster-key-file", key],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    remote = dict(ENGINE, engine_core_addresses=address, cluster_key_file=key)
    pulls, junk = [], zmq.Context.instance().socket(zmq.PUSH)
    try:
        pulls += strangers(port)
        with pytest.raises(EngineDeadError, match="refused this front end's key"):
            LLM(tiny_chat_model, **dict(remote, cluster_key_file=key_file(tmp_path, "y" * 20)))
        cluster.connect(junk, address, cluster.load_key(key))
        junk.send(msgspec.msgpack.encode(m.AbortRequests(["x"])))  # before any StartCore: dropped
        deadline = time.monotonic() + 30
        while b"dropped AbortRequests: StartCore comes first" not in (tmp_path / "host.log").read_bytes():
            assert time.monotonic() < deadline, "the core did not drop a frame sent before StartCore"
            time.sleep(0.1)
        llm = LLM(tiny_chat_model, **remote)
        junk.send(b"\xc1 not msgpack")  # a member's malformed frame is dropped
        pulls += strangers(port)
        other = zmq.Context.instance().socket(zmq.DEALER)  # a member, but not the core's front end
        other.setsockopt(zmq.ROUTING_ID, b"kiln-another-front-end")
        cluster.connect(other, f"tcp://127.0.0.1:{port + 1}", cluster.load_key(key))
        pulls.append(other)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert not any(pull.poll(0) for pull in pulls)
        core = headless_core(host)
        os.kill(core, signal.SIGSTOP)
        fails_within(llm, 10, address)
        llm.shutdown()
        os.kill(core, signal.SIGCONT)  # silent front end: it stops, and the host starts a fresh core

        llm = LLM(tiny_chat_model, **remote)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert not Path(f"/proc/{core}").exists()
        os.kill(headless_core(host), signal.SIGKILL)
        fails_within(llm, 10, address)
        llm.shutdown()
        assert host.poll() is None
    finally:
        host.terminate()
        host.wait(30)
        for sock in [*pulls, junk]:
            sock.close(linger=0)
    assert b"refused" in (tmp_path / "host.log").read_bytes()
