"""A run directory, real but for the islands, for the tests of what is read out of one (export,
sample, the report's sample): the task record and initial model `dloco up` writes, and a merger's
write-ahead log and checkpoints written by MergerCore and checkpoint.save after folds of
pseudo-random deltas."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dloco import protocol
from dloco.analysis.globalmodel import build_task
from dloco.cluster import config as cluster_config
from dloco.cluster.records import run_task
from dloco.island.train import flat_params
from dloco.merger.config import MergeConfig, MergerConfig
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore
from dloco.merger.state.recovery import checkpoint_dir, wal_dir
from tests.merger_helpers import assemble, delta_chunks

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"


def cluster_file(folder: Path, corpus: Path) -> Path:
    """A cluster file of a tiny byte LM on `corpus`, two fragments, two regions."""
    path = folder / "cluster.toml"
    path.write_text(
        "[model]\nwidth = 32\ndepth = 1\nheads = 2\ncontext = 32\nbatch = 8\ncorpus ="
        f' "{corpus}"\n\n[sync]\nfragments = 2\n\n[[regions]]\nname = "a"\n\n[[regions]]\nname ='
        ' "b"\n'
    )
    return path


def make_run(root: Path) -> SimpleNamespace:
    """A run directory in `root` with two checkpoints: after a fold of fragment 0, then after one of
    fragment 1; with its cluster config, task record, initial parameters and fragment versions."""
    corpus = root / "corpus.py"
    corpus.write_text(CODE * 200)
    config = cluster_config.load(cluster_file(root, corpus))
    run_dir = root / "run"
    run_dir.mkdir()
    task = run_task(config)
    task.write(run_dir)
    params = flat_params(build_task(task).model)
    np.savez(run_dir / "init.npz", **params)
    wal = WriteAheadLog(wal_dir(run_dir / "merger"), fsync="never")
    core = MergerCore(
        MergerConfig(MergeConfig(max_staleness=2)),
        protocol.model_fingerprint(params),
        protocol.partition({p: a.shape for p, a in params.items()}, 2),
        params,
        log=wal,
    )
    saved = []
    for fragment in (0, 1):
        for i, island in enumerate(("a", "b")):
            chunks = delta_chunks(
                core.fragments[fragment],
                island,
                1 + fragment,
                fragment,
                0,
                seed=10 * fragment + i,
                params=params,
                first_seq=1 + fragment,
                max_chunk_bytes=1 << 20,
            )
            core.submit(assemble(chunks), now=float(fragment))
        for ready in core.due(now=fragment + 100.0)[0]:
            core.fold(ready)
        saved.append(checkpoint.save(checkpoint_dir(run_dir / "merger"), core, wal.next_index))
    wal.close()
    return SimpleNamespace(
        dir=run_dir,
        config=config,
        task=task,
        init=params,
        checkpoints=saved,
        versions=[s.version for s in core.states],
    )


def checkpoint_params(path: Path) -> dict[str, np.ndarray]:
    return {
        p: np.frombuffer(e["data"], dtype=np.dtype(e["dtype"])).reshape(e["shape"])
        for fragment in checkpoint.read(path)["fragments"]
        for p, e in fragment["params"].items()
    }


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
