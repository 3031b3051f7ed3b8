"""CURVE authentication and encryption for the run's ZeroMQ sockets (`transport.auth: curve`).

The driver makes every key of a run (`keypair`): one pair for the servers (learner rank 0's inbox and weight
publisher) and one per rollout-actor incarnation. A `Gate` in the servers' process admits only the client keys it
was given, each under a name, through ZeroMQ's ZAP handshake: a peer without a key, with an unknown one or with a
replaced one never completes the handshake (abandoned after HANDSHAKE_MS), so nothing it sends reaches the
application. Every message received through a gated socket carries its sender's public key (ZeroMQ's `User-Id`);
the inbox names it through the gate per message, so a key replaced after it connected speaks no more, and holds the
name against the sender the message claims to be. A weight subscriber whose key is replaced after it connected
keeps receiving weights until its connection closes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes = field(repr=False)  # never in a log line or a traceback


def keypair() -> KeyPair:
    return KeyPair(*zmq.curve_keypair())


@dataclass(frozen=True)
class ClientKeys:
    """What a client dials a gated server with: its own pair and the server's public key."""

    own: KeyPair
    server: bytes


def dial(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Makes `socket` (before it connects) a CURVE client of the server whose public key `keys.server` is."""
    socket.curve_secretkey = keys.own.secret
    socket.curve_publickey = keys.own.public
    socket.curve_serverkey = keys.server


class _Authenticator(ThreadAuthenticator):
    def __init__(self, gate: Gate, context: zmq.Context):
        super().__init__(context)
        self.gate = gate

    def curve_user_id(self, client_public_key: bytes) -> str:  # called once the handshake admitted the key
        return z85.encode(client_public_key).decode()  # every message's User-Id: the gate names it per message


HANDSHAKE_MS = 5000  # a CURVE handshake takes milliseconds; ZeroMQ's default waits 30 s


class Gate:
    """The server side: the ZAP handler on `context` (one per context) and the client keys it admits by name."""

    def __init__(self, keys: KeyPair, context: zmq.Context | None = None):
        self.keys = keys
        self._names: dict[bytes, str] = {}  # admitted public key -> name
        self._lock = threading.Lock()  # admit() runs on the caller's thread, callback() on the ZAP thread
        self._auth = _Authenticator(self, context or zmq.Context.instance())
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def serve(self, socket: zmq.Socket) -> None:
        """Makes `socket` (before it binds) a CURVE server behind this gate, which drops a connection whose
        handshake has not completed within HANDSHAKE_MS (an unauthenticated peer holds a descriptor no longer)."""
        socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        socket.curve_secretkey = self.keys.secret
        socket.curve_publickey = self.keys.public
        socket.curve_server = True

    def admit(self, name: str, public: bytes) -> None:
        """From now on `public` may connect as `name`; a key admitted earlier under `name` no longer may (a
        replaced actor's). A connection it already made stays open, but a gated inbox names each message's sender
        anew, so what it sends from then on is dropped as `revoked`."""
        with self._lock:
            self._names = {k: n for k, n in self._names.items() if n != name} | {public: name}

    def revoke(self, public: bytes) -> None:
        """Key `public` may no longer connect, and what its open connection sends is dropped as `revoked` (a key
        admitted since under the same name is untouched)."""
        with self._lock:
            self._names.pop(public, None)

    def name_of(self, public: bytes) -> str | None:
        with self._lock:
            return self._names.get(public)

    def callback(self, domain: str, key: bytes) -> bool:  # zmq.auth's credentials-provider hook
        return self.name_of(key) is not None

    def close(self) -> None:
        self._auth.stop()
