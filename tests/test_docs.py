"""The configuration tables in the README and docs/configuration.md are what the declared fields
generate (scripts/config_docs.py): a field added, renamed or re-described in the code without
`make docs` fails here."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_configuration_tables_match_the_declarations(monkeypatch):
    """What ``make docs`` (scripts/config_docs.py) would write, generated in this process."""
    import difflib
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # config_docs imports project_env beside it
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    readme = ROOT / "README.md"
    for path, text in {ROOT / "docs" / "configuration.md": docs.configuration_md(),
                       readme: docs._readme(readme.read_text())}.items():
        old = path.read_text()
        assert old == text, "run `make docs`:\n" + "".join(
            difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(path), "generated"))[-3000:]


def test_every_trainer_field_is_documented():
    from training.config.train_config import TrainConfig
    from training.config.fields import specs

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"| `{name}` |" in doc for name in specs(TrainConfig))


def test_every_live_metric_is_in_the_operations_table():
    from training.metrics.live import METRICS

    doc = (ROOT / "docs" / "operations.md").read_text()
    assert [name for name in METRICS if f"| `{name}` | {METRICS[name]} |" not in doc] == []


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:training|plugins|dags|scripts|benchmarks|tests|examples|docker|deploy)/[\w/.-]*\w)")
DOTTED = re.compile(r"(?<![\w./-])(training(?:\.\w+)+)")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_path_and_module_the_docs_name_exists():
    """A newcomer follows the README and docs/ to the code in one hop: every repository path and
    every ``training.<part>.<module>.<name>`` they name is there (a rename updates the docs)."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in set(PATH.findall(text)):
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
        for dotted in set(DOTTED.findall(text)):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):  # the longest prefix that is a module or package
                base = ROOT.joinpath(*parts[:i])
                module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                if module.is_file():
                    rest = parts[i:]
                    if rest and rest[0] not in _defined(module):
                        missing.append(f"{doc.relative_to(ROOT)}: {dotted} ({rest[0]} is not in {module.relative_to(ROOT)})")
                    break
            else:
                missing.append(f"{doc.relative_to(ROOT)}: {dotted}")
    assert not missing, "\n".join(sorted(missing))
