"""CURVE encryption, authentication and roles for every socket.

`dloco keys DIR NAME...` writes one key pair per component: ``NAME.key`` (public) and
``NAME.key_secret`` (public + secret), both mode 0600.  A server (the broker, the merger's ROUTER)
admits a client only if its public key is on the allow-list, a directory with one folder per role:
``island/``, ``merger/`` and ``observer/``, each holding ``NAME.key`` files.  The file's stem is the
peer's name and its folder its role; each server socket admits the roles of `SOCKET_ROLES` only
(islands publish deltas and read snapshots; the merger reads deltas and publishes snapshots and
acks; an observer may read both buses).  ZeroMQ's ZAP handler, in a thread, checks this and hands
the peer's name to every message it sends as the ``User-Id`` property, so a receiver knows who sent
a message whatever its header says.  Refusals are counted and logged.  Plaintext needs the explicit
``--insecure`` flag, which warns.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dloco.bus.monitor import SocketMonitor
from dloco.protocol.errors import ConfigError


def create_keys(directory: str | Path, names: list[str]) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    written = []
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"key name must be a plain file name, got {name!r}")
        public, secret = zmq.auth.create_certificates(directory, name)
        for path in (public, secret):
            os.chmod(path, 0o600)
        written += [Path(public), Path(secret)]
    return written


@dataclasses.dataclass(frozen=True)
class Identity:
    """This process's key pair, and (servers) where the allowed client keys are."""

    public: bytes
    secret: bytes
    # clients: the server they talk to
    server_public: bytes | None = None
    # servers: public keys of accepted clients
    allow_dir: Path | None = None

    @classmethod
    def load(
        cls,
        keys_dir: str | Path,
        name: str,
        server: str | None = None,
        allow_dir: str | Path | None = None,
    ) -> Identity:
        keys_dir = Path(keys_dir)
        secret_file = keys_dir / f"{name}.key_secret"
        if not secret_file.exists():
            raise ConfigError(
                f"no key pair {secret_file}; create it with `dloco keys {keys_dir} {name}`"
            )
        public, secret = zmq.auth.load_certificate(secret_file)
        server_public = None
        if server is not None:
            server_file = keys_dir / f"{server}.key"
            if not server_file.exists():
                raise ConfigError(f"no public key {server_file} for server {server!r}")
            server_public, _ = zmq.auth.load_certificate(server_file)
        return cls(
            public, secret, server_public, Path(allow_dir) if allow_dir is not None else None
        )


def make_server(socket: zmq.Socket, identity: Identity) -> None:
    socket.curve_secretkey = identity.secret
    socket.curve_publickey = identity.public
    socket.curve_server = True


def make_client(socket: zmq.Socket, identity: Identity) -> None:
    if identity.server_public is None:
        raise ConfigError("a CURVE client needs the server's public key")
    socket.curve_secretkey = identity.secret
    socket.curve_publickey = identity.public
    socket.curve_serverkey = identity.server_public


class _Refusals(logging.Handler):
    """Counts refused connections: ZAP denials (pyzmq logs them on the 'zmq.auth' logger) and
    handshakes that fail before authentication (`HandshakeWatcher`).  Each is counted; reports go
    out at most once per REPORT_EVERY_S, saying how many were not reported since, so a flood of
    attempts cannot flood the log."""

    REPORT_EVERY_S = 1.0

    def __init__(self, report) -> None:
        super().__init__(level=logging.DEBUG)
        self.count, self.report = 0, report
        # not `lock`: logging.Handler holds its own while emitting
        self.counting = threading.Lock()
        self.last_report, self.unreported = -math.inf, 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "DENIED" in message:
            self.refuse(message)

    def refuse(self, message: str) -> None:
        with self.counting:
            self.count += 1
            now = time.monotonic()
            if now - self.last_report < self.REPORT_EVERY_S:
                self.unreported += 1
                return
            message += (
                f" ({self.unreported} more refused since the last report)"
                if self.unreported
                else ""
            )
            self.last_report, self.unreported = now, 0
        self.report(message)


