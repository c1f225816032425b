"""What a dashboard is made of, as plain data: panels (title, kind, SQL, columns), variables, annotations,
and the dashboard that sections them. ``dashboards.py`` turns these into Grafana JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PanelKind = Literal["timeseries", "table", "stat", "heatmap", "state_timeline", "bar_chart"]
TIME_SERIES_KINDS = frozenset({"timeseries", "heatmap", "state_timeline"})


@dataclass(frozen=True)
class PanelSpec:
    """One panel: what it shows (``description``), its SQL and the columns that SQL returns."""

    title: str
    kind: PanelKind
    sql: str
    columns: tuple[str, ...]
    description: str
    unit: str = ""
    width: int = 12
    height: int = 8
    log_scale: bool = False
    value_names: dict[int, str] = field(default_factory=dict)  # numeric codes shown as text (phases)
    cannot_show: str = ""  # what a reader might expect here that ClickHouse does not hold

    @property
    def format(self) -> int:
        """The plugin's query format: 0 time series, 1 table."""
        return 0 if self.kind in TIME_SERIES_KINDS else 1

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class VariableSpec:
    """A dashboard variable: a query over ClickHouse, or fixed ``values``."""

    name: str
    label: str
    sql: str = ""
    values: tuple[str, ...] = ()
    multi: bool = False
    include_all: bool = False
    description: str = ""

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class AnnotationSpec:
    """Marks on every time-series panel: SQL returning ``time``, ``text`` and ``tags``."""

    name: str
    sql: str
    color: str
    columns: tuple[str, ...] = ("time", "text", "tags")

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    time_from: str
    variables: tuple[VariableSpec, ...]
    sections: tuple[tuple[str, tuple[PanelSpec, ...]], ...]
    annotations: tuple[AnnotationSpec, ...] = ()
    refresh: str = "30s"

    @property
    def panels(self) -> tuple[PanelSpec, ...]:
        return tuple(p for _, panels in self.sections for p in panels)
