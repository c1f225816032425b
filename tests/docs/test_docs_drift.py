"""Docs that cannot drift (issue 25): the facts that pages repeat are checked against the code they
describe. The command tables (README's and docs/operations.md's) list every command the CLI has and no
other, with options the command takes; the detector count and names match the registry; every extra a
page names is one pyproject declares, and docs/install.md's table lists them all. Each check is also
run on a deliberately stale copy, which it must refuse."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import click
import pytest

from runwatch.cli.main import main as cli
from runwatch.detectors import registry
from runwatch.detectors.config import RunwatchConfig  # noqa: F401 - registers the built-in detectors

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_TABLES = (ROOT / "README.md", ROOT / "docs" / "operations.md")


def commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every leaf command by its path (``("baseline", "check")``)."""
    found: dict[tuple[str, ...], click.Command] = {}
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if isinstance(command, click.Group):
            found.update(commands(command, (*prefix, name)))
        else:
            found[(*prefix, name)] = command
    return found


def table_rows(text: str) -> list[str]:
    """The first cells of the rows of the page's command table (the one headed ``| command | what it does
    |``; other tables, such as operations.md's expected failures, name commands for other reasons)."""
    start = text.find("| command | what it does |")
    table = text[start:].split("\n\n", 1)[0] if start >= 0 else text
    return [m.group(1) for m in re.finditer(r"^\| `(runwatch [^`]*)` \|", table, flags=re.M)]


def command_problems(text: str) -> list[str]:
    """What a page's command table gets wrong: commands missing or unknown, options a command lacks."""
    known = commands()
    listed: set[tuple[str, ...]] = set()
    problems = []
    for cell in table_rows(text):
        words = cell.split()[1:]
        path: tuple[str, ...] = ()
        while words and any(p[: len(path) + 1] == (*path, words[0]) for p in known):
            path, words = (*path, words[0]), words[1:]
        if path not in known:
            problems.append(f"unknown command: {cell}")
            continue
        listed.add(path)
        options = {o for p in known[path].params for o in (*p.opts, *p.secondary_opts)}
        problems += [
            f"{' '.join(path)}: no option {o}"
            for o in re.findall(r"--[a-z][a-z0-9-]*", cell)
            if o not in options
        ]
    problems += [f"not listed: runwatch {' '.join(p)}" for p in sorted(set(known) - listed)]
    return problems


@pytest.mark.parametrize("page", COMMAND_TABLES, ids=lambda p: p.name)
def test_a_command_table_lists_every_command_with_options_it_has(page):
    assert command_problems(page.read_text()) == []


def test_a_stale_command_table_is_refused():
    text = (ROOT / "docs" / "operations.md").read_text()
    first = table_rows(text)[0]
    dropped = text.replace(f"| `{first}` |", "| dropped |", 1)
    assert any(p.startswith("not listed: ") for p in command_problems(dropped))
    invented = text.replace(f"| `{first}` |", f"| `runwatch teleport --now` | invented |\n| `{first}` |", 1)
    assert "unknown command: runwatch teleport --now" in command_problems(invented)
    wrong_option = text.replace("| `runwatch migrate [--dsn D]", "| `runwatch migrate [--dsm D]", 1)
    assert "migrate: no option --dsm" in command_problems(wrong_option)


# -- detectors ---------------------------------------------------------------------------------------

NUMBER_WORDS = {
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
    "twenty": 20,
}
COUNT = re.compile(r"\b(" + "|".join(NUMBER_WORDS) + r"|\d+) (?:online |built-in )?detectors\b", re.I)


def count_problems(text: str, name: str) -> list[str]:
    registered = len(registry.specs())
    said = [
        (m.group(0), NUMBER_WORDS.get(m.group(1).lower()) or int(m.group(1))) for m in COUNT.finditer(text)
    ]
    return [
        f"{name}: says {phrase!r}, the registry has {registered}" for phrase, n in said if n != registered
    ]


def test_no_page_miscounts_the_detectors():
    assert [p for page in PAGES for p in count_problems(page.read_text(), page.name)] == []


