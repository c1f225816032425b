"""The five dashboards as Grafana JSON, built with grafana-foundation-sdk's typed builders from the
specs in ``panels.py``. The ClickHouse plugin's query is registered with the SDK as a dataquery
variant (the SDK ships core datasources only), as its "custom query type" guide shows."""

from __future__ import annotations

import json
from typing import Any, Self

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import heatmap, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    CustomVariable,
    Dashboard,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from runwatch.sinks.grafana.panels import DASHBOARDS, DashboardSpec, PanelSpec, VariableSpec

PLUGIN_ID = "grafana-clickhouse-datasource"
DATASOURCE_UID = "runwatch-clickhouse"  # the provisioned datasource (deploy/grafana/provisioning)
DATABASE = "runwatch"  # the sink's default database
PLUGIN_VERSION = "4.0.0"  # the oldest plugin release whose query model (editorType/rawSql) this matches
DATASOURCE = common.DataSourceRef(type_val=PLUGIN_ID, uid=DATASOURCE_UID)
TAGS = ["runwatch", "generated"]


class ClickHouseQuery(cogvariants.Dataquery):
    """The ClickHouse plugin's SQL query (``CHSqlQuery`` in its src/types/sql.ts)."""

    def __init__(
        self, raw_sql: str = "", query_format: int = 1, ref_id: str | None = None, hide: bool | None = None
    ) -> None:
        self.raw_sql = raw_sql
        self.format = query_format  # sqlds: 0 time series, 1 table
        self.ref_id = ref_id
        self.hide = hide

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "datasource": DATASOURCE.to_json(),
            "editorType": "sql",
            "format": self.format,
            "pluginVersion": PLUGIN_VERSION,
            "queryType": "timeseries" if self.format == 0 else "table",
            "rawSql": self.raw_sql,
        }
        if self.ref_id is not None:
            payload["refId"] = self.ref_id
        if self.hide is not None:
            payload["hide"] = self.hide
        return payload

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        return cls(
            raw_sql=data.get("rawSql", ""),
            query_format=data.get("format", 1),
            ref_id=data.get("refId"),
            hide=data.get("hide"),
        )


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    _internal: ClickHouseQuery

    def __init__(self, raw_sql: str, query_format: int = 1) -> None:
        self._internal = ClickHouseQuery(raw_sql, query_format)

    def build(self) -> ClickHouseQuery:
        return self._internal

    def ref_id(self, ref_id: str) -> Self:
        self._internal.ref_id = ref_id
        return self


def register_clickhouse_query() -> None:
    """Tell cog how to read the plugin's queries back from dashboard JSON."""
    cogruntime.register_dataquery_variant(
        cogruntime.DataqueryConfig(identifier=PLUGIN_ID, from_json_hook=ClickHouseQuery.from_json)
    )


def _log_scale() -> common_builders.ScaleDistributionConfig:
    return common_builders.ScaleDistributionConfig().type(common.ScaleDistribution.LOG).log(10)


def panel_builder(spec: PanelSpec, db: str = DATABASE) -> cogbuilder.Builder[model.Panel]:
    """The SDK builder of one panel."""
    query = ClickHouseQueryBuilder(spec.render(db), spec.format).ref_id("A")
    p: timeseries.Panel | heatmap.Panel | statetimeline.Panel | stat.Panel | table.Panel
    if spec.kind == "timeseries":
        p = (
            timeseries.Panel()
            .line_width(1)
            .fill_opacity(5)
            .show_points(common.VisibilityMode.NEVER)
            .legend(
                common_builders.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
        )
        if spec.log_scale:
            p = p.scale_distribution(_log_scale())
    elif spec.kind == "heatmap":
        p = heatmap.Panel().calculate(False)
    elif spec.kind == "state_timeline":
        p = statetimeline.Panel().mappings(
            [
                model.ValueMap(
                    options={
                        str(code): model.ValueMappingResult(text=name, index=code - 1)
                        for code, name in sorted(spec.value_names.items())
                    }
                )
            ]
        )
    elif spec.kind == "stat":
        p = stat.Panel().graph_mode(common.BigValueGraphMode.NONE)
    else:
        p = table.Panel()
    p = (
        p.title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .with_target(query)
        .span(spec.width)
        .height(spec.height)
    )
    if spec.unit:
        p = p.unit(spec.unit)
    return p


def _variable(spec: VariableSpec, db: str) -> cogbuilder.Builder[model.VariableModel]:
    v: CustomVariable | QueryVariable
    if spec.values:
        v = (
            CustomVariable(spec.name)
            .values(",".join(spec.values))
            .current(model.VariableOption(text=spec.values[0], value=spec.values[0]))
        )
    else:
        v = (
            QueryVariable(spec.name)
            .datasource(DATASOURCE)
            # a plain SQL string: the form every plugin version reads (v4's variable editor takes it as
            # its "legacy" query); the schema allows an object query only of nested objects
            .query(spec.render(db))
            .definition(spec.render(db))
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    v = v.label(spec.label).description(spec.description).multi(spec.multi).include_all(spec.include_all)
    return v


def dashboard_builder(spec: DashboardSpec, db: str = DATABASE) -> Dashboard:
    """The SDK builder of one dashboard."""
    d = (
        Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(TAGS)
        .refresh(spec.refresh)
        .time(spec.time_from, "now")
        .timezone(common.TimeZoneUtc)
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
    )
    for variable in spec.variables:
        d = d.with_variable(_variable(variable, db))
    # Grafana's own annotations (those saved by people on the dashboard), as every dashboard has them
    d = d.annotation(
        AnnotationQuery()
        .name("Annotations & Alerts")
        .built_in(1)
        .enable(True)
        .hide(True)
        .datasource(common.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .icon_color("rgba(0, 211, 255, 1)")
        .type("dashboard")
    )
    for mark in spec.annotations:
        d = d.annotation(
            AnnotationQuery()
            .name(mark.name)
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color(mark.color)
            .target(ClickHouseQueryBuilder(mark.render(db), 1).ref_id("Anno"))
        )
    for title, panels in spec.sections:
        d = d.with_row(Row(title))
        for panel in panels:
            d = d.with_panel(panel_builder(panel, db))
    return d


def dashboard_json(spec: DashboardSpec, db: str = DATABASE) -> dict[str, Any]:
    """One dashboard as the dict Grafana's file provisioning and HTTP API take."""
    out: dict[str, Any] = json.loads(JSONEncoder().encode(dashboard_builder(spec, db).build()))
    return out


def render(spec: DashboardSpec, db: str = DATABASE) -> str:
    """The committed file's text: sorted keys, two-space indent, a final newline."""
    return json.dumps(dashboard_json(spec, db), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def all_dashboards(db: str = DATABASE) -> dict[str, str]:
    """File name -> text for every dashboard."""
    return {f"{spec.uid}.json": render(spec, db) for spec in DASHBOARDS}
