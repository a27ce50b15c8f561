"""The layout's rules, read from the source: every import of every module (module level and inside
functions alike), parsed with `ast`, nothing imported or run.

- no import cycles between the project's modules;
- the process packages import nothing from the launcher (cluster), the analysis, the suites, the CLI
  (dloco) or the benchmarks;
- the launcher and the analysis import neither the suites nor the CLI, and the suites not the CLI;
- protocol imports no zmq, jax, flax or optax (it is pure numpy + msgpack);
- no .py file is over 400 lines.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(name.rstrip("*") for name in tomllib.loads((ROOT / "pyproject.toml").read_text())
                  ["tool"]["setuptools"]["packages"]["find"]["include"])
PROCESS_PACKAGES = ("island", "merger", "broker", "bus", "protocol", "telemetry", "cliargs")
NOT_FOR_PROCESSES = ("cluster", "analysis", "suites", "dloco", "benchmarks", "sim")  # launcher, analysis, suites, CLI, benchmarks, simulator
NOT_FOR = {"cluster": ("suites", "dloco", "sim"), "analysis": ("suites", "dloco", "sim"), "suites": ("dloco",), "sim": ("suites", "dloco")}  # package -> what it may not import
NOT_FOR_PROTOCOL = ("zmq", "jax", "jaxlib", "flax", "optax")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    """Every .py file of the project: its packages and its tests."""
    return sorted(path for top in (*PACKAGES, "tests") for path in (ROOT / top).rglob("*.py") if "__pycache__" not in path.parts)


def every_python_file() -> list[Path]:
    """Every .py file in the checkout but for environments, build output and runs."""
    skipped = ("build", "dist", "runs", "node_modules", "__pycache__")
    def kept(folder: str) -> bool:
        return not (folder.startswith(".") or folder in skipped or folder.endswith(".egg-info"))

    return sorted(path for path in ROOT.rglob("*.py") if all(kept(folder) for folder in path.relative_to(ROOT).parts[:-1]))


def imported_names(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every import in the file: `import a.b` gives ("a.b", ()), `from a import b, c`
    gives ("a", ("b", "c")); relative imports are made absolute."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
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
            targets = [resolve(f"{module}.{n}") for n in names] or [resolve(module)]  # `from a import b`: a.b if a module, else a
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


def test_process_packages_import_nothing_from_the_orchestrator_or_the_benchmarks():
    offending = [f"{path.relative_to(ROOT)}: {module}" for path in source_files() if path.relative_to(ROOT).parts[0] in PROCESS_PACKAGES
                 for module, _ in imported_names(path) if module.split(".")[0] in NOT_FOR_PROCESSES]
    assert not offending, offending


def test_the_launcher_and_the_analysis_import_neither_the_suites_nor_the_cli():
    offending = [f"{path.relative_to(ROOT)}: {module}" for path in source_files() if path.relative_to(ROOT).parts[0] in NOT_FOR
                 for module, _ in imported_names(path) if module.split(".")[0] in NOT_FOR[path.relative_to(ROOT).parts[0]]]
    assert not offending, offending


def test_protocol_imports_no_zmq_or_jax():
    offending = [f"{path.relative_to(ROOT)}: {module}" for path in source_files() if path.relative_to(ROOT).parts[0] == "protocol"
                 for module, _ in imported_names(path) if module.split(".")[0] in NOT_FOR_PROTOCOL]
    assert not offending, offending


def test_no_source_file_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in every_python_file() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_rules_see_the_whole_project():
    """Guards the guards: every process package is scanned, and a function-level import counts."""
    assert set(PROCESS_PACKAGES) <= set(PACKAGES) and set(NOT_FOR_PROCESSES) <= set(PACKAGES) and set(NOT_FOR) <= set(PACKAGES)
    edges = graph()
    assert "merger.service" in edges["merger.main"]  # imported inside run_merger, not at module level
    assert "bus.security" in edges["island.network"] and "protocol.downlink" in edges["island.snapshots"]
