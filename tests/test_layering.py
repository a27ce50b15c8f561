"""The layout's rules, read from the source: every import of every module (module level and inside
functions alike), parsed with `ast`, nothing imported or run.

- no import cycles between the project's modules, nor between its packages;
- every import of the project says `dloco.…` (one name for each module);
- the process packages import nothing from the launcher (cluster), the analysis, the suites, the CLI
  (commands/, the top package `dloco`) or the benchmarks;
- the launcher and the analysis import neither the suites nor the CLI, the analysis not the
  launcher (it takes plain values), and the suites not the CLI;
- protocol imports no zmq, jax, flax or optax (numpy, msgpack and numba's compiled loops);
- a .py file over 400 lines says why near its top.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder, as pyproject.toml installs them: `dloco.protocol` is protocol/, ...
FOLDERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# the short names below are the folders (`protocol`); "commands" is the CLI, the top package `dloco`
PACKAGES = sorted(FOLDERS.values())
PROCESS_PACKAGES = ("island", "merger", "broker", "bus", "protocol", "telemetry", "cliargs")
# the launcher, the analysis, the suites, the CLI, the benchmarks and the simulator
NOT_FOR_PROCESSES = ("cluster", "analysis", "suites", "commands", "benchmarks", "sim")
# package -> what it may not import
NOT_FOR = {
    "cluster": ("suites", "commands", "sim"),
    "analysis": ("cluster", "suites", "commands", "sim"),
    "suites": ("commands",),
    "sim": ("suites", "commands"),
}
NOT_FOR_PROTOCOL = ("zmq", "jax", "jaxlib", "flax", "optax")
MAX_LINES = 400
LONG_REASON = "# Over 400 lines:"


def module_name(path: Path) -> str:
    """The name a file imports as: protocol/framing.py is dloco.protocol.framing, tests stay
    tests."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    if rest and rest[-1] == "__init__":
        rest = rest[:-1]
    names = {value: key for key, value in FOLDERS.items()}
    return ".".join([names.get(folder, folder), *rest])


def package_of(module: str) -> str | None:
    """The project folder a dotted import name lives in (`dloco.merger.fold.merge` -> "merger",
    `dloco.cli` -> "commands"), or None for anything outside the project."""
    parts = module.split(".")
    if parts[0] != "dloco":
        return None
    if len(parts) > 1 and f"dloco.{parts[1]}" in FOLDERS:
        return FOLDERS[f"dloco.{parts[1]}"]
    return FOLDERS["dloco"]


def source_files() -> list[Path]:
    """Every .py file of the project: its packages and its tests."""
    return sorted(
        path
        for top in (*PACKAGES, "tests")
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def every_python_file() -> list[Path]:
    """Every .py file in the checkout but for environments, build output and runs."""
    skipped = ("build", "dist", "runs", "node_modules", "__pycache__")

    def kept(folder: str) -> bool:
        return not (folder.startswith(".") or folder in skipped or folder.endswith(".egg-info"))

    return sorted(
        path
        for path in ROOT.rglob("*.py")
        if all(kept(folder) for folder in path.relative_to(ROOT).parts[:-1])
    )


def imported_names(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every import in the file: `import a.b` gives ("a.b", ()), `from a import
    b, c` gives ("a", ("b", "c")); relative imports are made absolute."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(
                    package[: len(package) - node.level + 1]
                    + ([node.module] if node.module else [])
                )
                if node.level
                else node.module
            )
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (the most specific module each import names)."""
    files = {module_name(path): path for path in source_files()}
    edges: dict[str, set[str]] = {name: set() for name in files}

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in files:
                return ".".join(parts[:end])
        return None

    for name, path in files.items():
        for module, names in imported_names(path):
            # `from a import b`: a.b if a module, else a
            targets = [resolve(f"{module}.{n}") for n in names] or [resolve(module)]
            edges[name] |= {target for target in targets if target is not None and target != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_project_has_no_import_cycles():
    found = [sorted(c) for c in cycles(graph())]
    assert not found, f"import cycles: {found}"


def test_the_cycle_finder_finds_a_cycle_and_only_that():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [frozenset({"a", "b", "c"})]


def folder_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def imported_packages(path: Path) -> set[str]:
    """The project folders a file imports from (`from dloco import merger` and
    `from dloco.merger.fold.merge import fold` both give "merger")."""
    found = set()
    for module, names in imported_names(path):
        targets = (
            [f"{module}.{name}" for name in names] if module == "dloco" and names else [module]
        )
        found |= {package for target in targets if (package := package_of(target)) is not None}
    return found


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import (tests left out)."""
    packages: dict[str, set[str]] = {}
    for source, targets in edges.items():
        if (package := package_of(source)) is not None:
            outside = {package_of(target) for target in targets} - {package, None}
            packages.setdefault(package, set()).update(outside)
    return packages


