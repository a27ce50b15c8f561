"""Argument types and flags shared by every process's command line (`int_at_least`,
`float_at_least`, `port_number`, `add_metrics_flags`).

May import: the standard library only."""

from __future__ import annotations

import argparse


def int_at_least(low: int):
    """An argparse type: an integer >= low, with a clear message otherwise."""
    return _at_least(int, low, "a positive integer" if low == 1 else f"an integer >= {low}")


def float_at_least(low: float):
    """An argparse type: a finite number >= low, with a clear message otherwise."""
    return _at_least(float, low, f"a number >= {low:g}")


def _at_least(kind, low, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        # NaN fails the first test
        if not value >= low or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


def port_number(low: int = 1):
    """An argparse type: a TCP port, `low` to 65535 (0: any free one; -1: off, where a command
    allows it)."""
    at_least = int_at_least(low)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > 65535:
            raise argparse.ArgumentTypeError(f"expected a port number up to 65535, got {value}")
        return value

    return parse


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host: Prometheus metrics (telemetry/prom.py), off unless a port
    is given."""
    parser.add_argument(
        "--metrics-port",
        type=port_number(),
        default=None,
        help="serve Prometheus metrics on this port (default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address the metrics port binds (0.0.0.0 in a container)",
    )
