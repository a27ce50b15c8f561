"""Failover decided by a consensus store (PROTOCOL.md §12): with `--etcd`, the primary holds a
lease key in etcd, as Patroni and Kubernetes' leader election do, and a standby takes over only by
claiming that key once etcd has let the lease lapse.

Two keys under the prefix: ``PREFIX/primary`` (the holder's name, attached to its lease: etcd
deletes it when the lease expires) and ``PREFIX/epoch`` (the newest primary's epoch, never
deleted).  A claim is one transaction: "no primary key, and the epoch key unchanged since I read
it" -> write both.  So each claim's epoch is above every earlier claim's, ordered by etcd's Raft
log and not by any clock, and of two mergers claiming at once one wins.

The holder keeps the lease alive every lease/6 and counts it valid until `sent + ttl / RATE_BOUND`
on its own clock, `sent` being when the last renewal that etcd granted left it: etcd's own expiry
is `ttl` after it received that renewal, so while clock rates differ by less than RATE_BOUND the
holder stops acknowledging before etcd can hand the key to anyone else.  A holder whose lease etcd
let expire reclaims the key only if no one claimed it since (the epoch key is the one it wrote);
else it has been replaced (`lost`).

The client speaks etcd's JSON gateway (the v3 API over HTTP, etcd >= 3.4) with the standard
library: the gateway is etcd's documented interface, and the Python gRPC clients are either
unmaintained (python-etcd3) or pull in grpcio for four calls.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from dloco.protocol.errors import ConfigError, DlocoError

# a holder counts its lease valid for ttl / RATE_BOUND past a renewal's sending (PROTOCOL.md §12
# assumption 2: clock rates differ by less than a factor of 2)
RATE_BOUND = 2.0
# renewals per lease: one lost renewal leaves the lease valid
RENEWALS_PER_LEASE = 6


class EtcdUnreachable(DlocoError):
    """No etcd endpoint answered; the message names each endpoint and why."""


class EtcdRefused(DlocoError):
    """etcd answered with an error (a lease it does not know, a malformed request)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def check_endpoints(endpoints: Sequence[str]) -> tuple[str, ...]:
    """`--etcd`'s URLs, each http://HOST:PORT (ConfigError otherwise)."""
    out = []
    for endpoint in endpoints:
        endpoint = endpoint.strip().rstrip("/")
        scheme, _, rest = endpoint.partition("://")
        if scheme not in ("http", "https") or not rest:
            raise ConfigError(f"an etcd endpoint is http://HOST:PORT, got {endpoint!r}")
        out.append(endpoint)
    if not out:
        raise ConfigError("--etcd needs at least one endpoint")
    return tuple(out)


