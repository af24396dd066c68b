"""Sockets between hosts: private to the cluster, and watched for peers that vanish.

Every process of a cluster (the front end, headless engine cores, workers that torchrun starts) reads one
shared secret (`--cluster-key-file FILE`, else `$KILN_CLUSTER_KEY`) and derives the same two CURVE key
pairs from it: the listening side's and the connecting side's. zmq's CURVE encrypts each connection and
needs the listener's public key to start one; that key never crosses the wire, so a peer without the
secret cannot complete a handshake, and the listener's ZAP handler also refuses any connecting key but the
cluster's. Nothing from a refused peer is ever read. Without a key a socket may listen on loopback only.

Each connection heartbeats in libzmq's I/O thread (not Python's, so a long step misses none): a peer that
stops answering for HEARTBEAT_TIMEOUT_MS (its host gone, its process stopped) is disconnected, which the
sockets' owners watch for.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import stat
import threading
import time

import zmq
import zmq.auth.thread
import zmq.utils.z85

KEY_ENV = "KILN_CLUSTER_KEY"
MIN_SECRET_CHARS = 16
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
HANDSHAKE_FAILED = (  # monitor events: a peer without the key, or not speaking zmq at all
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HOW_TO_MAKE_ONE = (
    "make one with `kiln cluster-key > FILE` (mode 0600), copy it to every host, and pass "
    f"--cluster-key-file FILE to each kiln process (or set {KEY_ENV} to its contents)"
)

logger = logging.getLogger("kiln")


def new_secret() -> str:
    """A fresh cluster secret: 32 random bytes, URL-safe base64."""
    return secrets.token_urlsafe(32)


class ClusterKey:
    """The two CURVE key pairs (z85) a cluster secret stands for."""

    def __init__(self, secret: str) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster key is under {MIN_SECRET_CHARS} characters: {HOW_TO_MAKE_ONE}")
        self.server_public, self.server_secret = _key_pair(secret, b"kiln-listener")
        self.client_public, self.client_secret = _key_pair(secret, b"kiln-connector")

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: only the cluster's connecting key is let in."""
        if client_key == self.client_public:
            return True
        logger.warning("refused a connection with a key that is not this cluster's")
        return False


def _key_pair(secret: str, label: bytes) -> tuple[bytes, bytes]:
    raw = hashlib.blake2b(secret.encode(), key=label, digest_size=32).digest()
    private = zmq.utils.z85.encode(raw)
    return zmq.curve_public(private), private


def load_key(path: str | None) -> ClusterKey | None:
    """The cluster's key from `path`, else from $KILN_CLUSTER_KEY; None when neither gives one."""
    if path:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("the cluster key file %s is open to other users: chmod 600 it", path)
        with open(path) as f:
            return ClusterKey(f.read().strip())
    secret = os.environ.get(KEY_ENV, "").strip()
    return ClusterKey(secret) if secret else None


def is_loopback(address: str) -> bool:
    """Whether tcp://HOST:PORT names this machine only."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: what it resolves to
        try:
            return all(ipaddress.ip_address(ai[4][0]).is_loopback for ai in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_listen(address: str, key: ClusterKey | None) -> None:
    """ValueError unless a socket may listen at `address`: beyond loopback only with a key."""
    if key is None and not is_loopback(address):
        raise ValueError(
            f"listening at {address}, beyond this machine, needs a cluster key: {HOW_TO_MAKE_ONE}"
        )


def listen(sock: zmq.Socket, address: str, key: ClusterKey | None) -> None:
    """Bind `sock` at `address` for the cluster's peers only (its context needs `authenticator`'s
    handler too)."""
    check_listen(address, key)
    _heartbeat(sock)
    if key is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = key.server_public, key.server_secret
    sock.bind(address)


def authenticator(ctx: zmq.Context, key: ClusterKey | None) -> zmq.auth.thread.ThreadAuthenticator | None:
    """The ZAP handler for `ctx`'s listening sockets (a thread that checks each connecting key); the
    caller stops it before destroying the context."""
    if key is None:
        return None
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("kiln.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=key)
    return auth


def connect(sock: zmq.Socket, address: str, key: ClusterKey | None) -> None:
    """Connect `sock` to a cluster peer listening at `address` (with `key`, as only its listener accepts)."""
    _heartbeat(sock)
    if key is not None:
        sock.curve_serverkey = key.server_public
        sock.curve_publickey, sock.curve_secretkey = key.client_public, key.client_secret
    sock.connect(address)


class RefusedConnections:
    """Watches a listening socket for connections it refused (a stranger, junk bytes) and logs them, at
    most a line a minute: a stream of strangers cannot flood the log."""

    def __init__(self, sock: zmq.Socket, address: str) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.address, self.last = address, float("-inf")

    def log(self) -> None:
        refused = 0
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
            refused += 1
        if refused and time.monotonic() - self.last > 60:
            self.last = time.monotonic()
            why = "no cluster key, or not kiln's protocol"
            logger.warning("refused %d connection(s) at %s: %s", refused, self.address, why)


def _heartbeat(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class Heartbeats:
    """A thread that sends `frame` to each of `addresses` every HEARTBEAT_IVL_MS, on sockets of its own (a
    zmq socket belongs to one thread), until `stop`: a busy or idle caller still shows it is alive."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], key: ClusterKey | None, frame: bytes) -> None:
        self.sockets = []
        for address in addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 16)  # a core still warming up need not hear each one
            connect(sock, address, key)
            self.sockets.append(sock)
        self.frame, self.stopped = frame, threading.Event()
        self.thread = threading.Thread(target=self._run, name="kiln-heartbeats", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_IVL_MS / 1000):
            for sock in self.sockets:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(self.frame, flags=zmq.NOBLOCK)
        for sock in self.sockets:
            sock.close(linger=0)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
