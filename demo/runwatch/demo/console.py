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
        ch = report["clickhouse"]
        out.print(
            f"ClickHouse ({report['clickhouse_dsn']}): telemetry {ch['telemetry']}, anomalies "
            f"{ch['anomalies']}, actions {ch['actions']}, dead letters {ch['deadletter']}; events published "
            f"{report['events_published']}, dropped {report['events_dropped']}"
        )
        for line in closing_lines(report):
            out.print(line)


def closing_lines(report: dict[str, Any]) -> list[str]:
    """What happened, in words, and what to open next: the demo's last lines."""
    lines = []
    for r in report["rollbacks"]:
        scale = f" at {r['lr_scale']:g}x the LR" if r.get("lr_scale") else ""
        lines.append(
            f"runwatch rolled the run back at step {r['from_step']} to the checkpoint of step "
            f"{r['to_step']}{scale}"
        )
    for a in report.get("actions", []):
        if a["kind"] == "recovered":  # the worker's recovery check passed after a rollback
            lines.append(
                f"at step {a['step']} the run was back at its loss before the fault: the rollback worked"
            )
    goodput = report.get("goodput")
    if goodput and goodput.get("goodput") is not None:
        lost = ", ".join(
            f"{name.replace('_', ' ')} {seconds:.1f}s"
            for name, seconds in goodput["seconds"].items()
            if name != "productive" and seconds >= 0.05
        )
        lines.append(
            f"goodput {goodput['goodput']:.1%} of {goodput['wall_s']:.1f}s wall time"
            + (f"; lost: {lost}" if lost else "")
        )
    again = report["steps_executed"] - report["steps_completed"]
    end = "was stopped" if report["stopped"] else "completed"
    lines.append(
        f"the run {end} at step {report['steps_completed']} of {report['steps']}, after "
        f"{report['steps_executed']} executed steps"
        + (f" ({again} of them run again after a rollback)" if again > 0 else "")
    )
    if report["report"]:
        lines.append(f"next: open the report, {report['report']} (findings, actions, every curve)")
    else:
        lines.append("the report was not written (see the log above)")
    lines.append("then watch your own loop: runwatch up, and examples/quickstart.py (docs/local-stack.md)")
    return lines
