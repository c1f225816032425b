"""``runwatch demo``: the whole loop on one machine, with any catalog scenario."""

from __future__ import annotations

from pathlib import Path

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import cli_config, require_torch
from runwatch.cli.output import print_json
from runwatch.contract import topics


def _outage_window(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        start, end = (float(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not START:END, e.g. 0.33:0.66") from None
    if not 0.0 <= start < end <= 1.0:
        raise click.BadParameter(f"{value!r}: need 0 <= START < END <= 1 (fractions of the run's steps)")
    return start, end


@click.command(cls=NeedsExtra, extras=["demo"])
@click.option(
    "--scenario",
    default="nan",
    show_default=True,
    help="any catalog scenario: healthy, nan or grad-spike (the small demo model) or one of "
    "`runwatch scenarios generate` (e.g. stall_hang_train, streamed live on a simulated clock); "
    "the worker's actions are taken either way",
)
@click.option("--steps", type=click.IntRange(min=20), default=300, show_default=True)
@click.option("--fault-step", type=int, default=None, help="default: just after half way")
@click.option(
    "--bootstrap", envvar=topics.BOOTSTRAP_ENV, help="use this Kafka instead of the embedded broker"
)
@click.option(
    "--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help="ClickHouse DSN; default chdb:///.runwatch/clickhouse"
)
@click.option(
    "--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="detector/policy YAML"
)
@click.option("--no-worker", is_flag=True, help="a worker is already running against --bootstrap")
@click.option("--step-interval", type=float, default=0.02, show_default=True, help="minimum seconds per step")
@click.option(
    "--broker-outage",
    metavar="START:END",
    callback=_outage_window,
    help="cut every client off the (embedded) broker between these fractions of the run's steps, "
    "e.g. 0.33:0.66; the trainer spools to disk and replays",
)
@click.option(
    "--stall-step",
    type=click.IntRange(min=1),
    help="hang this step in the train phase for --stall-s seconds (the small demo model only)",
)
@click.option(
    "--stall-s",
    type=click.FloatRange(min=0),
    default=15.0,
    show_default=True,
    help="how long --stall-step hangs (the stall detector's train allowance is 10 s)",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the summary")
def demo(
    scenario: str,
    steps: int,
    fault_step: int | None,
    bootstrap: str | None,
    dsn: str | None,
    config_path: str | None,
    no_worker: bool,
    step_interval: float,
    broker_outage: tuple[float, float] | None,
    stall_step: int | None,
    stall_s: float,
    as_json: bool,
) -> None:
    """Train a small model with a fault injected and watch runwatch catch it."""
    require_torch("runwatch demo")  # before the imports below, which load torch
    from runwatch.demo.console import DemoConsole
    from runwatch.demo.run import DemoError, DemoOptions, run_demo
    from runwatch.local.worker_process import LocalStackError
    from runwatch.scenarios.catalog import SCENARIOS

    if scenario not in SCENARIOS:
        raise click.BadParameter(
            f"{scenario!r}; choose one of {', '.join(SCENARIOS)}", param_hint="--scenario"
        )
    if SCENARIOS[scenario].recorded:
        steps = SCENARIOS[scenario].n_steps(False)  # a recorded scenario has its own length
    if config_path:
        cli_config(config_path)  # fail here, not in the worker process
    opts = DemoOptions(
        scenario=scenario,
        steps=steps,
        fault_step=fault_step,
        bootstrap=bootstrap,
        dsn=dsn,
        config_path=Path(config_path) if config_path else None,
        start_worker=not no_worker,
        step_interval_s=step_interval,
        broker_outage=broker_outage,
        stall_step=stall_step,
        stall_s=stall_s,
    )
    console = DemoConsole(quiet=as_json, steps=steps)
    try:
        with console:
            report = run_demo(opts, log=console.log, on_step=console.step)
    except (DemoError, LocalStackError) as exc:
        raise CommandError(str(exc)) from None
    if as_json:
        print_json(report)
    else:
        console.summary(report)
