"""The rooms' "may import" column of docs/architecture.md, executed (issue 41): every ``runwatch.<room>``
import in a room's source files (lazy ones inside functions and ``TYPE_CHECKING`` blocks included) must
be one the table allows that room. Pure: the table and the files are read, nothing is imported."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<room>[a-z]+)/` \| `runwatch\.[a-z]+` \|[^|]*\| (?P<allowed>[^|]*) \|", re.M)


def allowed_imports(table: str) -> dict[str, set[str]]:
    """room -> the rooms it may import, from the table's rows (``every room`` and ``—`` as written)."""
    rows = {m["room"]: m["allowed"].strip() for m in ROW.finditer(table)}
    assert rows, "docs/architecture.md has no room table"
    return {
        room: set(rows) - {room}
        if allowed.startswith("every room")
        else set()
        if allowed in ("—", "-", "")
        else set(re.findall(r"`([a-z]+)`", allowed))
        for room, allowed in rows.items()
    }


def runwatch_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, room) for every absolute import of ``runwatch.<room>`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "runwatch":  # ``from runwatch import sinks``
                names = [f"runwatch.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "runwatch" and len(parts) > 1:
                yield node.lineno, parts[1]


def forbidden_imports(root: Path, allowed: dict[str, set[str]]) -> list[str]:
    """``path:line: room imports runwatch.other`` for every import the table does not allow."""
    found = []
    for room, may in sorted(allowed.items()):
        source_root = root / room / "runwatch" / room
        for path in sorted(source_root.rglob("*.py")):
            for line, other in runwatch_imports(path.read_text()):
                if other != room and other not in may:
                    found.append(f"{path.relative_to(root)}:{line}: {room} imports runwatch.{other}")
    return found


def test_every_room_imports_only_what_the_table_allows():
    allowed = allowed_imports(TABLE.read_text())
    # every source room is in the table (a new room without a row would be allowed nothing, silently)
    rooms = {
        p.parent.parent.name
        for p in ROOT.glob("*/runwatch/*/__init__.py")
        if p.parent.name == p.parent.parent.name
    }
    assert rooms <= set(allowed), (
        f"rooms without a row in docs/architecture.md: {sorted(rooms - set(allowed))}"
    )
    assert forbidden_imports(ROOT, allowed) == []


def test_the_contract_and_the_detectors_may_import_no_training_side():
    allowed = allowed_imports(TABLE.read_text())
    assert allowed["contract"] == set()
    assert "producer" not in allowed["detectors"] | allowed["sinks"] | allowed["worker"]


@pytest.mark.parametrize(
    "planted",
    [
        "from runwatch.producer.publish.run_watch import RunWatch\n",
        "import runwatch.worker.app\n",
        "def later():\n    from runwatch.producer import RunWatch\n",  # a lazy import counts too
        "from runwatch import sinks\n",
    ],
)
def test_a_planted_forbidden_import_is_caught(tmp_path, planted):
    # (the test of the test: a contract module importing the producer, the worker or a sink fails it)
    room = tmp_path / "contract" / "runwatch" / "contract"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text('"""A contract."""\n')
    (room / "planted.py").write_text('"""Planted."""\n\n' + planted)
    found = forbidden_imports(tmp_path, {"contract": set()})
    assert len(found) == 1 and found[0].startswith("contract/runwatch/contract/planted.py:")


def test_an_allowed_import_is_not_caught(tmp_path):
    room = tmp_path / "sinks" / "runwatch" / "sinks"
    room.mkdir(parents=True)
    (room / "ok.py").write_text(
        "from runwatch.contract.schema import Anomaly\nfrom runwatch.sinks import rows\n"
    )
    assert forbidden_imports(tmp_path, {"sinks": {"contract"}}) == []


def test_every_test_file_sits_under_the_room_it_tests():
    # (tests/<room>/ for a source room, or docs/, layout/, deploy/ for the docs, the house and the deployment)
    rooms = set(allowed_imports(TABLE.read_text())) | {"docs", "layout", "deploy", "benchmarks"}
    tests = ROOT / "tests"
    misplaced = [
        str(path.relative_to(tests))
        for path in sorted(tests.rglob("test_*.py"))
        if path.relative_to(tests).parts[0] not in rooms
    ]
    assert misplaced == []
