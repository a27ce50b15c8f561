"""A small cluster file for the `dloco up` tests: a 30 K-parameter model, P = 2, H = 10; and what
the tests read back from a run directory."""

from __future__ import annotations


def small_profile(duration_s: float, eval_every: int, regions: str, max_steps: int = 0) -> str:
    """TOML with the tests' tiny model, sync and merger settings; `regions` holds the [[regions]]
    tables. With max_steps the run is bounded by work and duration_s is only its limit."""
    return f"""
[run]
duration_s = {duration_s}
max_steps = {max_steps}
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

[merger]
outer_lr = 0.35
snapshot_codec = "bf16"
snapshot_diff_codec = "int4"
share_window = 8
{regions}"""
