""" "No function above cyclomatic complexity 20" is a rule `make test` enforces (issue 41): ruff's C901 at 20,
selected in pyproject.toml with no per-file exception, and it fails on a planted function of 21."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_rule_is_selected_at_20_with_no_exception():
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C90" in lint["select"] or "C901" in lint["select"]
    assert lint["mccabe"]["max-complexity"] == 20
    ignored = [rule for rules in lint.get("per-file-ignores", {}).values() for rule in rules]
    assert not [r for r in ignored + lint.get("ignore", []) if r.startswith("C90")]


def branches(n: int) -> str:
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n))
    return f'"""Planted."""\n\n\ndef planted(x: int) -> int:\n{body}    return -1\n'


def ruff(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_planted_function_above_20_fails_and_one_at_20_passes(tmp_path):
    too_complex, at_limit = tmp_path / "too_complex.py", tmp_path / "at_limit.py"
    too_complex.write_text(branches(20))  # complexity 21: one path plus 20 branches
    at_limit.write_text(branches(19))
    failed = ruff(too_complex)
    assert failed.returncode == 1 and "C901" in failed.stdout and "(21 > 20)" in failed.stdout, failed.stdout
    assert ruff(at_limit).returncode == 0
