"""A small cluster file for the `dloco up` tests: a 30 K-parameter model, P = 2, H = 10."""

from __future__ import annotations


def small_profile(duration_s: float, eval_every: int, regions: str) -> str:
    """TOML with the tests' tiny model and sync settings; `regions` holds the [[regions]] tables."""
    return f"""
[run]
duration_s = {duration_s}
eval_every = {eval_every}

[model]
width = 32
depth = 1
heads = 2
context = 32
batch = 8

[sync]
fragments = 2
interval = 10
{regions}"""
