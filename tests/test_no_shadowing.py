"""`python -m dloco` finds the installed package wherever it is started: from the checkout's root
after a non-editable install, and, for the processes the launcher starts, from a directory whose
`dloco/` folder would otherwise shadow it (a container's WORKDIR held the sources once, and every
compose run died at `prepare`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from dloco.cluster.localcompose import dloco_program

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def installed_layout(site: Path) -> None:
    """What a non-editable install puts into site-packages: each folder under its import name
    (`commands/` as `dloco/`, `protocol/` as `dloco/protocol/`, ...), data files included."""
    for name, folder in sorted(FOLDERS.items()):
        shutil.copytree(
            ROOT / folder,
            site.joinpath(*name.split(".")),
            ignore=shutil.ignore_patterns("__pycache__"),
        )


def run_bare(args: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    """This Python without the site module (so no editable install's finder), the installed
    layout and then the environment's dependencies on its path, started in `cwd`."""
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_dloco_from_the_checkout_runs_the_installed_package(tmp_path):
    installed_layout(tmp_path / "site")
    ran = run_bare(["-m", "dloco", "--help"], ROOT, tmp_path / "site")
    assert ran.returncode == 0 and "usage: dloco" in ran.stdout, ran.stderr[-2000:]
    where = run_bare(["-c", "import dloco.cli; print(dloco.cli.__file__)"], ROOT, tmp_path / "site")
    assert where.stdout.startswith(str(tmp_path / "site")), (where.stdout, where.stderr[-2000:])


def test_a_folder_named_dloco_without_init_does_not_shadow(tmp_path):
    installed_layout(tmp_path / "site")
    (tmp_path / "here" / "dloco").mkdir(parents=True)
    ran = run_bare(["-m", "dloco", "--help"], tmp_path / "here", tmp_path / "site")
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_the_launchers_children_start_beside_a_shadowing_package(tmp_path):
    """A directory holding a `dloco/__init__.py` of its own (an old checkout, the image's WORKDIR
    before): plain `-m dloco` picks it up and fails; the launcher's command line does not."""
    installed_layout(tmp_path / "site")
    (tmp_path / "here" / "dloco").mkdir(parents=True)
    (tmp_path / "here" / "dloco" / "__init__.py").write_text("")
    plain = run_bare(["-m", "dloco", "--help"], tmp_path / "here", tmp_path / "site")
    assert plain.returncode != 0 and "dloco" in plain.stderr
    program = dloco_program()
    assert program[0] == sys.executable and program[1:] == ["-P", "-m", "dloco"]
    ran = run_bare([*program[1:], "--help"], tmp_path / "here", tmp_path / "site")
    assert ran.returncode == 0 and "usage: dloco" in ran.stdout, ran.stderr[-2000:]
    # and as the launcher runs it, in this environment
    ran = subprocess.run(
        [*program, "--help"], cwd=tmp_path / "here", capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and "usage: dloco" in ran.stdout, ran.stderr[-2000:]
