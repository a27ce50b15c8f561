"""A merger with a peer: standby or primary, and back (merger/replication/standby.py,
merger/replication/primary.py).

Without a peer a merger is the primary, as always.  With one it starts as the standby when told
to (`--standby-of`), else it first asks the peer for two leases whether it is the primary (a merger
restarted after its standby took over must not publish beside it) and becomes its standby if so.
A standby whose primary's lease lapses takes over; a primary fenced by a newer one steps down and
follows it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import zmq

from dloco.merger.config import ConfigError
from dloco.merger.log.logmatch import newest_epoch, terms_of
from dloco.merger.replication.consensus import (
    RENEWALS_PER_LEASE,
    Claim,
    Consensus,
    EtcdRefused,
    EtcdUnreachable,
)
from dloco.merger.replication.standby import Diverged, Refused, Standby
from dloco.merger.service import MergerService
from dloco.merger.settings import ReplicationConfig, ServiceConfig
from dloco.merger.state.recovery import wal_dir
from dloco.telemetry import prom
from dloco.telemetry.logs import configure_logging

# a standby whose state differs from its primary's (an alarm: never promote it)
EXIT_DIVERGED = 5
EXIT_REFUSED = 2


# Over 60 lines: the process's roles in one loop (standby until it takes over, primary until fenced,
# then standby again), so that the signal handler reaches whichever role runs now.
def run_merger_roles(config: ServiceConfig, core_factory=None) -> tuple[int, MergerService | None]:
    """Run until stopped; returns the exit code and the last primary service (None if never
    primary)."""
    replication: ReplicationConfig = config.replication
    if not replication.peer:
        service = MergerService(config, core_factory=core_factory)
        return service.run(), service
    log = configure_logging("merger", sender=config.sender)
    consensus = _consensus(replication, log)
    context = zmq.Context()
    probe, service, standby, stop = not replication.standby, None, None, threading.Event()

    # whichever role runs now stops (a standby taking over meanwhile too)
    def on_signal(*_) -> None:
        stop.set()
        for role in (standby, service):
            if role is not None:
                role.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        while not stop.is_set():
            standby = Standby(config, replication, context, log, consensus)
            standby.stopping = stop.is_set()
            metrics = serve_standby_metrics(config, standby)
            try:
                takeover = standby.follow(probe=probe)
            except (Diverged, Refused) as error:
                _stop_metrics(metrics)
                log.error("standby_stopped", error=str(error))
                standby.close()
                return (EXIT_DIVERGED if isinstance(error, Diverged) else EXIT_REFUSED), service
            # a full disk, a corrupt log: the process ends, its log, lock and compilation closed
            # first
            except BaseException:
                _stop_metrics(metrics)
                standby.close()
                raise
            # the primary serves the same port
            _stop_metrics(metrics)
            claim = takeover.claim if takeover is not None else None
            if takeover is None:
                standby.close()
                if standby.stopping:
                    log.info("stopped", standby=True, length=standby.wal.next_index)
                    return 0, service
                log.info("no_primary", peer=replication.peer, waited_s=2 * replication.lease_s)
                if core_factory is None and standby.wal.next_index == 0:
                    raise ConfigError(
                        f"{config.run_dir} holds no log, no primary answers at {replication.peer},"
                        " and no --init-npz was given"
                    )
                claim = _claim(consensus, config, stop, log) if consensus is not None else None
                if consensus is not None and claim is None:
                    # another merger holds the key: it is the primary, out of our sight
                    probe = True
                    continue
            service = MergerService(
                config, core_factory=core_factory, takeover=takeover, lease=(consensus, claim)
            )
            service.stopping = stop.is_set()
            standby = None
            code = service.run(signals=False)
            if service.fenced is None:
                return code, service
            # stepped down: follow the merger that fenced us
            probe = False
        return 0, service
    finally:
        context.destroy(linger=0)


def _consensus(replication: ReplicationConfig, log) -> Consensus | None:
    """With --etcd, the pair's keys there, etcd reached once now: an etcd out of reach at start is
    an error naming each endpoint."""
    if not replication.etcd:
        return None
    consensus = Consensus(
        replication.etcd,
        replication.etcd_prefix,
        # one merger's life: a restarted one does not hold its earlier life's lease
        f"{replication.endpoint.lstrip('@')} pid {os.getpid()}",
        replication.lease_s,
    )
    try:
        version = consensus.check()
    except EtcdUnreachable as error:
        raise EtcdUnreachable(f"{error} (--etcd: is etcd running there?)") from None
    log.info("etcd", endpoints=list(replication.etcd), version=version, key=consensus.primary_key)
    return consensus


def _claim(consensus: Consensus, config: ServiceConfig, stop, log) -> Claim | None:
    """The primary's key for a merger that found no primary: tried for two TTLs (a lease of its
    own earlier life may still run), with an epoch above every epoch its log names.  None: another
    merger holds it, or etcd is out of reach."""
    wal = wal_dir(config.run_dir)
    terms = terms_of(wal)[0] if wal.exists() else []
    floor = max(time.time_ns(), newest_epoch(terms) + 1)
    deadline = time.monotonic() + 2 * consensus.ttl_s
    while not stop.is_set():
        try:
            claim = consensus.claim(floor)
            why = None if claim is not None else f"held by {consensus.holder_now()}"
        except (EtcdUnreachable, EtcdRefused) as error:
            claim, why = None, str(error)[:300]
        if claim is not None or time.monotonic() > deadline:
            if why is not None:
                log.warning("primary_refused", why=why)
            return claim
        stop.wait(consensus.ttl_s / RENEWALS_PER_LEASE)
    return None


def serve_standby_metrics(config: ServiceConfig, standby: Standby):
    """The standby's metrics on the merger's port (None without one): role, log, folds compared."""
    if config.metrics_port is None:
        return None
    return prom.serve(
        config.metrics_port,
        config.metrics_host,
        prom.registry_of(
            lambda: prom.replication_families(
                "standby", None, None, standby.wal.next_index, standby.compared
            )
        ),
    )


def _stop_metrics(server) -> None:
    if server is not None:
        prom.stop(server)
