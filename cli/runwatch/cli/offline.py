"""``runwatch replay``, ``evaluate`` and ``calibrate``: the online detectors, run over recordings."""

from __future__ import annotations

from pathlib import Path

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import cli_config
from runwatch.cli.output import print_json

CONFIG_HELP = "detector/policy YAML (default: the built-in defaults)"


@click.command(cls=NeedsExtra, extras=["detectors"])
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option(
    "--tick",
    "tick_every_s",
    type=click.FloatRange(min=0.01),
    default=0.25,
    show_default=True,
    help="seconds of event time between time-based checks (the worker's timer period)",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def replay(path: str, config_path: str | None, tick_every_s: float, as_json: bool) -> None:
    """Run the detectors over a recorded telemetry stream (JSONL), event timestamps as the clock."""
    from runwatch.detectors.offline.replay import ReplayError, replay_file

    config = cli_config(config_path)
    try:
        result = replay_file(path, config, tick_every_s)
    except ReplayError as exc:
        raise CommandError(str(exc)) from None
    if as_json:
        print_json(
            {
                "events": result.events,
                "steps": result.steps,
                "runs": result.runs,
                "anomalies": [a.model_dump(mode="json") for a in result.anomalies],
                "actions": [
                    {"kind": d.kind, "step": d.step, "reason": d.reason, "anomaly_ids": d.anomaly_ids}
                    for d in result.decisions
                ],
            }
        )
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"{path}: {result.events} events ({result.steps} steps) in {len(result.runs)} run(s), "
        f"{len(result.anomalies)} finding(s), {len(result.decisions)} action(s)"
    )
    if result.anomalies:
        table = Table("step", "rank", "detector", "severity", "message")
        for a in result.anomalies:
            table.add_row(str(a.step), str(a.rank), a.detector, a.severity, a.message)
        console.print(table)


@click.command(cls=NeedsExtra, extras=["detectors"])
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with `scenarios` and `summary`")
def evaluate(directory: str, config_path: str | None, as_json: bool) -> None:
    """Score the detectors on a labelled corpus (runwatch scenarios generate): recall, false alarms, delays.
    On a history corpus (runwatch scenarios history): the gate and the change-point scan per labelled
    regression, the false alarms on benign commits."""
    from runwatch.detectors.offline.evaluate import evaluate_dir
    from runwatch.detectors.offline.history_eval import is_history_corpus
    from runwatch.detectors.offline.replay import ReplayError

    config = cli_config(config_path)
    if is_history_corpus(directory):
        _evaluate_history(directory, config.baseline, as_json)
        return
    try:
        evaluation = evaluate_dir(directory, config)
    except ReplayError as exc:
        raise CommandError(str(exc)) from None
    if as_json:
        print_json(evaluation.to_json())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "scenario",
        "fault",
        "detected",
        "right detector",
        "delay (steps)",
        "delay (s)",
        "false alarms",
        "found by",
        title=f"runwatch evaluate {directory}",
    )
    for s in evaluation.scenarios:
        ok = (
            "[green]yes[/green]" if s.correct_detector else ("-" if s.fault == "healthy" else "[red]no[/red]")
        )
        table.add_row(
            s.name,
            s.fault,
            "-" if s.fault == "healthy" else ("yes" if s.detected else "no"),
            ok,
            "" if s.delay_steps is None else str(s.delay_steps),
            "" if s.delay_s is None else f"{s.delay_s:.1f}",
            str(s.false_alarms),
            ", ".join(s.found_by),
        )
    console = Console()
    console.print(table)
    summary = evaluation.summary
    console.print(
        f"recall {summary['recall']}, false alarms per 10k healthy steps "
        f"{summary['false_alarms_per_10k_healthy_steps']}, median delay {summary['median_delay_steps']} steps"
    )


