"""The shape of the code: the import contract holds and no import circle exists.

The contract (layers from the Dagster wiring down to the pure core, a pure core free of torch,
Dagster and SQL, no pickle) lives in pyproject.toml ``[tool.importlinter]``; ARCHITECTURE.md
explains it. Imports inside functions count: a lazy import that climbs a layer is still a climb.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _graph():
    grimp = pytest.importorskip("grimp")
    return grimp.build_graph("flexpipe_dag", cache_dir=None)


def test_import_contract_holds():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint_imports is None:
        pytest.skip("import-linter is not installed (pip install -e .[dev])")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([lint_imports, "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, "import contract broken (pyproject.toml [tool.importlinter]):\n" + run.stdout[-6000:]


def strongly_connected(modules: set[str], imports_of) -> list[list[str]]:
    """Import circles: the strongly connected components with more than one module (Tarjan's
    algorithm, iterative). ``imports_of(m)`` gives the modules ``m`` imports directly."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(imports_of(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports_of(child) & modules))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_strongly_connected_finds_a_circle_and_nothing_else():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(set(edges), lambda m: edges[m]) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle between concerns
    modules = {m for m in graph.modules if m.startswith("flexpipe_dag.")}
    packages = {m for m in modules if any(o.startswith(m + ".") for o in modules)}

    def imports_of(module: str) -> set[str]:
        return {m for m in graph.find_modules_directly_imported_by(module) if m not in packages}

    circles = strongly_connected(modules - packages, imports_of)
    assert not circles, "import circles (move the shared piece into a module both can import):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


# -- the picture in ARCHITECTURE.md, drawn from the code ------------------------------------------------

ARCHITECTURE_MD = REPO / "ARCHITECTURE.md"
BEGIN, END = "<!-- import-graph:begin -->", "<!-- import-graph:end -->"


def package_of(module: str) -> str:
    """``flexpipe_dag.runtime.worker`` -> ``runtime``; top-level modules (definitions, plots) are their own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges(graph) -> set[tuple[str, str]]:
    """(importer, imported) between flexpipe_dag's packages, transitively reduced: an edge implied by a
    longer path is left out, so the picture shows the layers rather than every shortcut."""
    edges = set()
    for module in graph.modules:
        if not module.startswith("flexpipe_dag."):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = package_of(module), package_of(imported)
            if imported.startswith("flexpipe_dag.") and a != b:
                edges.add((a, b))

    def reachable(node: str) -> set[str]:
        seen: set[str] = set()
        todo = [node]
        while todo:
            current = todo.pop()
            for a, b in edges:
                if a == current and b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    return {(a, b) for a, b in edges if not any(c != b and b in reachable(c) for x, c in edges if x == a)}


def mermaid(edges: set[tuple[str, str]]) -> str:
    """A mermaid flowchart, top (wiring) to bottom (pure core): an arrow means "imports"."""
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines)


def test_architecture_picture_is_drawn_from_the_code():
    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    current = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert current == mermaid(package_edges(_graph())), (
        "ARCHITECTURE.md's import graph is out of date: run `python tests/test_architecture.py --write`")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import grimp

    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    picture = mermaid(package_edges(grimp.build_graph("flexpipe_dag", cache_dir=None)))
    ARCHITECTURE_MD.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + picture + "\n" + text[text.index(END):],
                               encoding="utf-8")
    print(picture)
