"""The package structure as a test: the parts of ``training/`` and their layers, no import cycle
between modules (module-level or inside functions) nor between parts, the training library never
imports Airflow, and the Airflow side is layered. Also the house rules a newcomer relies on: few
modules flat in ``training/``, none over 450 lines without saying why, short module docstrings."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"training": ROOT / "training", "training_airflow": ROOT / "plugins" / "training_airflow"}

# The parts of the training library, bottom first: a part imports only parts below it. The entry
# points at the top (the trainer, evaluation, the CLI) may import anything.
LAYERS = [
    ("training.util", "training.log"),
    ("training.config",),
    ("training.store", "training.tracking"),
    ("training.data",),
    ("training.models",),
    ("training.distributed",),
    ("training.checkpoint",),
    ("training.metrics",),
    ("training.results",),
    ("training.evaluate",),
    ("training.sweep",),
    ("training.train",),
    ("training.cli", "training.__main__"),
]
# The Airflow side, bottom first: every module imports only modules of its own layer's left or
# below (a module of a layer may import the ones listed before it in the same layer).
AIRFLOW_LAYERS = [
    ("training_airflow.settings", "training_airflow.wiring", "training_airflow.policy"),
    ("training_airflow.handoff", "training_airflow.failures", "training_airflow.connections", "training_airflow.run_config",
     "training_airflow.mlflow_run"),
    ("training_airflow.assets", "training_airflow.links", "training_airflow.lifecycle", "training_airflow.inprocess_logs",
     "training_airflow.sweep_check"),
    ("training_airflow.backends",),
    ("training_airflow.params", "training_airflow.conf_check"),
    ("training_airflow.tasks", "training_airflow.dataset_tasks", "training_airflow.bench_tasks",
     "training_airflow.sweep_tasks"),
]


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
    return {m: {d for d in deps if not (d.startswith(m + ".") and modules[m].name == "__init__.py")}
            for m, deps in graph.items()}


def _part(module: str) -> str:
    """The part a module belongs to: ``training.data.sources`` -> ``training.data``."""
    for layer in LAYERS + AIRFLOW_LAYERS:
        for part in layer:
            if module == part or module.startswith(part + "."):
                return part
    return module


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles_between_modules():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_between_parts():
    parts: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        parts.setdefault(_part(m), set()).update(_part(d) for d in deps if _part(d) != _part(m))
    cycle = _find_cycle(parts)
    assert cycle is None, "parts import each other: " + " -> ".join(cycle)


def _check_layers(layers: list[tuple[str, ...]], prefix: str) -> None:
    rank = {part: (i, j) for i, layer in enumerate(layers) for j, part in enumerate(layer)}
    wrong = []
    for m, deps in _graph().items():
        if not m.startswith(prefix) or m == prefix.rstrip("."):
            continue
        mine = _part(m)
        assert mine in rank, f"{m} belongs to no part of the layers in tests/test_layers.py: add it there"
        for d in deps:
            theirs = _part(d)
            if theirs == mine or not d.startswith(prefix):
                continue
            assert theirs in rank, f"{d} belongs to no part of the layers in tests/test_layers.py: add it there"
            if rank[theirs] > rank[mine]:
                wrong.append(f"{m} imports {d}, a part above it ({theirs} is above {mine})")
    assert not wrong, "\n".join(wrong)


def test_each_part_of_the_library_imports_only_parts_below_it():
    _check_layers(LAYERS, "training.")


def test_the_airflow_side_is_layered():
    _check_layers(AIRFLOW_LAYERS, "training_airflow.")


def test_reading_data_never_depends_on_checkpoints():
    graph = _graph()
    for m, deps in graph.items():
        if m.startswith("training.data"):
            assert not {d for d in deps if d.startswith("training.checkpoint")}, m


def test_training_never_imports_airflow():
    for path in PACKAGES["training"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] in ("airflow", "training_airflow") for m in mods), path


def test_few_modules_stand_flat_in_training():
    flat = sorted(p.name for p in PACKAGES["training"].glob("*.py"))
    assert len(flat) <= 8, f"{len(flat)} modules flat in training/ ({', '.join(flat)}): put them in a part"


def _library_files() -> list[Path]:
    return sorted(p for folder in (*PACKAGES.values(), ROOT / "dags") for p in folder.rglob("*.py"))


def test_a_long_module_says_why_it_is_one_module():
    for path in _library_files():
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert lines <= 450 or "one module" in doc.lower(), (
            f"{path.relative_to(ROOT)} has {lines} lines: split it, or say at its top why it is one module")


def test_module_docstrings_are_short():
    lengths = []
    for path in _library_files():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            lengths.append(len(doc.splitlines()))
    assert statistics.median(lengths) <= 12, statistics.median(lengths)
