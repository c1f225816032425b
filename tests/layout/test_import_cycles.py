"""No two files of the house import each other, directly or round a loop (issue 41, item 7): a circle is
broken at its seam, a protocol or a leaf module. Imports at module level and under ``TYPE_CHECKING``
count, and so do lazy ones inside functions; a package's ``__init__`` (a face that hands names on) is left
out, as `farm-studio look` leaves it. Pure: the files are read, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    """``runwatch.room.module`` -> its file, for every source room (package faces left out)."""
    found = {}
    for path in root.glob("*/runwatch/*/**/*.py"):
        parts = path.relative_to(root).with_suffix("").parts[1:]
        if parts[-1] != "__init__":
            found[".".join(parts)] = path
    return found


def imported(source: str, known: set[str]) -> set[str]:
    """The known modules ``source`` imports: ``import a.b``, ``from a.b import c`` (c a module or a name)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names} & known
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            out |= ({node.module} | submodules) & known
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    files = modules(root)
    return {name: imported(path.read_text(), set(files)) - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_source_files_import_each_other_round_a_loop():
    graph = import_graph(ROOT)
    assert len(graph) > 100
    assert circles(graph) == []


def test_the_check_finds_a_planted_circle_and_a_leaf_breaks_it(tmp_path):
    package = tmp_path / "planted" / "runwatch" / "planted"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pipeline.py").write_text("from runwatch.planted.guard import Guard\n")
    (package / "guard.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runwatch.planted import pipeline\n"
    )
    graph = import_graph(tmp_path)
    assert circles(graph) == [["runwatch.planted.guard", "runwatch.planted.pipeline"]]
    (package / "guard.py").write_text("from runwatch.planted.queues import Inflight\n")
    (package / "queues.py").write_text("Inflight = tuple\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == []
