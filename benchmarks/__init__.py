"""Benchmarks: scripts anyone can run; each prints its figure next to a reference measured in the
same run.

May import: the process packages (protocol, bus, island, merger, broker) and cluster; not the suites
or the CLI (dloco).
"""
