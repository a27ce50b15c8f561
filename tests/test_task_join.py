"""An island whose task builds another model than the merger's is refused when it joins, by the
first differing parameter's name: in-process from what has arrived, and as a process against a
real merger (-m e2e)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dloco.island.task import build, resolve
from tests.task_helpers import DIGITS, ROOT, context, dloco


class ForeignLink:
    """A link that has received, of another model, the snapshots of `arrived` fragments (their
    layout only, as NetworkLink keeps)."""

    bytes_sent = bytes_received = 0
    unfolded: dict = {}

    def __init__(self, layout: dict[int, dict[str, tuple]]) -> None:
        self.foreign = layout

    def snapshots(self) -> list:
        return []


def test_join_refuses_another_model_once_what_arrived_shows_the_difference():
    """The merger's model has two hidden layers, this task's three: every path the merger sends is
    one of this task's, with its shape, so the difference shows only when every fragment is in."""
    from dloco.island import exchange
    from dloco.island.config import SyncConfig, TrainConfig
    from dloco.island.joining import JoinTimeout, ModelMismatch
    from dloco.island.loop import IslandLoop
    from dloco.island.metrics import MetricsWriter
    from dloco.island.train import Trainer

    digits = resolve(f"{DIGITS}:task")
    merger_params = Trainer(
        digits(context()).model, digits(context()).loss, TrainConfig(batch=32)
    ).params()
    fragments = exchange.partition({p: v.shape for p, v in merger_params.items()}, 2)
    layout = {f: {p: merger_params[p].shape for p in paths} for f, paths in enumerate(fragments)}
    ours = digits(context(layers=3))
    loop = IslandLoop(
        Trainer(ours.model, ours.loss, TrainConfig(batch=32)),
        ours.batches,
        ours.eval_batches,
        TrainConfig(batch=32),
        SyncConfig(fragments=2, interval=10),
        MetricsWriter(None),
        link=ForeignLink({0: layout[0]}),
    )
    # fragment 0 alone agrees with this task's model: nothing to refuse
    with pytest.raises(JoinTimeout):
        loop.join(0.2)
    loop.link = ForeignLink(layout)
    with pytest.raises(
        ModelMismatch,
        match=r"this task's model has hidden/2/bias \(64,\), the merger's has no such parameter",
    ):
        loop.join(30.0)
    # half a model that differs in what arrived is refused by the join's deadline, naming what it
    # saw
    loop.link = ForeignLink({1: {**layout[1], "hidden/1/kernel": (64, 32)}})
    with pytest.raises(
        ModelMismatch,
        match=r"hidden/1/kernel is \(64, 32\) in the merger's model and \(64, 64\) in this task's",
    ):
        loop.join(0.2)


def start_merger(tmp_path: Path, init: Path, ports: list[int]) -> subprocess.Popen:
    """A merger of two fragments from `init`, bound on `ports`, its log in tmp_path/merger.log."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dloco",
            "merger",
            "--run-dir",
            tmp_path / "m",
            "--init-npz",
            init,
            "--fragments",
            "2",
            "--delta-endpoint",
            f"@tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"@tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"@tcp://127.0.0.1:{ports[2]}",
            "--insecure",
        ],
        stdout=open(tmp_path / "merger.log", "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


# a merger, a broker and an island process: -m e2e
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_island_whose_task_differs_from_the_merger_model_is_refused_at_join(tmp_path):
    """The merger starts from the digits model with 64 hidden units; an island given hidden=32 is
    refused when the merger's snapshots arrive (not after its join timeout), naming the first
    differing parameter and both shapes."""
    from dloco.cluster.ports import free_ports
    from dloco.island.config import TrainConfig
    from dloco.island.train import Trainer

    # what `dloco island --write-init --task ...digits.py:task` writes, without starting a process
    # for it
    init = tmp_path / "init.npz"
    merger_task = build(f"{DIGITS}:task", context())
    np.savez(init, **Trainer(merger_task.model, merger_task.loss, TrainConfig(batch=32)).params())
    ports = free_ports(3)
    merger = start_merger(tmp_path, init, ports)
    try:
        island = dloco(
            "island",
            "--name",
            "other",
            "--task",
            f"{DIGITS}:task",
            "--task-option",
            "hidden=32",
            "--batch",
            "32",
            "--max-steps",
            "50",
            "--fragments",
            "2",
            "--interval",
            "10",
            "--join-timeout",
            "200",
            "--insecure",
            "--delta-endpoint",
            f"tcp://127.0.0.1:{ports[0]}",
            "--snapshot-endpoint",
            f"tcp://127.0.0.1:{ports[1]}",
            "--control-endpoint",
            f"tcp://127.0.0.1:{ports[2]}",
            timeout=260,
        )
    finally:
        merger.terminate()
        merger.wait(timeout=30)
    assert island.returncode == 2, (island.stdout[-2000:], island.stderr[-2000:])
    assert (
        "the merger trains another model than this task: hidden/0/bias is (64,) in the merger's"
        " model and (32,) in this task's" in island.stderr
    ), island.stderr[-2000:]
    assert "Traceback" not in island.stderr and '"event": "step"' not in island.stdout
