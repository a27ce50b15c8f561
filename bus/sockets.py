"""Socket setup, written once for every process.

Endpoint strings: ``@tcp://...`` binds, ``tcp://...`` or ``>tcp://...`` connects.  Every socket gets
linger 0 (closing never waits for unsent messages), ZMTP heartbeats (a peer silent for
HEARTBEAT_TIMEOUT_MS is disconnected and ZeroMQ reconnects), a connect timeout, and CURVE as
`Security` says: a bound socket is a CURVE server, a connecting one a client of the named server.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from dloco.bus.security import Security

# a ZMTP ping on every connection this often
HEARTBEAT_IVL_MS = 1000
# no traffic from the peer this long after a ping: the connection is dropped
HEARTBEAT_TIMEOUT_MS = 5000
# the peer drops the connection when it hears nothing from us this long
HEARTBEAT_TTL_MS = 5000
# A connection attempt unanswered this long is abandoned and tried again (ZeroMQ's reconnect
# interval later).  Without it an attempt made during a partition waits out the kernel's SYN
# retries (about two minutes on Linux) after the link is back: measured in
# tests/test_network_faults.py.
CONNECT_TIMEOUT_MS = HEARTBEAT_TIMEOUT_MS


def attach(socket: zmq.Socket, endpoint: str) -> None:
    """Bind (``@...``) or connect (``tcp://...``, ``>tcp://...``); ``A,B`` connects to both."""
    if endpoint.startswith("@"):
        socket.bind(endpoint[1:])
    else:
        for part in endpoint.split(","):
            socket.connect(part.strip().removeprefix(">"))


def open_socket(
    context: zmq.Context,
    kind: int,
    endpoint: str,
    security: Security,
    server: str | None = None,
    *,
    report: Callable[[str], None] = lambda message: None,
    identity: str | None = None,
    send_hwm: int | None = None,
    receive_hwm: int | None = None,
    kernel_buffer_bytes: int | None = None,
    domain: str | None = None,
    immediate: bool = False,
    before_attach: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """A socket of `kind`, set up and attached to `endpoint`.

    `server` names the key of what a connecting socket reaches (CURVE client); `report` receives
    the ZAP handler's refusals (CURVE server).  `identity` is a DEALER's routing id; the high-water
    marks (messages) and kernel buffers (bytes) keep ZeroMQ's defaults when None.  `domain` names a
    bound socket's place (bus.keys.SOCKET_ROLES): the roles it admits.  `immediate`: queue
    messages only to completed connections (a connecting socket with no peer up refuses sends).
    `before_attach`: called with the socket before it binds or connects (a link watcher's monitor
    attached there sees the first connection too)."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity.encode())
    if immediate:
        socket.setsockopt(zmq.IMMEDIATE, 1)
    sizes = (
        (zmq.SNDHWM, send_hwm),
        (zmq.RCVHWM, receive_hwm),
        (zmq.SNDBUF, kernel_buffer_bytes),
        (zmq.RCVBUF, kernel_buffer_bytes),
    )
    heartbeats = (
        (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
        (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        (zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS),
        (zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS),
    )
    for option, value in (*sizes, *heartbeats):
        if value is not None:
            socket.setsockopt(option, value)
    security.secure(context, socket, endpoint, server, report=report, domain=domain)
    if before_attach is not None:
        before_attach(socket)
    attach(socket, endpoint)
    return socket
