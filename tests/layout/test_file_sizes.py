"""No Python file in the repository is over 600 lines (issue 41): a file that size holds more than one
job, and a newcomer reads it back and forth. Source rooms, tests and benchmarks alike; the checker is
tested on a planted file."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 600


def tracked_python_files(root: Path) -> list[Path]:
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return [root / name for name in listed if (root / name).is_file()]


def over_limit(files: list[Path], limit: int = LIMIT) -> dict[str, int]:
    sizes = {str(path): len(path.read_text(encoding="utf-8").splitlines()) for path in files}
    return {name: lines for name, lines in sizes.items() if lines > limit}


def test_no_python_file_is_over_600_lines():
    files = tracked_python_files(ROOT)
    assert len(files) > 100, "git ls-files found too few files: is this a checkout?"
    assert over_limit(files) == {}


def test_the_check_catches_a_file_of_601_lines_and_passes_one_of_600(tmp_path):
    long_file, at_limit = tmp_path / "long.py", tmp_path / "at_limit.py"
    long_file.write_text("x = 1\n" * (LIMIT + 1))
    at_limit.write_text("x = 1\n" * LIMIT)
    assert over_limit([long_file, at_limit]) == {str(long_file): LIMIT + 1}
