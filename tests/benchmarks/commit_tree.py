"""An earlier commit's tree for a benchmark to compare with, in turn on one machine: a temporary git worktree,
and the ``PYTHONPATH`` that puts its rooms (pyproject.toml's ``where`` list) ahead of the editable install.
Imported by the ``*_compare.py`` benchmarks and ``bench_rank_steps.py --against``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rooms(tree: Path = ROOT) -> list[str]:
    """The tree's rooms, as its pyproject.toml lists them (they moved in issue 41: read, not hard-coded)."""
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    found: list[str] = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    return found


def rooms_path(tree: Path, *extra: Path) -> str:
    """``PYTHONPATH`` with ``tree``'s rooms first (then ``extra``)."""
    return os.pathsep.join([*(str(tree / room) for room in rooms(tree)), *map(str, extra)])


@contextlib.contextmanager
def commit_tree(rev: str) -> Iterator[Path]:
    """``rev`` checked out into a temporary worktree, removed at the end."""
    with tempfile.TemporaryDirectory(prefix="runwatch-bench-") as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True
        )
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
