"""CURVE encryption and authentication for every socket.

`dloco keys DIR NAME...` writes one key pair per component: ``NAME.key`` (public) and
``NAME.key_secret`` (public + secret), both mode 0600.  A server (the broker, the merger's ROUTER)
accepts only clients whose public key file is in its allowlist directory; the check is ZeroMQ's
ZAP handler running in a thread.  Refusals are counted and logged.  Plaintext needs the explicit
``--insecure`` flag, which warns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.errors import ConfigError


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
    server_public: bytes | None = None  # clients: the server they talk to
    allow_dir: Path | None = None  # servers: public keys of accepted clients

    @classmethod
    def load(cls, keys_dir: str | Path, name: str, server: str | None = None, allow_dir: str | Path | None = None) -> Identity:
        keys_dir = Path(keys_dir)
        secret_file = keys_dir / f"{name}.key_secret"
        if not secret_file.exists():
            raise ConfigError(f"no key pair {secret_file}; create it with `dloco keys {keys_dir} {name}`")
        public, secret = zmq.auth.load_certificate(secret_file)
        server_public = None
        if server is not None:
            server_file = keys_dir / f"{server}.key"
            if not server_file.exists():
                raise ConfigError(f"no public key {server_file} for server {server!r}")
            server_public, _ = zmq.auth.load_certificate(server_file)
        return cls(public, secret, server_public, Path(allow_dir) if allow_dir is not None else None)


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
    """Counts and reports ZAP denials (pyzmq logs them on the 'zmq.auth' logger)."""

    def __init__(self, report) -> None:
        super().__init__(level=logging.DEBUG)
        self.count, self.report = 0, report

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "DENIED" in message:
            self.count += 1
            self.report(message)


def start_authenticator(context: zmq.Context, allow_dir: Path, report) -> tuple[ThreadAuthenticator, _Refusals]:
    """ZAP for every CURVE server socket of `context`: only keys found in `allow_dir` get in."""
    if not allow_dir.is_dir():
        raise ConfigError(f"allowlist directory {allow_dir} does not exist")
    logger = logging.getLogger("zmq.auth")
    logger.setLevel(logging.DEBUG)
    refusals = _Refusals(report)
    logger.addHandler(refusals)
    authenticator = ThreadAuthenticator(context, log=logger)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(allow_dir))
    return authenticator, refusals


# The ZAP handler of each context that has CURVE server sockets (one per context), by id(context).
_authenticators: dict[int, tuple[ThreadAuthenticator, _Refusals]] = {}


@dataclasses.dataclass(frozen=True)
class Security:
    """How one process secures its sockets: CURVE with its own key pair, or plaintext (insecure).

    A bound socket (endpoint starting with '@') is a CURVE server and admits only keys in `allow`;
    a connecting socket is a client of the named server, whose public key is `keys/<server>.key`.
    """

    keys: Path | None  # None: plaintext
    name: str
    allow: Path | None = None

    @property
    def insecure(self) -> bool:
        return self.keys is None

    def secure(self, context: zmq.Context, socket: zmq.Socket, endpoint: str, server: str | None, report=lambda message: None) -> None:
        if self.keys is None:
            return
        if endpoint.startswith("@"):
            if self.allow is None:
                raise ConfigError(f"{self.name} binds {endpoint[1:]} with CURVE on: give --allow DIR (accepted client keys)")
            if id(context) not in _authenticators:
                _authenticators[id(context)] = start_authenticator(context, self.allow, report)
            make_server(socket, Identity.load(self.keys, self.name))
        else:
            make_client(socket, Identity.load(self.keys, self.name, server=server))

    @staticmethod
    def refused(context: zmq.Context) -> int:
        """How many clients the ZAP handler of `context` has refused (0 without one)."""
        started = _authenticators.get(id(context))
        return 0 if started is None else started[1].count

    @staticmethod
    def stop(context: zmq.Context) -> None:
        started = _authenticators.pop(id(context), None)
        if started is not None:
            started[0].stop()


def security_from_args(args, name: str, component: str) -> Security:
    """--keys/--allow/--insecure, checked the same way for every component."""
    if args.insecure:
        if args.keys or getattr(args, "allow", None):
            raise ConfigError("--insecure contradicts --keys/--allow")
        import sys

        print(f"dloco {component}: WARNING: --insecure: traffic is plaintext and unauthenticated", file=sys.stderr)
        return Security(None, name)
    if not args.keys:
        raise ConfigError(f"CURVE is on by default: give --keys DIR (holding {name}.key_secret), or --insecure")
    return Security(Path(args.keys), name, Path(args.allow) if getattr(args, "allow", None) else None)
