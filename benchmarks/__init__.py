"""Benchmarks: scripts anyone can run; each prints its figure next to a reference measured in the same run."""