def test_no_two_packages_import_each_other_even_through_others():
    found = [sorted(c) for c in cycles(package_graph(graph()))]
    assert not found, f"package cycles: {found}"


def test_the_package_cycle_finder_sees_a_cycle_through_different_modules():
    edges = {
        "dloco.analysis.report": {"dloco.cluster.config"},
        "dloco.cluster.config": set(),
        "dloco.cluster.launcher": {"dloco.analysis.verdict"},
        "dloco.analysis.verdict": set(),
        "tests.test_x": {"dloco.cluster.launcher"},
    }
    assert cycles(edges) == [] and cycles(package_graph(edges)) == [
        frozenset({"analysis", "cluster"})
    ]


def test_every_import_of_the_project_goes_through_its_one_name():
    """`import protocol` would load protocol/ a second time under another name (and fail outside
    a checkout); every file says `dloco.protocol`."""
    bare = set(FOLDERS.values())
    offending = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in source_files()
        for module, _ in imported_names(path)
        if module.split(".")[0] in bare
    ]
    assert not offending, offending


def test_process_packages_import_nothing_from_the_orchestrator_or_the_benchmarks():
    offending = [
        f"{path.relative_to(ROOT)}: {package}"
        for path in source_files()
        if folder_of(path) in PROCESS_PACKAGES
        for package in imported_packages(path)
        if package in NOT_FOR_PROCESSES
    ]
    assert not offending, offending


def test_the_launcher_and_the_analysis_import_neither_the_suites_nor_the_cli_nor_upwards():
    offending = [
        f"{path.relative_to(ROOT)}: {package}"
        for path in source_files()
        if folder_of(path) in NOT_FOR
        for package in imported_packages(path)
        if package in NOT_FOR[folder_of(path)]
    ]
    assert not offending, offending


def test_protocol_imports_no_zmq_or_jax():
    offending = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in source_files()
        if folder_of(path) == "protocol"
        for module, _ in imported_names(path)
        if module.split(".")[0] in NOT_FOR_PROTOCOL
    ]
    assert not offending, offending


def test_a_source_file_over_400_lines_says_why():
    """400 lines is a signal, not a cut: a longer file says why near its top (`# Over 400 lines:`),
    as a long function does above it (tests/test_reading.py)."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in every_python_file()
        if (n := len(lines := path.read_text().splitlines())) > MAX_LINES
        and not any(line.startswith(LONG_REASON) for line in lines[:60])
    }
    assert not long, long


def test_the_rules_see_the_whole_project():
    """Guards the guards: every process package is scanned, and a function-level import counts."""
    assert (
        set(PROCESS_PACKAGES) <= set(PACKAGES)
        and set(NOT_FOR_PROCESSES) <= set(PACKAGES)
        and set(NOT_FOR) <= set(PACKAGES)
    )
    edges = graph()
    # imported inside run_merger, not at module level
    assert "dloco.merger.roles" in edges["dloco.merger.main"]
    assert "dloco.bus.security" in edges["dloco.island.network"]
    assert "dloco.protocol.downlink" in edges["dloco.island.snapshots"]
    assert imported_packages(ROOT / "island" / "network.py") >= {"bus", "protocol"}
