"""The merger's packages, read from the source (merger/__init__.py says what each owns): each
imports only the packages below it and the merger's configuration modules, never the process shell
(merger/*.py) nor a package above it; every package folder is installed (pyproject.toml lists it)
and says what it owns; no package of the merger grows past about 2,000 lines unnoticed."""

from __future__ import annotations

import ast
import tomllib

from tests.test_layering import ROOT, graph

# lowest first; packages in one tuple are siblings and import neither each other
LAYERS = (("engines",), ("fold",), ("log",), ("state",), ("replication", "network"))
# the shell's modules every package may import: settings only
CONFIGURATION = {"config", "settings"}
MAX_PACKAGE_LINES = 2000


def layer_of(package: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if package in layer)


def merger_part(module: str) -> str | None:
    """`dloco.merger.fold.merge` -> "fold"; a shell module `dloco.merger.service` -> "service";
    anything outside the merger -> None."""
    parts = module.split(".")
    if parts[:2] != ["dloco", "merger"] or len(parts) < 3:
        return None
    return parts[2]


def offending_imports(edges: dict[str, set[str]]) -> list[str]:
    packages = {name for layer in LAYERS for name in layer}
    found = []
    for source, targets in edges.items():
        part = merger_part(source)
        if part not in packages:
            continue
        for target in targets:
            other = merger_part(target)
            if other is None or other == part or other in CONFIGURATION:
                continue
            if other not in packages or layer_of(other) >= layer_of(part):
                found.append(f"{source} -> {target}")
    return sorted(found)


def test_each_merger_package_imports_only_the_ones_below_it():
    assert offending_imports(graph()) == []


def test_the_rule_sees_an_upward_a_sideways_and_a_shell_import():
    edges = {
        "dloco.merger.fold.merge": {"dloco.merger.engines.coded", "dloco.merger.config"},
        "dloco.merger.log.wal": {"dloco.merger.state.core"},
        "dloco.merger.network.receiving": {"dloco.merger.replication.wire"},
        "dloco.merger.state.core": {"dloco.merger.service", "dloco.protocol.framing"},
        "dloco.merger.service": {"dloco.merger.network.receiving"},
    }
    assert offending_imports(edges) == [
        "dloco.merger.log.wal -> dloco.merger.state.core",
        "dloco.merger.network.receiving -> dloco.merger.replication.wire",
        "dloco.merger.state.core -> dloco.merger.service",
    ]


def test_every_merger_package_is_installed_documented_and_of_a_readable_size():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = sorted(path.parent for path in (ROOT / "merger").glob("*/__init__.py"))
    assert {folder.name for folder in folders} == {name for layer in LAYERS for name in layer}
    for folder in folders:
        assert f"dloco.merger.{folder.name}" in listed, folder
        assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), folder
        lines = sum(len(path.read_text().splitlines()) for path in folder.glob("*.py"))
        assert lines <= MAX_PACKAGE_LINES, (folder.name, lines)
