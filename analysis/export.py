"""The merger's global model out of a run directory: its flat parameters from a checkpoint, and
`dloco export`'s safetensors file of them.

The merger checkpoints its whole state now and then and when it stops (merger/state/checkpoint.py),
as RUN_DIR/merger/checkpoints/<record>.ckpt, named by the write-ahead-log record it was taken at:
the number `dloco replay --verify` prints ("checkpoint at record N"), so that is the number a user
picks with --checkpoint.  The default is the newest that reads back intact: after a clean stop, the
final global model.

The file holds one float32 tensor per parameter path ("blocks/0/qkv/kernel") and string metadata
naming the run, the checkpoint, the fragment versions and the task (spec and options as JSON), so
that the model can be built again with the task plug-in and loaded by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from dloco.analysis.runinfo import RUN_TASK, RunDirError, RunTask, merger_run_dir, shard_run_dirs
from dloco.merger.state import checkpoint
from dloco.merger.state.recovery import checkpoint_dir
from dloco.protocol.errors import DlocoError

# the metadata's "format": what wrote the file, and how to read it
FORMAT = "dloco-global-model/1"


class ExportError(DlocoError):
    """The file cannot be written where --out says."""


@dataclasses.dataclass(frozen=True)
class GlobalModel:
    """The merger's global model as one checkpoint holds it."""

    # {path: float32 array}, every fragment's
    params: dict[str, np.ndarray]
    # the log record the checkpoint was taken at (its file name)
    record: int
    # each fragment's version: the folds made into it
    versions: tuple[int, ...]
    # the merger's state digest at the checkpoint (`dloco replay --verify` compares it)
    digest: str

    @property
    def count(self) -> int:
        return sum(int(a.size) for a in self.params.values())


def params_of(saved: dict) -> dict[str, np.ndarray]:
    """A checkpoint's content (checkpoint.read) to flat {path: float32 array}, every fragment's,
    bytes unchanged."""
    flat = {}
    for fragment in saved["fragments"]:
        for path, entry in fragment["params"].items():
            flat[path] = (
                np.frombuffer(entry["data"], dtype=np.dtype(entry["dtype"]))
                .reshape(entry["shape"])
                .astype(np.float32)
            )
    return flat


def merger_dir(run_dir: Path) -> Path:
    """Where `dloco up` puts the merger's log and checkpoints; RunDirError when `run_dir` is no run
    directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory (give the run directory `dloco up` wrote)")
    if not any((run_dir / name).exists() for name in ("merger", "init.npz", RUN_TASK)):
        raise RunDirError(
            f"{run_dir} is not a run directory: it has no merger/, init.npz or {RUN_TASK}"
        )
    return merger_run_dir(run_dir)


def latest_saved(run_dir: Path) -> dict | None:
    """The newest intact checkpoint's content (checkpoint.read); with merger shards, each
    fragment's from the shard that folds it (the highest version: the others hold it unfolded)."""
    saved = [checkpoint.latest(checkpoint_dir(directory)) for directory in shard_run_dirs(run_dir)]
    if any(s is None for s in saved):
        return None
    return combine(saved)


def combine(saved: list[dict]) -> dict:
    """Several shards' checkpoints as one: every fragment from the shard that holds it (a shard
    holds its own fragments only; logs written before that hold the others unfolded) at its
    highest version; the digests joined."""
    if len(saved) == 1:
        return saved[0]
    fragments = [
        max(
            (s["fragments"][i] for s in saved), key=lambda f: (bool(f["params"]), int(f["version"]))
        )
        for i in range(len(saved[0]["fragments"]))
    ]
    return {**saved[0], "fragments": fragments, "digest": "+".join(str(s["digest"]) for s in saved)}


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """{log record: file} of the run's checkpoints, oldest first."""
    return {
        int(path.stem): path
        for path in checkpoint.all_checkpoints(checkpoint_dir(merger_dir(run_dir)))
        if path.stem.isdigit()
    }


def load(run_dir: Path, record: int | None = None) -> GlobalModel:
    """The global model of the checkpoint at log record `record` (None: the newest intact one)."""
    found = checkpoints(run_dir)
    if not found:
        raise RunDirError(
            f"{run_dir} has no checkpoint of the merger yet (it writes one every so many folds and"
            " when it stops)"
        )
    if record is None:
        saved = latest_saved(merger_dir(run_dir).parent)
        if saved is None:
            lacking = [
                d.name
                for d in shard_run_dirs(run_dir)
                if checkpoint.latest(checkpoint_dir(d)) is None
            ]
            raise RunDirError(
                f"{run_dir}: no checkpoint of {', '.join(lacking)} reads back intact (a merger"
                " writes one every so many folds and when it stops; `dloco replay` rebuilds it"
                " from the log)"
            )
    else:
        if len(shard_run_dirs(run_dir)) > 1:
            raise RunDirError(
                f"{run_dir} has merger shards, each with its own log records: --checkpoint picks"
                " one merger's; leave it out for the final global model"
            )
        if record not in found:
            raise RunDirError(
                f"{run_dir} has no checkpoint at record {record}; it has"
                f" {', '.join(map(str, found))}"
            )
        saved = checkpoint.read(found[record])
        if saved is None:
            raise RunDirError(
                f"checkpoint {found[record]} is unreadable (its length or checksum is wrong)"
            )
    versions = tuple(int(f["version"]) for f in saved["fragments"])
    return GlobalModel(params_of(saved), int(saved["next_index"]), versions, str(saved["digest"]))


def metadata(run_dir: Path, model: GlobalModel, run: RunTask) -> dict[str, str]:
    """The file's metadata (safetensors takes strings only): enough to build the model again and to
    say where it came from."""
    return {
        "format": FORMAT,
        "run_dir": str(run_dir),
        "checkpoint": str(model.record),
        "digest": model.digest,
        "fragment_versions": json.dumps(list(model.versions)),
        "parameters": str(model.count),
        "task": run.task,
        "task_options": json.dumps(dict(run.options), sort_keys=True),
        "seed": str(run.seed),
    }


def write(params: dict[str, np.ndarray], meta: dict[str, str], out: Path) -> None:
    """`out` as safetensors, written to a temporary file beside it and renamed: never half a file
    under its name."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    out = Path(out)
    if out.is_dir():
        raise ExportError(
            f"--out {out} is a directory; name the file to write (e.g. {out / 'model.safetensors'})"
        )
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: the folder {out.parent} does not exist")
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(
            {
                path: np.ascontiguousarray(value, dtype=np.float32)
                for path, value in sorted(params.items())
            },
            str(temporary),
            metadata=meta,
        )
        umask = os.umask(0)
        os.umask(umask)
        # safetensors creates its file 0600; an exported model is for sharing, like any new file
        os.chmod(temporary, 0o666 & ~umask)
        with open(temporary, "rb") as handle:
            # on disk before the rename, or a crash could leave an empty file under the name
            os.fsync(handle.fileno())
        os.replace(temporary, out)
    except (OSError, SafetensorError) as error:
        raise ExportError(
            f"cannot write {out}: {getattr(error, 'strerror', None) or error}"
        ) from None
    finally:
        temporary.unlink(missing_ok=True)


def export(
    run_dir: Path, out: Path, record: int | None = None, run: RunTask | None = None
) -> tuple[GlobalModel, dict[str, str]]:
    """Write the global model of `run_dir` to `out`; `run`: the run's task when its task.json is
    missing. Returns what was written and its metadata."""
    model = load(run_dir, record)
    run = run if run is not None else RunTask.read(run_dir)
    meta = metadata(Path(run_dir).resolve(), model, run)
    write(model.params, meta, out)
    return model, meta
