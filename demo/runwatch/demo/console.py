"""How the demo looks in a terminal: live progress and log lines, then a summary (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class DemoConsole:
    def __init__(self, quiet: bool, steps: int):
        self.quiet = quiet
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=steps, loss="-")

    def __enter__(self) -> DemoConsole:
        if not self.quiet:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.progress.stop()

    def log(self, message: str) -> None:
        if not self.quiet:
            self.console.log(message)

    def step(self, step: int, loss: float) -> None:
        if not self.quiet:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4g}")

    def summary(self, report: dict[str, Any]) -> None:
        out = Console()
        out.rule(f"runwatch demo: {report['scenario']} ({report['run_id']})")
        out.print(
            f"steps completed {report['steps_completed']}/{report['steps']} "
            f"(executed {report['steps_executed']}), fault at step {report['fault_step']}, "
            f"final loss {report['final_loss']:.4g}, wall time {report['wall_time_s']}s"
        )
        table = Table("step", "detector", "severity", "message", title="anomalies")
        for a in report["anomalies"]:
            table.add_row(str(a["step"]), a["detector"], a["severity"], a["message"])
        out.print(table if report["anomalies"] else "no anomalies")
        table = Table("step", "action", "reason", title="actions")
        for a in report["actions"]:
            table.add_row(str(a["step"]), a["kind"], a["reason"])
        out.print(table if report["actions"] else "no actions")
        for r in report["rollbacks"]:
            out.print(f"rolled back at step {r['from_step']} to the checkpoint of step {r['to_step']}")
        ch = report["clickhouse"]
        out.print(
            f"ClickHouse ({report['clickhouse_dsn']}): telemetry {ch['telemetry']}, anomalies "
            f"{ch['anomalies']}, actions {ch['actions']}, dead letters {ch['deadletter']}; events published "
            f"{report['events_published']}, dropped {report['events_dropped']}"
        )
        out.print(f"report: {report['report'] or 'not written (see the log above)'}")
