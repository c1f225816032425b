"""Grafana on ClickHouse: the dashboards as code (panels, dashboards), the plugin's macro expansion,
and the generated files under deploy/grafana/."""
