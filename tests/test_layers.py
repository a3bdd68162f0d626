"""The package structure: no import cycle anywhere (module-level or inside functions), the
training library never imports Airflow, and the Airflow side is layered (``context`` is the
bottom: it imports nothing of the package but ``settings``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"training": ROOT / "training", "training_airflow": ROOT / "plugins" / "training_airflow"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports anywhere in it (``from a import b`` counts a.b if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle of ours to report.
    return {m: {d for d in deps if not (m.startswith(d + ".") and d.count(".") < m.count("."))} for m, deps in graph.items()}


def test_no_import_cycles():
    graph, state, stack = _graph(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_training_never_imports_airflow():
    for path in PACKAGES["training"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] in ("airflow", "training_airflow") for m in mods), path


def test_context_is_the_bottom_of_the_airflow_side():
    graph = _graph()
    ours = {d for d in graph["training_airflow.context"] if d.startswith("training_airflow")}
    assert ours <= {"training_airflow", "training_airflow.settings"}, ours
    assert not {d for d in graph["training_airflow.settings"] if d.startswith("training_airflow.")}
