"""The README's training loop is the loop of examples/quickstart.py, word for word (issue 26): the file
runs (tests/local/test_up.py), so the README's loop runs as written."""

from __future__ import annotations

import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_loop() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it in a training loop") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def example_loop() -> str:
    lines = (ROOT / "examples" / "quickstart.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "# The bootstrap comes from" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith('    print(f"run {args.run_id} ended'))
    return textwrap.dedent("\n".join(lines[start:end])) + "\n"


def test_the_readme_loop_is_the_example_files():
    assert readme_loop() == example_loop()
    assert "with RunWatch(" in readme_loop() and "listener.poll(step)" in readme_loop()
