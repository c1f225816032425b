"""ClickHouse schema, writer and sink consumer (Grafana dashboards and remediation come later)."""

from runwatch.sinks.clickhouse import TABLES, ClickHouseSink, default_dsn
from runwatch.sinks.consumer import SINK_GROUP, SinkConsumer

__all__ = ["SINK_GROUP", "TABLES", "ClickHouseSink", "SinkConsumer", "default_dsn"]
