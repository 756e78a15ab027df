"""The house rules of the package, read from its source: no import cycles, lower layers never
import upper ones, nothing imports the CLI, and no module grows past ~300 lines unasked.

Every ``import`` counts, also those inside functions (done to keep start-up light): a lazy
import is still a dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "daemon" / "inboxd"
# Lower number = lower layer. A module may import its own layer and the ones below it.
LAYERS = {
    "inboxd": 0,  # config, item, logs, stats: what every layer shares
    "inboxd.files": 1,
    "inboxd.decode": 1,
    "inboxd.models": 2,
    "inboxd.pipeline": 3,
    "inboxd.service": 4,
    "inboxd.cli": 5,
    "inboxd.__main__": 6,
}
MAX_LINES = 300
LONG_REASON = "Longer than 300 lines because"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module under ``root`` (a package folder)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's own modules that ``path`` imports (``from pkg import mod`` included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(names & known)
            if names - known:  # a name defined in the module itself, not a submodule
                found.add(node.module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    # A package's __init__ being imported on the way to a sibling is not a dependency.
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def layer_of(module: str) -> int:
    best = max((prefix for prefix in LAYERS
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return LAYERS[best]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                  if layer_of(d) > layer_of(m))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 30, "the check must see the whole package"
    assert cycles(graph) == []


def test_lower_layers_never_import_upper_ones() -> None:
    assert upward_imports(import_graph(PACKAGE)) == []


def test_nothing_but_the_entry_point_imports_the_cli() -> None:
    graph = import_graph(PACKAGE)
    assert sorted(m for m, deps in graph.items() if "inboxd.cli" in deps) == ["inboxd.__main__"]


def test_modules_stay_small_or_say_why() -> None:
    too_long = []
    for name, path in modules(PACKAGE).items():
        lines = path.read_text().count("\n")
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and LONG_REASON not in docstring:
            too_long.append(f"{name}: {lines} lines")
    assert too_long == [], f"split these, or say in the docstring: {LONG_REASON} …"


@pytest.fixture
def broken_package(tmp_path: Path) -> Path:
    """A tiny package that breaks each rule once: files ↔ models cycle, files → pipeline."""
    root = tmp_path / "inboxd"
    for folder in ("files", "models", "pipeline"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "files" / "claims.py").write_text("from inboxd.models import model\n")
    (root / "models" / "model.py").write_text(
        "def load():\n    from inboxd.files.claims import x\n")
    (root / "pipeline" / "stage.py").write_text("")
    (root / "files" / "moves.py").write_text("import inboxd.pipeline.stage\n")
    return root


def test_the_checks_catch_a_planted_cycle_and_an_upward_import(broken_package: Path) -> None:
    graph = import_graph(broken_package)
    assert cycles(graph) == [["inboxd.files.claims", "inboxd.models.model"]]
    assert upward_imports(graph) == ["inboxd.files.claims imports inboxd.models.model",
                                     "inboxd.files.moves imports inboxd.pipeline.stage"]
