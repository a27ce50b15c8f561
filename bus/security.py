"""CURVE encryption, authentication and roles for every socket: `Security`, one process's way of
securing its sockets, and the checks on who sent a message.

A server (the broker, the merger's ROUTER) admits a client only if its public key is on the
allow-list with a role its socket admits (bus/keys.py: key pairs, the allow-list, `SOCKET_ROLES`).
ZeroMQ's ZAP handler, in a thread (bus/zap.py), checks this and hands the peer's name to every
message it sends as the ``User-Id`` property, so a receiver knows who sent a message whatever its
header says.  Refusals are counted and logged.  Plaintext needs the explicit ``--insecure`` flag,
which warns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from dloco.bus.keys import SOCKET_ROLES, Identity, load_allow_list, make_client, make_server
from dloco.bus.zap import HandshakeWatcher, Refusals, start_authenticator
from dloco.protocol.errors import ConfigError

# The ZAP handler of each context that has CURVE server sockets (one per context), by id(context).
_authenticators: dict[int, tuple[ThreadAuthenticator, Refusals, HandshakeWatcher]] = {}


@dataclasses.dataclass(frozen=True)
class Security:
    """How one process secures its sockets: CURVE with its own key pair, or plaintext (insecure).

    A bound socket (endpoint starting with '@') is a CURVE server and admits only keys in `allow`;
    a connecting socket is a client of the named server, whose public key is `keys/<server>.key`.
    """

    # None: plaintext
    keys: Path | None
    name: str
    allow: Path | None = None

    @property
    def insecure(self) -> bool:
        return self.keys is None

    def secure(
        self,
        context: zmq.Context,
        socket: zmq.Socket,
        endpoint: str,
        server: str | None,
        report=lambda message: None,
        domain: str | None = None,
    ) -> None:
        """Make `socket` a CURVE server (bound: admitting the roles of SOCKET_ROLES[domain]) or a
        client of `server`; nothing when insecure."""
        if self.keys is None:
            return
        if endpoint.startswith("@"):
            if self.allow is None:
                raise ConfigError(
                    f"{self.name} binds {endpoint[1:]} with CURVE on: give --allow DIR (accepted"
                    " client keys)"
                )
            if domain is not None and domain not in SOCKET_ROLES:
                raise ConfigError(
                    f"unknown socket domain {domain!r}: one of {sorted(SOCKET_ROLES)}"
                )
            if id(context) not in _authenticators:
                _authenticators[id(context)] = start_authenticator(context, self.allow, report)
            if domain is not None:
                socket.zap_domain = domain.encode()
            make_server(socket, Identity.load(self.keys, self.name))
            _authenticators[id(context)][2].watch(socket)
        else:
            make_client(socket, Identity.load(self.keys, self.name, server=server))

    def names_with_role(self, role: str) -> frozenset[str]:
        """The names the allow-list gives `role` (empty when insecure or without one)."""
        if self.keys is None or self.allow is None:
            return frozenset()
        return frozenset(
            peer.name for peer in load_allow_list(self.allow).values() if peer.role == role
        )

    @staticmethod
    def refused(context: zmq.Context) -> int:
        """How many connections the CURVE servers of `context` refused: by ZAP (key, role) or in the
        handshake."""
        started = _authenticators.get(id(context))
        return 0 if started is None else started[1].count

    @staticmethod
    def ban(context: zmq.Context, name: str, seconds: float) -> bool:
        """Have the CURVE servers of `context` refuse `name`'s key for `seconds`; False without
        them (plaintext)."""
        started = _authenticators.get(id(context))
        if started is not None:
            started[0].ban(name, seconds)
        return started is not None

    @staticmethod
    def stop(context: zmq.Context) -> None:
        started = _authenticators.pop(id(context), None)
        if started is not None:
            started[2].stop()
            started[0].stop()


def peer_of(frame: zmq.Frame) -> str | None:
    """The name of the CURVE peer that sent `frame` (ZAP's User-Id), on a socket that authenticated
    it (a CURVE server); None elsewhere (plaintext, or a message from the server we dialled)."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


def impostor(sender: str, peer: str | None, routing_id: bytes | None = None) -> str | None:
    """What a message claims beyond its key, or None when it speaks for itself.  With CURVE, a
    message's sender (and a DEALER's routing id) must be the name of the key that sent it
    (`peer`): otherwise one island could lock another out with a higher epoch, or replay another's
    deltas as its own.  `peer` None: not known here (plaintext, or the broker checked)."""
    if peer is None or (sender == peer and routing_id in (None, peer.encode())):
        return None
    return f"sender {sender!r}" + (
        f", routing id {routing_id.decode('ascii', 'replace')!r}" if routing_id is not None else ""
    )


def security_from_args(args, name: str, component: str) -> Security:
    """--keys/--allow/--insecure, checked the same way for every component."""
    if args.insecure:
        if args.keys or getattr(args, "allow", None):
            raise ConfigError("--insecure contradicts --keys/--allow")
        import sys

        print(
            f"dloco {component}: WARNING: --insecure: traffic is plaintext and unauthenticated",
            file=sys.stderr,
        )
        return Security(None, name)
    if not args.keys:
        raise ConfigError(
            f"CURVE is on by default: give --keys DIR (holding {name}.key_secret), or --insecure"
        )
    return Security(
        Path(args.keys), name, Path(args.allow) if getattr(args, "allow", None) else None
    )