class HandshakeWatcher(SocketMonitor):
    """Connections refused before authentication reaches ZAP (a plaintext client on a CURVE socket,
    another protocol): ZeroMQ's socket monitors, read on a thread, counted as refusals."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, refusals: _Refusals) -> None:
        self.refusals = refusals
        super().__init__(self.EVENTS, "handshake-watcher")

    def on_event(self, label: str, event: dict) -> None:
        self.refusals.refuse(f"DENIED (handshake) {self.describe(event)}")

    @staticmethod
    def describe(event: dict) -> str:
        """endpoint, event and why: a protocol error's name (a plaintext peer:
        ZMTP_MECHANISM_MISMATCH) or an errno."""
        try:
            kind, value = int(event["event"]), int(event["value"])
            why = (
                zmq.Event(value).name
                if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                else f"errno {value} ({os.strerror(value)})"
            )
            return (
                f"endpoint={bytes(event['endpoint']).decode('ascii', 'replace')}:"
                f" {zmq.Event(kind).name} {why}"
            )
        # a value this pyzmq has no name for: still a refusal
        except (KeyError, TypeError, ValueError):
            return f"{event!r}"[:200]


ROLES = ("island", "merger", "observer")
# The roles each server socket admits, by the socket's ZAP domain.
SOCKET_ROLES = {
    # the broker's delta bus, publishers' side
    "delta-in": frozenset({"island"}),
    # ... subscribers' side: no island reads another's deltas
    "delta-out": frozenset({"merger", "observer"}),
    # the snapshot bus (snapshots, acks), publishers' side
    "snapshot-in": frozenset({"merger"}),
    "snapshot-out": frozenset({"island", "observer"}),
    "control": frozenset({"island", "observer"}),
    # a primary merger's log stream: its standby only  # the merger's ROUTER: catch-up and resend
    # requests (an observer's deltas are refused there)
    "replication": frozenset({"merger"}),
}


def write_allow_list(keys_dir: Path, allow_dir: Path, roles: dict[str, list[str]]) -> None:
    """Copy the public keys of `roles` (role -> names) from `keys_dir` into `allow_dir`/ROLE/."""
    for role, names in roles.items():
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        (allow_dir / role).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(keys_dir / f"{name}.key", allow_dir / role / f"{name}.key")


@dataclasses.dataclass(frozen=True)
class Peer:
    role: str
    name: str


def load_allow_list(allow_dir: Path) -> dict[bytes, Peer]:
    """z85 public key -> Peer, from `allow_dir`/ROLE/NAME.key.  A key listed twice, a name used
    twice, a key file directly in `allow_dir` (no role) or an unknown folder is a ConfigError."""
    if not allow_dir.is_dir():
        raise ConfigError(f"allow-list directory {allow_dir} does not exist")
    loose = sorted(p.name for p in allow_dir.glob("*.key"))
    if loose:
        raise ConfigError(
            f"{allow_dir} holds keys without a role ({', '.join(loose[:3])}): put each in a role"
            f" folder, {'/, '.join(ROLES)}/ (`dloco prepare` writes them so)"
        )
    unknown = sorted(p.name for p in allow_dir.iterdir() if p.is_dir() and p.name not in ROLES)
    if unknown:
        raise ConfigError(
            f"{allow_dir} has folders that are not roles: {unknown} (roles: {', '.join(ROLES)})"
        )
    peers: dict[bytes, Peer] = {}
    names: dict[str, str] = {}
    for role in ROLES:
        for path in sorted((allow_dir / role).glob("*.key")) if (allow_dir / role).is_dir() else []:
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as error:
                raise ConfigError(f"{path} is not a public key file: {error}") from None
            if public in peers:
                raise ConfigError(
                    f"{path}: the same key is also listed as"
                    f" {peers[public].role}/{peers[public].name}"
                )
            if path.stem in names:
                raise ConfigError(
                    f"{path}: the name {path.stem!r} is also listed under {names[path.stem]}/"
                )
            peers[public], names[path.stem] = Peer(role, path.stem), role
    return peers


class RoleAuthenticator(ThreadAuthenticator):
    """ZAP for CURVE: a client gets in if its key is on the allow-list with a role the socket's
    domain admits (SOCKET_ROLES; a socket without a domain admits every listed role); its User-Id is
    its name.
    """

    def configure_roles(self, peers: dict[bytes, Peer]) -> None:
        self.peers = peers
        # what pyzmq's own checks look at
        self.certs["*"] = {key: True for key in peers}

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        peer = self.peers.get(z85.encode(client_key))
        if peer is None:
            self.log.debug(
                "DENIED (CURVE) domain=%s client_key=%s: not on the allow-list",
                domain,
                z85.encode(client_key),
            )
            return False, b"Unknown key"
        if domain and peer.role not in SOCKET_ROLES.get(domain, frozenset()):
            self.log.debug(
                "DENIED (role) domain=%s name=%s role=%s: this socket admits %s",
                domain,
                peer.name,
                peer.role,
                sorted(SOCKET_ROLES.get(domain, ())),
            )
            return False, b"Role not admitted"
        return True, b"OK"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.peers[z85.encode(client_public_key)].name


def start_authenticator(
    context: zmq.Context, allow_dir: Path, report
) -> tuple[ThreadAuthenticator, _Refusals, HandshakeWatcher]:
    """ZAP for every CURVE server socket of `context`: keys of `allow_dir`'s role folders, by
    role."""
    peers = load_allow_list(allow_dir)
    logger = logging.getLogger("zmq.auth")
    logger.setLevel(logging.DEBUG)
    refusals = _Refusals(report)
    logger.addHandler(refusals)
    authenticator = RoleAuthenticator(context, log=logger)
    authenticator.start()
    authenticator.configure_roles(peers)
    return authenticator, refusals, HandshakeWatcher(refusals)


# The ZAP handler of each context that has CURVE server sockets (one per context), by id(context).
_authenticators: dict[int, tuple[ThreadAuthenticator, _Refusals, HandshakeWatcher]] = {}


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
