"""Argument types and flags shared by every process's command line (`int_at_least`,
`float_at_least`, `port_number`, `add_metrics_flags`), and the one rule that turns a typed config's
fields into flags and back (`Flag`, `add_fields`, `from_args`, `as_flags`): a process's flags take
their names, types and defaults from its dataclasses, and the launcher writes a config object out
as flags by the same table.

May import: the standard library only."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable


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


@dataclasses.dataclass(frozen=True)
class Flag:
    """The flag of a config field: `--field-name` unless `flag` says otherwise; its type is the
    default's (a bool field is a switch, off by default) unless `type` says otherwise."""

    field: str
    help: str | None = None
    flag: str | None = None
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


def _flags(flags: Iterable[Flag | str]) -> list[Flag]:
    return [flag if isinstance(flag, Flag) else Flag(flag) for flag in flags]


def field_names(flags: Iterable[Flag | str]) -> list[str]:
    """The config fields a table of flags carries."""
    return [flag.field for flag in _flags(flags)]


def add_fields(parser, config_type, flags: Iterable[Flag | str]) -> None:
    """One flag per entry of `flags` (a Flag, or a field name) on `parser` (or an argument group),
    its destination the field's name and its default the field's default in `config_type`."""
    defaults = {field.name: field.default for field in dataclasses.fields(config_type)}
    for flag in _flags(flags):
        default = defaults[flag.field]
        if type(default) is bool:
            if default:
                raise ValueError(f"{config_type.__name__}.{flag.field}: a switch must be off")
            parser.add_argument(flag.option, dest=flag.field, action="store_true", help=flag.help)
            continue
        parser.add_argument(
            flag.option,
            dest=flag.field,
            type=flag.type or type(default),
            default=default,
            choices=flag.choices,
            metavar=flag.metavar,
            help=flag.help,
        )


def from_args(config_type, args: argparse.Namespace, **values):
    """`config_type` from the parsed flags named as its fields (the others keep their defaults);
    `values` set fields the command line does not carry."""
    fields = {field.name for field in dataclasses.fields(config_type)}
    taken = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    return config_type(**{**taken, **values})


def as_flags(config, flags: Iterable[Flag | str]) -> list[str]:
    """`config`'s fields as the command line `add_fields` reads back: each field that differs from
    its default (a switch: given when on)."""
    out = []
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    for flag in _flags(flags):
        value, default = getattr(config, flag.field), defaults[flag.field]
        # True == 1: a bool given for a number is written out (and refused by the flag's type)
        if type(value) is type(default) and value == default:
            continue
        out += [flag.option] if type(default) is bool else [flag.option, str(value)]
    return out
