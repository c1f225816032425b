"""Where findings land and what acts on them: ClickHouse (schema, writer, read models) and the sink
consumer; the Grafana dashboards (grafana/), the remediator (remediate/) and the HTML report (report/)."""

from runwatch.sinks.clickhouse import TABLES, ClickHouseSink, default_dsn
from runwatch.sinks.consumer import SINK_GROUP, SinkConsumer

__all__ = ["SINK_GROUP", "TABLES", "ClickHouseSink", "SinkConsumer", "default_dsn"]
