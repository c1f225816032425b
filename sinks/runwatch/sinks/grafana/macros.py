"""Expand a panel's SQL the way Grafana and the ClickHouse plugin do before ClickHouse sees it.

Two passes, in Grafana's order:

1. Template variables (Grafana's template service, in the browser): ``${name:sqlstring}`` quotes
   each value with ``'`` (doubling any ``'`` inside) and joins several with commas;
   ``${name}`` / ``$name`` use the plugin's own formatter (``CHDatasource.format``): a multi-value
   becomes ``'a','b'``, a single value goes in as it is.
2. The plugin's macros (its Go backend, ``pkg/macros/macros.go`` of grafana/clickhouse-datasource
   4.x): ``$__timeFilter(col)`` becomes ``col >= toDateTime(FROM) AND col <= toDateTime(TO)``
   (whole seconds), ``$__timeInterval(col)`` ``toStartOfInterval(toDateTime(col), INTERVAL N
   second)`` and so on, with the same text as the plugin writes.

Used by the SQL-on-real-data test and by anything that runs a panel's SQL without a Grafana (the
HTML report). A ``$__`` macro this module does not know is an error, so a panel cannot use one
that was never checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

VariableValue = str | Sequence[str]


class MacroError(ValueError):
    """A macro or variable the expansion cannot fill in (unknown name, wrong arguments)."""


@dataclass(frozen=True)
class QueryContext:
    """What Grafana sends with a query: the dashboard's time range and the panel's interval."""

    time_from: datetime
    time_to: datetime
    interval_s: float = 60.0

    @property
    def interval_ms(self) -> int:
        return int(self.interval_s * 1000)


def sqlstring(value: VariableValue) -> str:
    """Grafana's ``sqlstring`` format: each value quoted with ``'`` (``'`` doubled), comma-joined."""
    values = [value] if isinstance(value, str) else list(value)
    return ",".join("'" + v.replace("'", "''") + "'" for v in values)


def plugin_format(value: VariableValue) -> str:
    """The ClickHouse plugin's formatter for a variable written without a format."""
    if isinstance(value, str):
        return value
    return "'" + "','".join(value) + "'"


_FORMATS: dict[str, Callable[[VariableValue], str]] = {
    "sqlstring": sqlstring,
    "raw": lambda v: v if isinstance(v, str) else ",".join(v),
}
_VARIABLE = re.compile(r"\$\{(?P<braced>[A-Za-z_]\w*)(?::(?P<format>\w+))?\}|\$(?P<bare>(?!__)[A-Za-z_]\w*)")


def expand_variables(sql: str, variables: Mapping[str, VariableValue]) -> str:
    """Pass 1: the dashboard variables (``${name:fmt}``, ``${name}``, ``$name``)."""

    def fill(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        if name not in variables:
            raise MacroError(f"variable ${name} has no value")
        fmt = match.group("format")
        if fmt is None:
            return plugin_format(variables[name])
        if fmt not in _FORMATS:
            raise MacroError(f"variable format {fmt!r} of ${name} is not supported here")
        return _FORMATS[fmt](variables[name])

    return _VARIABLE.sub(fill, sql)


def _seconds(t: datetime) -> int:
    return int(t.astimezone(UTC).timestamp())


def _millis(t: datetime) -> int:
    return int(round(t.astimezone(UTC).timestamp() * 1000))


def _one(name: str, args: list[str]) -> str:
    if len(args) != 1:
        raise MacroError(f"$__{name} expected 1 argument(s), received {len(args)}")
    return args[0]


def _macro(name: str, args: list[str] | None, ctx: QueryContext) -> str:
    """One macro's text, as pkg/macros/macros.go writes it."""
    frm, to = ctx.time_from, ctx.time_to
    interval = max(ctx.interval_s, 1)
    a = args or []
    if name == "timeFilter":
        col = _one(name, a)
        return f"{col} >= toDateTime({_seconds(frm)}) AND {col} <= toDateTime({_seconds(to)})"
    if name == "timeFilter_ms":
        col = _one(name, a)
        return (
            f"{col} >= fromUnixTimestamp64Milli({_millis(frm)}) AND "
            f"{col} <= fromUnixTimestamp64Milli({_millis(to)})"
        )
    if name == "timeInterval":
        return f"toStartOfInterval(toDateTime({_one(name, a)}), INTERVAL {int(interval)} second)"
    if name == "timeInterval_ms":
        return (
            f"toStartOfInterval(toDateTime64({_one(name, a)}, 3), "
            f"INTERVAL {int(max(ctx.interval_ms, 1))} millisecond)"
        )
    if name == "fromTime":
        return f"toDateTime({_seconds(frm)})"
    if name == "toTime":
        return f"toDateTime({_seconds(to)})"
    if name == "fromTime_ms":
        return f"fromUnixTimestamp64Milli({_millis(frm)})"
    if name == "toTime_ms":
        return f"fromUnixTimestamp64Milli({_millis(to)})"
    if name == "interval_s":
        return str(int(interval))
    if name == "timeFrom":
        return f"{_one(name, a)} >= toDateTime({_seconds(frm)})"
    if name == "timeTo":
        return f"{_one(name, a)} <= toDateTime({_seconds(to)})"
    if name == "dateFilter":
        col = _one(name, a)
        return (
            f"{col} >= toDate('{frm.astimezone(UTC):%Y-%m-%d}') AND "
            f"{col} <= toDate('{to.astimezone(UTC):%Y-%m-%d}')"
        )
    raise MacroError(f"macro $__{name} is not one this expansion knows")


_MACRO = re.compile(r"\$__(\w+)")


def _arguments(sql: str, start: int) -> tuple[list[str], int]:
    """The comma-separated arguments of a macro call whose '(' is at ``start`` (nested parentheses
    and quoted strings kept whole), and the index after its ')'."""
    depth, quote, args, current = 0, "", [], []
    i = start
    while i < len(sql):
        ch = sql[i]
        if quote:
            current.append(ch)
            if ch == "\\" and i + 1 < len(sql):
                current.append(sql[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'`\"":
            quote = ch
            current.append(ch)
        elif ch == "(":
            depth += 1
            if depth > 1:
                current.append(ch)
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return [x for x in args if x or len(args) > 1], i + 1
            current.append(ch)
        elif ch == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    raise MacroError(f"unbalanced parentheses after a macro at offset {start}")


def expand_macros(sql: str, ctx: QueryContext) -> str:
    """Pass 2: the plugin's ``$__`` macros."""
    out, pos = [], 0
    for match in _MACRO.finditer(sql):
        if match.start() < pos:
            continue  # inside an argument list already expanded
        out.append(sql[pos : match.start()])
        name, end = match.group(1), match.end()
        args = None
        if end < len(sql) and sql[end] == "(":
            args, end = _arguments(sql, end)
            args = [expand_macros(arg, ctx) for arg in args]
        out.append(_macro(name, args, ctx))
        pos = end
    out.append(sql[pos:])
    return "".join(out)


def expand(sql: str, ctx: QueryContext, variables: Mapping[str, VariableValue] | None = None) -> str:
    """``sql`` as ClickHouse receives it from Grafana: variables, then the plugin's macros."""
    return expand_macros(expand_variables(sql, variables or {}), ctx)


def interval_for(ctx_from: datetime, ctx_to: datetime, max_data_points: int = 1000) -> float:
    """Grafana's panel interval for a time range (the range over the panel's data points, at
    least one second), rounded up to whole seconds."""
    span = (ctx_to - ctx_from).total_seconds()
    return float(max(1, math.ceil(span / max_data_points)))
