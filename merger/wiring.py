"""The merger's connections, opened from its settings (merger.settings.ServiceConfig): its three
sockets, and the stream of its write-ahead log to a standby.

Sockets (endpoint strings: ``@tcp://...`` binds, ``tcp://...`` or ``>tcp://...`` connects):
- ``delta_sub``  SUB on the delta bus (topics ``delta/``, ``heartbeat/0/``; a shard only its
  fragments' ``delta/F/`` and its stream's ``heartbeat/I/``, protocol/shards.py): chunks from
  islands;
- ``snapshot_pub`` PUB on the snapshot bus: fragment snapshots and acks (bound with CURVE: an XPUB
  that charges its subscribers' subscriptions to them, bus/subscriptions.py);
- ``control`` ROUTER (binds): catch-up snapshot requests (Clone pattern), resend requests to
  islands (routed by island name) and the chunks they resend, hellos.
"""

from __future__ import annotations

import dataclasses

import zmq

from dloco.bus.sockets import open_socket
from dloco.bus.subscriptions import BudgetedXPUB
from dloco.merger.log import records
from dloco.merger.log.logmatch import genesis_of, newest_epoch, terms_of
from dloco.merger.network.publishing import Stamp
from dloco.merger.replication.consensus import PrimaryLease
from dloco.merger.replication.primary import ReplicationServer
from dloco.merger.state.recovery import wal_dir
from dloco.protocol import shards
from dloco.protocol.errors import DlocoError


@dataclasses.dataclass
class Sockets:
    context: zmq.Context
    delta_sub: zmq.Socket
    snapshot_pub: zmq.Socket | BudgetedXPUB
    control: zmq.Socket
    # the fragments this merger (shard) folds and serves
    owned: list[int]


def snapshot_send_hwm(values: int, max_chunk_bytes: int) -> int:
    """Messages the snapshot socket queues before it drops any: every fragment's full fp32 snapshot
    at once (a join publishes them together: past ZeroMQ's default of 1000 messages, a model above
    ~260 M parameters in chunks of 1 MiB would lose part of its join), plus the default.  The
    queued frames are the snapshots' own (sent without copying), so this bounds what a join
    holds."""
    return 1000 + -(-4 * values // max_chunk_bytes)


def open_sockets(config, fragments: int, log, values: int = 0) -> Sockets:
    """The merger's sockets in a new context; `fragments`: the model's count (a shard subscribes to
    its own only); `values`: the parameters it holds (its snapshot socket's queue)."""
    context = zmq.Context()

    def socket(
        kind: int, endpoint: str, server: str, domain: str, receive_hwm=None, send_hwm=None
    ) -> zmq.Socket:
        return open_socket(
            context,
            kind,
            endpoint,
            config.security,
            server,
            domain=domain,
            receive_hwm=receive_hwm,
            send_hwm=send_hwm,
            report=lambda message: log.warning("auth_refused", detail=message),
        )

    # ZeroMQ's queue of arrived deltas is part of the receive budget: beyond it they are dropped
    # and asked for again (domain: bound without a broker)
    delta_sub = socket(
        zmq.SUB,
        config.delta_endpoint,
        server="broker",
        domain="delta-in",
        receive_hwm=max(16, config.held_bytes // config.max_chunk_bytes),
    )
    # ZeroMQ filters at the publishers
    for topic in shards.subscriptions(config.shard, config.shards, fragments):
        delta_sub.setsockopt(zmq.SUBSCRIBE, topic)
    # islands subscribe here themselves (no broker): what they may make it hold is budgeted
    send_hwm = snapshot_send_hwm(values, config.max_chunk_bytes)
    if config.snapshot_endpoint.startswith("@") and not config.security.insecure:
        snapshot_pub = BudgetedXPUB(
            lambda: budgeted_xpub(socket, config.snapshot_endpoint, send_hwm),
            context,
            log,
            "snapshot",
        )
    else:
        snapshot_pub = socket(
            zmq.PUB,
            config.snapshot_endpoint,
            server="broker",
            domain="snapshot-out",
            send_hwm=send_hwm,
        )
    control = socket(zmq.ROUTER, config.control_endpoint, server=config.sender, domain="control")
    # an unknown island is an error we count, not a silent drop
    control.setsockopt(zmq.ROUTER_MANDATORY, 1)
    owned = shards.owned(config.shard, config.shards, fragments)
    return Sockets(context, delta_sub, snapshot_pub, control, owned)


def budgeted_xpub(socket, endpoint: str, send_hwm: int) -> zmq.Socket:
    """The merger's own snapshot socket when it binds with CURVE: every subscription reaches it."""
    made = socket(zmq.XPUB, endpoint, server="broker", domain="snapshot-out", send_hwm=send_hwm)
    made.setsockopt(zmq.XPUB_VERBOSE, 1)
    return made


def start_replication(
    config, context, wal, stamp: Stamp, takeover, log, lease=(None, None)
) -> ReplicationServer:
    """The log's stream to a standby.  A primary that did not take over (`takeover` None) starts a
    term of its own (records it lost since it last streamed must not match its standby's copies of
    them) with an epoch above every epoch its log names: `stamp.epoch` moves there.  With etcd
    (`lease`: the pair's keys and this merger's claim), the epoch is the claim's, and the primary
    acknowledges nothing while its lease is not valid."""
    consensus, claim = lease
    if takeover is not None:
        terms, term = takeover.terms, takeover.term
    else:
        # the genesis record a new run just wrote, on disk where terms_of and genesis_of read
        wal.sync()
        terms, _, term = terms_of(wal_dir(config.run_dir))
        epoch = max(stamp.epoch, newest_epoch(terms) + 1)
        if claim is not None:
            if claim.epoch <= newest_epoch(terms):
                raise DlocoError(
                    f"the epoch claimed in etcd ({claim.epoch}) is not above this log's newest"
                    f" ({newest_epoch(terms)})"
                )
            epoch = claim.epoch
        stamp.epoch, term = epoch, term + 1
        terms.append((stamp.epoch, wal.append(records.term_record(term, stamp.epoch))))
        wal.sync()
    return ReplicationServer(
        context,
        config.replication,
        config.security,
        config.sender,
        wal,
        wal_dir(config.run_dir),
        stamp.epoch,
        terms,
        term,
        genesis_of(config.run_dir),
        log,
        (
            PrimaryLease(consensus, claim, log.bind(role="merger", sender=config.sender))
            if claim is not None
            else None
        ),
    )
