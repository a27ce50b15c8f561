"""Key pairs and the allow-list: who may connect, and in which role.

`dloco keys DIR NAME...` writes one key pair per component: ``NAME.key`` (public) and
``NAME.key_secret`` (public + secret), both mode 0600.  The allow-list is a directory with one
folder per role: ``island/``, ``merger/`` and ``observer/``, each holding ``NAME.key`` files.  The
file's stem is the peer's name and its folder its role; each server socket admits the roles of
`SOCKET_ROLES` only (islands publish deltas and read snapshots; the merger reads deltas and
publishes snapshots and acks; an observer may read both buses).  bus/zap.py enforces it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import zmq
import zmq.auth

from dloco.protocol.errors import ConfigError

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
    # the merger's ROUTER: catch-up and resend requests (an observer's deltas are refused there)
    "control": frozenset({"island", "observer"}),
    # a primary merger's log stream: its standby only
    "replication": frozenset({"merger"}),
}


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
