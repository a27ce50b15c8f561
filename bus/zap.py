"""ZeroMQ's ZAP handler for CURVE server sockets, in a thread: a client gets in if its key is on
the allow-list with a role the socket admits (bus/keys.py), and the peer's name goes with every
message it sends as the ``User-Id`` property.  Refusals, by ZAP or in the handshake before it, are
counted and reported at a bounded rate.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dloco.bus.keys import SOCKET_ROLES, Peer, load_allow_list
from dloco.bus.monitor import SocketMonitor


class Refusals(logging.Handler):
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

    def __init__(self, refusals: Refusals) -> None:
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


class RoleAuthenticator(ThreadAuthenticator):
    """ZAP for CURVE: a client gets in if its key is on the allow-list with a role the socket's
    domain admits (SOCKET_ROLES; a socket without a domain admits every listed role); its User-Id is
    its name.
    """

    def configure_roles(self, peers: dict[bytes, Peer]) -> None:
        self.peers = peers
        # what pyzmq's own checks look at
        self.certs["*"] = {key: True for key in peers}
        # name -> until when (time.monotonic) its key is refused
        self.banned: dict[str, float] = {}

    def ban(self, name: str, seconds: float) -> None:
        """Refuse `name`'s key for `seconds` (its connections already open stay open)."""
        self.banned[name] = time.monotonic() + seconds

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
        left = self.banned.get(peer.name, 0.0) - time.monotonic()
        if left > 0:
            self.log.debug(
                "DENIED (banned) domain=%s name=%s: for %.0f s more", domain, peer.name, left
            )
            return False, b"Banned"
        return True, b"OK"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.peers[z85.encode(client_public_key)].name


def start_authenticator(
    context: zmq.Context, allow_dir: Path, report
) -> tuple[ThreadAuthenticator, Refusals, HandshakeWatcher]:
    """ZAP for every CURVE server socket of `context`: keys of `allow_dir`'s role folders, by
    role."""
    peers = load_allow_list(allow_dir)
    logger = logging.getLogger("zmq.auth")
    logger.setLevel(logging.DEBUG)
    refusals = Refusals(report)
    logger.addHandler(refusals)
    authenticator = RoleAuthenticator(context, log=logger)
    authenticator.start()
    authenticator.configure_roles(peers)
    return authenticator, refusals, HandshakeWatcher(refusals)
