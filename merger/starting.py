"""A fresh merger's model: every tensor's shape, and the values of the fragments it folds.

A merger shard (`dloco merger --shard I/N`, protocol/shards.py) loads, holds, logs and checkpoints
only its own fragments: it reads every tensor's shape from the initial values (to cut the same
fragments as every other process, and for the model's fingerprint) and the values of its own
fragments alone, so its memory is its share of the model.  A core given the values of some
fragments only holds those (merger/state/core.py): the others are another shard's.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from dloco.merger.config import MergerConfig
from dloco.merger.state.core import MergerCore
from dloco.protocol import model_fingerprint, partition
from dloco.protocol.errors import ConfigError
from dloco.protocol.shards import owned


def initial_core(
    config: MergerConfig,
    params: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]],
    fragments: int,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
):
    """A factory for a fresh core: partition by bytes, fingerprint, genesis logged on creation.
    `params`: the values of the fragments it folds, or a function that reads them when the core is
    made (the core then holds them alone, and its first folds free them: values kept here would
    stay beside the core's for the whole run); `shapes`: every tensor's (None: `params` is the
    whole model, a mapping)."""
    if shapes is None:
        shapes, model = (
            {path: tuple(a.shape) for path, a in params.items()},
            model_fingerprint(params),
        )
    else:
        model = model_fingerprint(
            {path: (tuple(shape), "float32") for path, shape in shapes.items()}
        )
    parts = partition(shapes, fragments)
    values = params if callable(params) else lambda: params
    return lambda wal: MergerCore(config, model, parts, values(), log=wal)


def npz_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every array's shape in an .npz file, from the headers: no values are read."""
    shapes = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if not name.endswith(".npy"):
                    continue
                with archive.open(name) as member:
                    version = np.lib.format.read_magic(member)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shapes[name[: -len(".npy")]] = tuple(read(member)[0])
    except (zipfile.BadZipFile, ValueError) as error:
        raise ConfigError(f"{path}: not a readable .npz of arrays ({error})") from error
    return shapes


def load_initial(
    path: str | Path, fragments: int, shard: int = 0, shards: int = 1
) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    """(values, shapes) from an initial-values .npz for shard `shard` of `shards`: every tensor's
    shape, and the float32 values of the fragments that shard folds (all of them for one
    merger), read one array at a time."""
    with np.load(path) as data:
        if shards == 1:
            params = {name: data[name].astype(np.float32, copy=False) for name in data.files}
            return params, {name: tuple(a.shape) for name, a in params.items()}
        shapes = npz_shapes(path)
        parts = partition(shapes, fragments)
        mine = {p for fragment in owned(shard, shards, len(parts)) for p in parts[fragment]}
        return {
            name: data[name].astype(np.float32, copy=False) for name in data.files if name in mine
        }, shapes