class Etcd:
    """etcd's v3 JSON gateway at `endpoints` (any member of one cluster); each call tries the one
    that last answered first, then the others."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float) -> None:
        self.endpoints, self.timeout_s, self.good = check_endpoints(endpoints), timeout_s, 0

    def call(self, path: str, body: dict) -> dict:
        errors = []
        for offset in range(len(self.endpoints)):
            index = (self.good + offset) % len(self.endpoints)
            request = urllib.request.Request(
                self.endpoints[index] + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    reply = json.loads(answer.read())
            except urllib.error.HTTPError as error:
                detail = error.read()[:300].decode(errors="replace")
                # a member without a leader answers 503: another may have one
                if error.code >= 500:
                    errors.append(f"{self.endpoints[index]}: HTTP {error.code} {detail}")
                    continue
                raise EtcdRefused(f"etcd at {self.endpoints[index]}{path}: {detail}") from None
            except (OSError, ValueError) as error:
                errors.append(f"{self.endpoints[index]}: {getattr(error, 'reason', error)}")
                continue
            self.good = index
            return reply
        raise EtcdUnreachable("etcd unreachable: " + "; ".join(errors))

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, its TTL in seconds as etcd granted it)."""
        reply = self.call("/v3/lease/grant", {"TTL": ttl_s})
        return int(reply["ID"]), int(reply["TTL"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease`; its TTL, 0 once etcd let it expire."""
        reply = self.call("/v3/lease/keepalive", {"ID": lease})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": lease})

    def get(self, key: str) -> dict | None:
        """The key's record (value decoded, revisions as ints), None if absent."""
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _record(kvs[0]) if kvs else None

    def version(self) -> str:
        request = urllib.request.Request(self.endpoints[self.good] + "/version")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read()).get("etcdserver", "?")
        except (OSError, ValueError):
            # the other endpoints, through call's reporting
            self.get("/")
            return "?"


def _record(kv: dict) -> dict:
    return {
        "value": _text(kv.get("value", "")),
        "mod_revision": int(kv.get("mod_revision", 0)),
        "create_revision": int(kv.get("create_revision", 0)),
        "lease": int(kv.get("lease", 0)),
    }


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim etcd granted: the lease, its TTL, this primary's epoch, the transaction's revision
    (the epoch key's mod_revision from then on) and when the claim left this process (monotonic)."""

    lease: int
    ttl_s: int
    epoch: int
    revision: int
    sent: float


@dataclasses.dataclass
class LeaseClock:
    """Until when a holder may act on its lease, on its own monotonic clock."""

    valid_until: float = -float("inf")

    def renewed(self, sent: float, ttl_s: float) -> None:
        """etcd granted a renewal (or the claim) that left at `sent` with `ttl_s`."""
        self.valid_until = max(self.valid_until, sent + ttl_s / RATE_BOUND)

    def valid(self, now: float) -> bool:
        return now < self.valid_until


def epoch_after(floor: int, stored: dict | None) -> int:
    """A new claim's epoch: at least `floor` (what the claimer has seen), above the stored one."""
    return max(floor, int(stored["value"]) + 1 if stored is not None else 0)


class Consensus:
    """One merger's view of its pair's keys in etcd."""

    def __init__(self, endpoints: Sequence[str], prefix: str, holder: str, lease_s: float) -> None:
        self.holder, self.prefix = holder, prefix.rstrip("/")
        # etcd's TTLs are whole seconds; a renewal waits at most one renewal interval
        self.ttl_s = max(2, round(lease_s))
        self.etcd = Etcd(endpoints, timeout_s=max(0.2, lease_s / RENEWALS_PER_LEASE))
        self.primary_key, self.epoch_key = f"{self.prefix}/primary", f"{self.prefix}/epoch"

    def check(self) -> str:
        """Reach etcd (EtcdUnreachable naming every endpoint otherwise); returns its version."""
        return self.etcd.version()

    def holder_now(self) -> str | None:
        record = self.etcd.get(self.primary_key)
        return record["value"] if record is not None else None

    def claim(self, floor: int, own: Claim | None = None) -> Claim | None:
        """Claim the primary key with an epoch of at least `floor` (a reclaim, `own` given: only if
        no one claimed it since `own`, keeping its epoch).  None when it is held, or was claimed
        since `own`.  Raises EtcdUnreachable, EtcdRefused."""
        stored = self.etcd.get(self.epoch_key)
        if own is not None and (stored is None or stored["mod_revision"] != own.revision):
            return None
        epoch = own.epoch if own is not None else epoch_after(floor, stored)
        sent = time.monotonic()
        lease, ttl = self.etcd.grant(self.ttl_s)
        reply = self.etcd.call(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": _b64(self.primary_key), "target": "CREATE", "create_revision": 0},
                    {
                        "key": _b64(self.epoch_key),
                        "target": "MOD",
                        "mod_revision": stored["mod_revision"] if stored is not None else 0,
                    },
                ],
                "success": [
                    {
                        "request_put": {
                            "key": _b64(self.primary_key),
                            "value": _b64(self.holder),
                            "lease": lease,
                        }
                    },
                    {"request_put": {"key": _b64(self.epoch_key), "value": _b64(str(epoch))}},
                ],
            },
        )
        if not reply.get("succeeded"):
            self.etcd.revoke(lease)
            return None
        return Claim(lease, ttl, epoch, int(reply["header"]["revision"]), sent)


class PrimaryLease:
    """The primary's hold on the key: renewed on a thread of its own every lease/6.  `valid()`: it
    may acknowledge now; `lost`: why it never may again (another merger claimed the key)."""

    def __init__(self, consensus: Consensus, claim: Claim, log) -> None:
        self.consensus, self.claim, self.log = consensus, claim, log
        self.clock = LeaseClock()
        self.clock.renewed(claim.sent, claim.ttl_s)
        self.lost: str | None = None
        self.renewals_failed = 0
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> int:
        return self.claim.epoch

    def valid(self) -> bool:
        with self.cond:
            return self.lost is None and self.clock.valid(time.monotonic())

    def wait(self, timeout: float) -> None:
        """Until the lease is renewed or lost, or `timeout` seconds."""
        with self.cond:
            self.cond.wait(timeout)

    def _run(self) -> None:
        interval = self.claim.ttl_s / RENEWALS_PER_LEASE
        unreachable = False
        while not self._stop.wait(interval) and self.lost is None:
            try:
                self._renew()
                if unreachable:
                    self.log.info("etcd_back", failed=self.renewals_failed)
                unreachable = False
            except (EtcdUnreachable, EtcdRefused) as error:
                self.renewals_failed += 1
                if not unreachable:
                    self.log.warning("etcd_unreachable", error=str(error)[:300])
                unreachable = True

    def _renew(self) -> None:
        sent = time.monotonic()
        ttl = self.consensus.etcd.keepalive(self.claim.lease)
        if ttl > 0:
            with self.cond:
                self.clock.renewed(sent, ttl)
                self.cond.notify_all()
            return
        # etcd let it expire (it was unreachable for a whole TTL): ours again if no one claimed it
        claim = self.consensus.claim(self.claim.epoch, own=self.claim)
        with self.cond:
            if claim is None:
                self.lost = "another merger claimed the primary's etcd key after its lease lapsed"
                self.log.warning("lease_lost", holder=self.consensus.holder_now())
            else:
                self.claim = claim
                self.clock.renewed(claim.sent, claim.ttl_s)
                self.log.warning("lease_reclaimed", epoch=claim.epoch, revision=claim.revision)
            self.cond.notify_all()

    def close(self) -> None:
        """Stop renewing and give the key up (a standby may claim it at once)."""
        self._stop.set()
        self._thread.join(timeout=30)
        if self.lost is None:
            try:
                self.consensus.etcd.revoke(self.claim.lease)
            # it lapses by itself within its TTL
            except (EtcdUnreachable, EtcdRefused):
                pass
