"""`dloco bench adoption` runs end to end on the default model (its figures are timings: checked
for shape here, measured in BENCHMARKS.md)."""

from __future__ import annotations

from dloco.benchmarks import adoption
from dloco.island import bytelm, exchange
from dloco.island.config import ModelConfig, TrainConfig


def test_bench_adoption_times_every_measure_on_the_largest_fragment():
    result = adoption.run(reps=2, log=lambda line: None)
    params = bytelm.trainer(ModelConfig(), TrainConfig()).params()
    sizes = [
        sum(params[p].size for p in paths)
        for paths in exchange.partition({p: v.shape for p, v in params.items()}, 4)
    ]
    assert result["fragment_values"] == max(sizes)
    assert set(result["median_ms"]) == {
        "step",
        "read",
        "write",
        "read_by_walk",
        "write_by_walk",
    }
    assert all(value > 0 for value in result["median_ms"].values())
    assert "of a" in adoption.summary(result)
