"""What `pip install .` puts into site-packages: one import name, `dloco`, and nothing importable
under the folders' own names (`import protocol` fails there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Over 60 lines: one build in its order: a wheel from a copy of the sources, its names, then imports
# from it alone.
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_wheel_installs_one_top_level_name(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    source = tmp_path / "source"
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    for folder in folders:
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        str(tmp_path / "wheel"),
        str(source),
    ]
    built = subprocess.run(command, capture_output=True, text=True, timeout=580)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("dloco-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"dloco"}, sorted(tops)
    # every folder arrived, data files included
    for path in (
        "dloco/protocol/framing.py",
        "dloco/merger/fold/merge.py",
        "dloco/cluster/profiles/default.toml",
        "dloco/cluster/static/status.html",
        "dloco/cli.py",
    ):
        assert path in names, path
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # from a folder that is not the checkout, so only site/ can provide the project's modules
    env = {**os.environ, "PYTHONPATH": str(site)}
    bare = subprocess.run(
        [sys.executable, "-c", "import protocol"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert bare.returncode != 0 and "No module named 'protocol'" in bare.stderr
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import dloco.protocol, dloco.cluster.records as r; print(dloco.protocol.__file__);"
                " from dloco.cluster import status, config; status.page(); config.load()"
            ),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert ok.returncode == 0 and ok.stdout.startswith(str(site)), ok.stderr[-2000:]


def test_a_checkout_loads_each_module_once_under_its_one_name(tmp_path):
    """As a user's process does, from a folder other than the checkout (where a bare `cluster`
    cannot be found by accident): the packages and their data files load, and no module is in
    sys.modules under a folder's bare name as well."""
    code = (
        "import sys, dloco.cli, dloco.cluster.launcher, dloco.suites.experiments, dloco.sim.cli;"
        " from dloco.cluster import config, status; assert b'<html' in status.page().lower();"
        " config.load(); bare = sorted(n for n in sys.modules if n.split('.')[0] in {'protocol',"
        " 'bus', 'cluster', 'analysis', 'sim', 'suites', 'telemetry', 'cliargs', 'benchmarks',"
        " 'island', 'merger', 'broker'}); assert not bare, bare"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