@click.command(cls=NeedsExtra, extras=["detectors"])
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--target-false-alarms",
    type=click.FloatRange(min=0),
    help="false alarms per 10,000 healthy steps allowed, per detector (a per-run corpus: required)",
)
@click.option(
    "--spread-multiple",
    "k",
    type=click.FloatRange(min=0),
    default=3.0,
    show_default=True,
    help="a history corpus: the tolerance is at least this many robust spreads of the normal runs",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="start from this YAML instead of the defaults",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False),
    default="runwatch-calibrated.yaml",
    show_default=True,
    help="where to write the proposed YAML",
)
def calibrate(
    directory: str, target_false_alarms: float | None, k: float, config_path: str | None, out_path: str
) -> None:
    """Propose per-detector thresholds from the healthy runs' observed behaviour; writes a YAML. On a history
    corpus: per-metric minimum relative changes (baseline.min_change) from the normal runs' spread."""
    from runwatch.detectors.offline.history_eval import is_history_corpus

    if is_history_corpus(directory):
        _calibrate_history(directory, k, config_path, out_path)
        return
    if target_false_alarms is None:
        raise click.UsageError("--target-false-alarms is required for a per-run corpus")
    from runwatch.detectors.offline.calibrate import calibrate as propose
    from runwatch.detectors.offline.calibrate import resolution_per_10k, to_yaml
    from runwatch.detectors.offline.evaluate import Corpus
    from runwatch.detectors.offline.replay import ReplayError

    base = cli_config(config_path)
    try:
        corpus = Corpus(directory)
    except ReplayError as exc:
        raise CommandError(str(exc)) from None

    def progress(detector: str, knob: str, value: float, rate: float) -> None:
        click.echo(f"  {detector}.{knob} = {value:g}: {rate:.2f} false alarms / 10k healthy steps", err=True)

    try:
        config, proposals = propose(corpus, target_false_alarms, base, progress)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    resolution = resolution_per_10k(corpus)
    if target_false_alarms < resolution:
        click.echo(
            f"caution: one false alarm in these healthy runs is already {resolution:.3g} per 10k steps; "
            f"a target of {target_false_alarms:g} can only be confirmed with more healthy steps",
            err=True,
        )
    Path(out_path).write_text(to_yaml(config, proposals, target_false_alarms, resolution))
    for p in proposals:
        flag = "" if p.target_met else "  (target not met)"
        click.echo(
            f"{p.detector}.{p.knob}: {p.default:g} -> {p.proposed:g}, "
            f"{p.false_alarms_per_10k:g} false alarms/10k{flag}"
        )
    click.echo(f"wrote {out_path}")


def _evaluate_history(directory: str, baseline: object, as_json: bool) -> None:
    from runwatch.detectors.offline.history_eval import evaluate_history_dir
    from runwatch.detectors.offline.replay import ReplayError

    try:
        evaluation = evaluate_history_dir(directory, baseline)  # type: ignore[arg-type]
    except ReplayError as exc:
        raise CommandError(str(exc)) from None
    if as_json:
        print_json(evaluation.to_json())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "regression",
        "commit",
        "found (gate)",
        "labelled metrics flagged",
        "change point at commit",
        "range has commit",
        "in flight",
        title=f"runwatch evaluate {directory} (history)",
    )
    for r in evaluation.regressions:
        table.add_row(
            r.name,
            r.commit[:10],
            "yes" if r.found_metrics else "[red]no[/red]",
            ", ".join(r.found_metrics),
            ", ".join(r.named_by) or "[red]none[/red]",
            "yes" if r.commit_range_contains else "[red]no[/red]",
            r.in_flight_status or "-",
        )
    console = Console()
    console.print(table)
    for alarm in evaluation.false_alarms:
        console.print(f"[red]false alarm[/red] {alarm.run_id} ({alarm.kind}): {', '.join(alarm.metrics)}")
    s = evaluation.summary
    console.print(
        f"{s['regressions_found']}/{s['regressions']} regressions found, {s['commits_named_correctly']} "
        f"commits named, {s['false_alarms']} false alarm(s) in {s['benign_runs']} benign runs, "
        f"{s['insufficient_history_runs']} run(s) with insufficient history"
    )


def _calibrate_history(directory: str, k: float, config_path: str | None, out_path: str) -> None:
    from runwatch.detectors.offline.history_eval import HistoryCorpus, propose_tolerances, tolerances_yaml
    from runwatch.detectors.offline.replay import ReplayError

    base = cli_config(config_path).baseline
    try:
        proposals = propose_tolerances(HistoryCorpus(directory), k, base)
    except ReplayError as exc:
        raise CommandError(str(exc)) from None
    text = tolerances_yaml(proposals, k, directory)
    Path(out_path).write_text(text)
    for p in proposals:
        click.echo(
            f"{p.metric}: {p.default:g} -> {p.proposed:g} (spread {p.spread:.2%}, "
            f"max deviation {p.max_deviation:.2%}, {p.runs} normal runs)"
        )
    click.echo(f"wrote {out_path} (use it with --config: its baseline.min_change)")
