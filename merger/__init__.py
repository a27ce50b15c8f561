"""The merger: the single writer of the global model; a pure core (fold, outer, rda, ...) inside a
socket and disk shell.

May import: protocol, bus, telemetry, cliargs and third-party libraries; no other package of the
project.
"""
