"""A merger with a peer: standby or primary, and back (merger/replication/standby.py,
merger/replication/primary.py).

Without a peer a merger is the primary, as always.  With one it starts as the standby when told
to (`--standby-of`), else it first asks the peer for two leases whether it is the primary (a merger
restarted after its standby took over must not publish beside it) and becomes its standby if so.
A standby whose primary's lease lapses takes over; a primary fenced by a newer one steps down and
follows it.
"""

from __future__ import annotations

import signal
import threading

import zmq

from dloco.merger.config import ConfigError
from dloco.merger.replication.standby import Diverged, Refused, Standby
from dloco.merger.service import MergerService
from dloco.merger.settings import ReplicationConfig, ServiceConfig
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
            standby = Standby(config, replication, context, log)
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
            service = MergerService(config, core_factory=core_factory, takeover=takeover)
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