def test_a_stale_detector_count_is_refused():
    assert count_problems("runs thirteen online detectors", "x") != []
    assert count_problems(f"runs {len(registry.specs())} detectors", "x") == []


def view_problems(text: str) -> list[str]:
    """Where docs/detectors.md's table of views disagrees with what the detectors declare."""
    rows = dict(re.findall(r"^\| `(joined|rank|cross_rank)`[^|]*\| ([^|]+) \|$", text, flags=re.M))
    problems = [
        f"no row for the {view} view" for view in ("joined", "rank", "cross_rank") if view not in rows
    ]
    for view, cell in rows.items():
        named, declared = set(re.findall(r"`([a-z_]+)`", cell)), set(registry.names(view))
        problems += [f"{view}: {sorted(named ^ declared)} differ"] if named != declared else []
    return problems


def test_detectors_md_describes_every_detector_in_its_view():
    text = (ROOT / "docs" / "detectors.md").read_text()
    assert [s.name for s in registry.specs() if f"`{s.name}`" not in text] == []
    assert view_problems(text) == []


def test_a_stale_view_table_is_refused():
    text = (ROOT / "docs" / "detectors.md").read_text()
    assert view_problems(text.replace(", `baseline_trajectory` |", " |", 1)) == [
        "joined: ['baseline_trajectory'] differ"
    ]


# -- extras ------------------------------------------------------------------------------------------

EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
EXTRA_MENTION = re.compile(r"runwatch\[([a-z0-9_,-]+)\]|\.\[([a-z0-9_,-]+)\]")


def extra_problems(text: str, name: str) -> list[str]:
    named = {
        e for m in EXTRA_MENTION.finditer(text) for group in m.groups() if group for e in group.split(",")
    }
    return [f"{name}: no extra {e!r}" for e in sorted(named - EXTRAS)]


def test_every_extra_a_page_names_exists():
    pages = [*PAGES, ROOT / "Makefile", ROOT / "Dockerfile", *sorted((ROOT / "deploy").rglob("*.md"))]
    assert [p for page in pages for p in extra_problems(page.read_text(), page.name)] == []


def test_install_md_lists_every_extra():
    text = (ROOT / "docs" / "install.md").read_text()
    first_cells = re.findall(r"^\| ((?:`[a-z0-9_-]+`(?:, )?)+) \|", text, flags=re.M)
    rows = {name for cell in first_cells for name in re.findall(r"`([a-z0-9_-]+)`", cell)}
    assert rows == EXTRAS, rows ^ EXTRAS


def test_a_stale_extra_name_is_refused():
    assert extra_problems("pip install 'runwatch[workers]'", "x") == ["x: no extra 'workers'"]


# -- benchmark figures: measured once, in docs/benchmarks.md ------------------------------------------
# A measured figure (a cost in µs, a latency percentile, a throughput in step events/s) quoted on another
# page must be one that benchmarks.md states, in the same words: a re-measurement updates that page, and
# this test then names every stale copy.
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,.]*\d\s?µs|(?<![\w.])\d\s?µs|p(?:50|90|99) \d[\d.]*\s?ms|\d[\d,]*\s?step events/s"
)


def figure_problems(text: str, name: str, measured: str) -> list[str]:
    return [
        f"{name}: {m.group(0)!r} is not a figure docs/benchmarks.md states"
        for m in FIGURE.finditer(text)
        if m.group(0) not in measured
    ]


def test_every_figure_quoted_elsewhere_is_one_benchmarks_md_states():
    measured = (ROOT / "docs" / "benchmarks.md").read_text()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [
        p
        for page in pages
        if page.name != "benchmarks.md"
        for p in figure_problems(page.read_text(), page.name, measured)
    ]
    assert problems == []


def test_a_stale_figure_is_refused():
    measured = "| publish call | 8 µs median | p50 36.4 ms | 2,489 step events/s |"
    assert figure_problems("about 8 µs, p50 36.4 ms, 2,489 step events/s", "x", measured) == []
    assert figure_problems("costs 13 µs and p99 49.9 ms", "x", measured) == [
        "x: '13 µs' is not a figure docs/benchmarks.md states",
        "x: 'p99 49.9 ms' is not a figure docs/benchmarks.md states",
    ]
