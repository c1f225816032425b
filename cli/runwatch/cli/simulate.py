"""``runwatch simulate``: play N ranks of a synthetic run to a broker, with faults, and no torch (issue 36).

The load generator behind the scale figures (docs/benchmarks.md): anyone can reproduce them with the
embedded broker and one or more ``runwatch worker``. The events are local/runwatch/local/simulate.py's.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from datetime import UTC, datetime

import click

from runwatch.cli.failure import CommandError
from runwatch.contract import topics
from runwatch.contract.groups import DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE
from runwatch.contract.schema import DEFAULT_LIMITS

PROGRESS_EVERY_S = 5.0


@click.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help="the Kafka to send to")
@click.option("--run-id", default=None, help="the run's id (default: sim-<random>)")
@click.option("--ranks", type=click.IntRange(1, DEFAULT_LIMITS.max_world_size), default=64, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=100, show_default=True)
@click.option(
    "--step-time",
    type=click.FloatRange(0.001),
    default=1.0,
    show_default=True,
    help="seconds per healthy step: the rate the run plays at (every rank sends one step event per step)",
)
@click.option(
    "--heartbeat-s",
    type=click.FloatRange(0.1),
    default=5.0,
    show_default=True,
    help="every rank's heartbeat period",
)
@click.option(
    "--fault",
    "fault_texts",
    multiple=True,
    metavar="KIND:RANK:ARG",
    help="hang:R:STEP, slow:R:FACTOR, nan:R:STEP, spike:R:STEP or memory:R:MB_PER_STEP (repeatable)",
)
@click.option(
    "--group-size",
    type=click.IntRange(1, MAX_GROUP_SIZE),
    default=DEFAULT_GROUP_SIZE,
    show_default=True,
    help="ranks per group: a run of more ranks is split by rank group over the workers (as RunWatch's)",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(0),
    default=10,
    show_default=True,
    help="rank 0 reports a checkpoint every this many steps (a rollback's target; 0: none)",
)
@click.option(
    "--end/--no-end",
    default=True,
    show_default=True,
    help="say run_end after the last step (not after a hang: a hung job never does)",
)
@click.option("--seed", type=int, default=0, show_default=True)
def simulate(
    bootstrap: str,
    run_id: str | None,
    ranks: int,
    steps: int,
    step_time: float,
    heartbeat_s: float,
    fault_texts: tuple[str, ...],
    group_size: int,
    checkpoint_every: int,
    end: bool,
    seed: int,
) -> None:
    """Play a synthetic run of RANKS ranks for STEPS steps, a step every STEP_TIME seconds, with faults.

    Progress goes to stderr every 5 s; a JSON summary (events sent, seconds, the step rate achieved) to
    stdout at the end. A machine that cannot send RANKS events every STEP_TIME seconds says so: the
    summary's `behind_s` is how far the last step was sent after its time.
    """
    from kafka import KafkaProducer

    from runwatch.local.simulate import SyntheticRun, parse_fault

    try:
        faults = [parse_fault(text, ranks) for text in fault_texts]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fault") from None
    run_id = run_id or f"sim-{uuid.uuid4().hex[:8]}"
    run = SyntheticRun(run_id, ranks, step_time, faults, seed, group_size=group_size)
    try:
        producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            acks=1,
            linger_ms=20,
            batch_size=1 << 20,
            max_request_size=8 << 20,
        )
    except Exception as exc:  # noqa: BLE001 - one line, whatever kafka-python raises
        raise CommandError(f"cannot reach the broker at {bootstrap}: {exc}") from None
    sent = {"run_start": 0, "step": 0, "heartbeat": 0, "checkpoint": 0, "run_end": 0}

    try:
        partitions = len(producer.partitions_for(topics.TELEMETRY))
    except Exception as exc:  # noqa: BLE001 - one line, whatever kafka-python raises
        raise CommandError(f"cannot read {topics.TELEMETRY}'s partitions at {bootstrap}: {exc}") from None
    # a split run's group keys go to their groups' partitions (topics.key_partition), not murmur2's
    where = [topics.group_partition(run.key(rank), partitions) for rank in range(ranks)]

    def send(rank: int, value: bytes, kind: str) -> None:
        producer.send(topics.TELEMETRY, key=run.key(rank), value=value, partition=where[rank])
        sent[kind] += 1

    click.echo(f"simulating run {run_id}: {ranks} ranks, {steps} steps every {step_time:g} s", err=True)
    started = time.monotonic()
    for rank in run.leaders():  # (rank 0, and each group's first rank of a split run)
        send(rank, run.run_start(datetime.now(UTC), rank), "run_start")
    next_heartbeat, last_progress, behind = started + heartbeat_s, started, 0.0
    last_step = -1
    try:
        for step in range(steps):
            due = started + step * step_time
            while (now := time.monotonic()) < due:
                if now >= next_heartbeat:
                    for rank, value in run.heartbeats(last_step, datetime.now(UTC), heartbeat_s):
                        send(rank, value, "heartbeat")
                    next_heartbeat += heartbeat_s
                time.sleep(min(due - now, max(0.0, next_heartbeat - now), 0.05))
            behind = max(0.0, time.monotonic() - due)
            for rank, value in run.step(step, datetime.now(UTC)):
                send(rank, value, "step")
            hung = run.hung_at()
            if hung is None or step < hung:
                last_step = step
                if checkpoint_every and step and step % checkpoint_every == 0:
                    send(0, run.checkpoint(step, datetime.now(UTC)), "checkpoint")
            if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                rate = sum(sent.values()) / (last_progress - started)
                click.echo(f"step {step + 1}/{steps}: {rate:,.0f} events/s, {behind:.1f} s behind", err=True)
        if end and run.hung_at() is None:  # (a hung job never says goodbye)
            for rank in run.leaders():
                send(rank, run.run_end(datetime.now(UTC), rank), "run_end")
        producer.flush(120)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
    finally:
        producer.close(10)
    seconds = time.monotonic() - started
    summary = {
        "run_id": run_id,
        "ranks": ranks,
        "steps": steps,
        "events": sent,
        "seconds": round(seconds, 2),
        "events_per_s": round(sum(sent.values()) / seconds),
        "behind_s": round(behind, 2),
        "faults": [f"{f.kind}:{f.rank}:{f.arg:g}" for f in faults],
        "group_size": group_size,
    }
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")
