"""The consensus store beside the broker: with `[merger] failover = "etcd"`, `dloco up` starts one
etcd member on the hub's host, its data under the run directory, and the two mergers hold their
lease key there (merger/replication/consensus.py, PROTOCOL.md §12).  `dloco etcd` runs the etcd
binary (Debian's etcd-server) with those settings, so that the launcher, the network namespaces and
the compose file start it as they start every other process."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import subprocess
import sys

# etcd's own defaults, on the hub's host (each network namespace has its ports to itself)
CLIENT_PORT, PEER_PORT = "2379", "2380"


def dloco_args(data_dir: str, bind: str, host: str, client_port: str, peer_port: str) -> list[str]:
    """`dloco etcd`'s arguments: data in `data_dir`, clients served on `bind` ("*": every address)
    and reached at `host`."""
    return [
        "etcd",
        *("--data-dir", data_dir, "--bind", bind, "--host", host),
        *("--client-port", client_port, "--peer-port", peer_port),
    ]


def first(services: dict, health: list[str]) -> dict:
    """`services` with etcd (if there) healthy before any merger starts: `health` exits 0 once it
    accepts connections (the mergers reach it at their start, an etcd out of reach then being their
    error)."""
    if "etcd" not in services:
        return services
    out = {name: service for name, service in services.items()}
    out["etcd"] = dataclasses.replace(services["etcd"], health=health, health_interval_s=0.5)
    for name, service in services.items():
        if name == "merger" or name.startswith("merger.") or name == "standby":
            out[name] = dataclasses.replace(service, depends={"etcd": "service_healthy"})
    return out


def etcd_argv(args: argparse.Namespace) -> list[str]:
    """The etcd binary's command line: one member, named after its host."""
    bind = "0.0.0.0" if args.bind == "*" else args.bind
    return [
        "--name",
        "dloco",
        "--data-dir",
        args.data_dir,
        "--listen-client-urls",
        f"http://{bind}:{args.client_port}",
        "--advertise-client-urls",
        f"http://{args.host}:{args.client_port}",
        "--listen-peer-urls",
        f"http://{bind}:{args.peer_port}",
        "--initial-advertise-peer-urls",
        f"http://{args.host}:{args.peer_port}",
        "--initial-cluster",
        f"dloco=http://{args.host}:{args.peer_port}",
        "--log-level",
        "warn",
    ]


def add_command(commands: argparse._SubParsersAction) -> None:
    etcd = commands.add_parser(
        "etcd", help="one etcd member for the mergers' failover (dloco up starts it)"
    )
    etcd.add_argument("--data-dir", required=True)
    etcd.add_argument("--bind", default="127.0.0.1", help='address to listen on ("*": all)')
    etcd.add_argument("--host", default="127.0.0.1", help="address the mergers reach it at")
    etcd.add_argument("--client-port", default=CLIENT_PORT)
    etcd.add_argument("--peer-port", default=PEER_PORT)
    etcd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    binary = shutil.which("etcd")
    if binary is None:
        print(
            'dloco etcd: no etcd binary on PATH ([merger] failover = "etcd" needs one: Debian\'s'
            " etcd-server package, or a release from github.com/etcd-io/etcd)",
            file=sys.stderr,
        )
        return 2
    child = subprocess.Popen([binary, *etcd_argv(args)], preexec_fn=_die_with_parent)
    asked = []

    # etcd ends on SIGTERM by raising it again after its clean stop: asked for, that is an exit 0
    def forward(sig, _frame) -> None:
        asked.append(sig)
        child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    return 0 if asked and code in (0, -asked[0]) else code if code >= 0 else 128 - code


def _die_with_parent() -> None:
    """In the child: killed with this process (chaos's kill -9 of `dloco etcd` is etcd's too)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
