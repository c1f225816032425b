"""Per-run state snapshots and scale-out (issue 16): what durable state costs, and what a second
worker in the group gives. Prints JSON (progress on stderr).

- **snapshot cost per event**, in one process: the same events (many runs; step events with 20
  module norms, 8 categories, memory and timing, as bench_throughput.py's) through the worker's
  ``TelemetryProcessor`` with state off and on (the worker's defaults: a snapshot per 1,000 events
  of a run, and a checkpoint of every changed run as often as 5 s is at ``--checkpoint-rate``
  events/s); microseconds per event and their ratio, and the bytes of a run's snapshot after 100,
  1,000 and 5,000 of its events, with the time to take one (pickle and compress).
- **restore time per 1,000 runs**: ``--restore-runs`` runs of 200 events each snapshotted into
  ``runwatch.state`` of an embedded broker, then read back by a fresh processor (the real
  ``StateReader`` and unpickling, as a worker does when given the partitions). The anomaly and
  action topics are empty there, so the restore includes only the least of the tail read that
  follows it (``published.py``).
- **tail read at its largest**: the anomaly and action topics filled with ``TAIL_RECORDS`` records
  per partition each (other runs' and the restored runs'), then ``read_published`` for 1,000
  restored runs, timed against its ``READ_BUDGET_S``.
- **one worker against two in one group**: real worker processes (``create_app``, state on), a fresh
  group and broker each time; the workers are started and have split the partitions *before* the telemetry
  topic is filled, so no rebalance falls inside the measurement; each worker notes, per partition, when it
  handed its first and last event to its detector process; the group's rate is the events over the first of
  those to the last. One worker with ``--no-state`` too, for the cost of snapshots in the whole pipeline. Both
  workers share this machine's two cores with the broker and the filling producer, so the two-worker figure
  here says what a second process on the *same* cores gives, not what a second machine would.

    .venv/bin/python tests/benchmarks/bench_state.py [--events 20000] [--rounds 2] [--restore-runs 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly, CategoryLoss, MemoryStats, StepEvent
from runwatch.detectors import RunwatchConfig
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.worker.processor import TelemetryProcessor
from runwatch.worker.state.published import READ_BUDGET_S, TAIL_RECORDS, read_published
from runwatch.worker.state.run_states import StateOptions

SECRET = secrets.token_bytes(32)
STATE_SECRET = secrets.token_bytes(32)  # the workers' state key (never the action secret)
PARTITIONS = 4


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_event(run: str, step: int, rng: random.Random, t0: datetime) -> StepEvent:
    return StepEvent(
        run_id=run,
        step=step,
        ts=t0 + timedelta(seconds=0.2 * step),
        loss=2.0 * math.exp(rng.gauss(0, 0.05)),
        lr=[3e-4],
        grad_norm=1.0 + rng.random() * 0.1,
        module_grad_norms={f"layers.{k}": 0.1 + rng.random() * 0.01 for k in range(20)},
        category_loss={f"c{k}": CategoryLoss(mean=2.0 + rng.gauss(0, 0.05), count=16) for k in range(8)},
        step_time_s=0.2 * math.exp(rng.gauss(0, 0.05)),
        data_wait_s=0.01,
        samples_per_s=640.0,
        memory=MemoryStats(allocated=10**10, reserved=12 * 10**9, host_rss=8 * 2**30),
    )


def stream(runs: int, steps: int, seed: int = 0) -> list[tuple[bytes, bytes, int]]:
    """(value, key, partition) of ``steps`` events of each of ``runs`` runs, interleaved."""
    rng = random.Random(seed)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    return [
        (step_event(f"bench-{r}", s, rng, t0).to_json(), f"bench-{r}".encode(), r % PARTITIONS)
        for s in range(steps)
        for r in range(runs)
    ]


class NoState:
    """A state reader with nothing stored (the in-process parts measure pickling, not Kafka)."""

    topic = topics.STATE
    origin: dict[str, tuple[int, int]] = {}

    def read(self, partitions: set[int]) -> dict[str, bytes | None]:
        return {}


# -- snapshot cost per event ------------------------------------------------------------------------


def snapshot_cost(runs: int, steps: int, checkpoint_every: int) -> dict:
    events = stream(runs, steps)
    rates = {}
    for mode in ("off", "on", "off", "on"):  # alternated, the second of each counts
        proc = TelemetryProcessor(
            RunwatchConfig(),
            SECRET,
            state_reader=NoState() if mode == "on" else None,
            state=StateOptions(interval_s=1e9),
            state_secret=STATE_SECRET,
        )
        proc.keep_partitions(set(range(PARTITIONS)))
        written = 0
        started = time.perf_counter()
        for i, (value, key, partition) in enumerate(events):
            proc.process(value, key, partition, i)
            if i % 500 == 499:  # a batch, as the worker sends them
                records, _ = proc.take_snapshots(force_checkpoint=(i + 1) % checkpoint_every < 500)
                written += sum(len(r.value or b"") for r in records)
        elapsed = time.perf_counter() - started
        rates[mode] = {
            "us_per_event": elapsed / len(events) * 1e6,
            "snapshots": proc.counters.snapshots,
            "snapshot_mb": written / 1e6,
        }
        log(f"snapshot cost, state {mode}: {rates[mode]}")
    return {
        "events": len(events),
        "runs": runs,
        "us_per_event_state_off": round(rates["off"]["us_per_event"], 1),
        "us_per_event_state_on": round(rates["on"]["us_per_event"], 1),
        "ratio_on_over_off": round(rates["on"]["us_per_event"] / rates["off"]["us_per_event"], 3),
        "snapshots_written": rates["on"]["snapshots"],
        "snapshot_mb_written": round(rates["on"]["snapshot_mb"], 1),
        "checkpoint_every_events": checkpoint_every,
    }


def snapshot_size() -> dict:
    """One run's snapshot bytes and time to take, as it grows."""
    rng = random.Random(1)
    t0 = datetime.now(UTC) - timedelta(hours=2)
    proc = TelemetryProcessor(
        RunwatchConfig(),
        SECRET,
        state_reader=NoState(),
        state=StateOptions(interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    proc.keep_partitions({0})
    out = {}
    for n in range(5000):
        proc.process(step_event("size", n, rng, t0).to_json(), b"size", 0, n)
        if n + 1 in (100, 1000, 5000):
            started = time.perf_counter()
            records, _ = proc.take_snapshots(force_checkpoint=True)
            took = time.perf_counter() - started
            (record,) = records
            out[f"after_{n + 1}_events"] = {
                "bytes": len(record.value or b""),
                "ms_to_take": round(took * 1e3, 2),
            }
    from runwatch.contract.schema import RunStartEvent

    for world in (8, 32):  # a multi-rank run: per-rank detectors and the join grow with its ranks
        proc = TelemetryProcessor(
            RunwatchConfig(),
            SECRET,
            state_reader=NoState(),
            state=StateOptions(interval_s=1e9),
            state_secret=STATE_SECRET,
        )
        proc.keep_partitions({0})
        run = f"ranks-{world}"
        proc.process(RunStartEvent(run_id=run, world_size=world, ts=t0).to_json(), run.encode(), 0, 0)
        offset = 1
        for n in range(200):
            for rank in range(world):
                event = step_event(run, n, rng, t0).model_copy(update={"rank": rank})
                proc.process(event.to_json(), run.encode(), 0, offset)
                offset += 1
        started = time.perf_counter()
        records, _ = proc.take_snapshots(force_checkpoint=True)
        took = time.perf_counter() - started
        size = len(records[0].value or b"")
        out[f"{world}_ranks_after_200_steps"] = {
            "bytes": size,
            "bytes_per_rank": size // world,
            "ms_to_take": round(took * 1e3, 2),
        }
    return out


# -- memory per held run ----------------------------------------------------------------------------


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held_memory(runs: int, steps: int) -> dict:
    """Resident memory of a processor holding ``runs`` single-rank runs of ``steps`` events each (the
    bench's step events: 20 modules, 8 categories), then after they went silent and were let go. Run in a
    process of its own (``--memory``) so that the figures are that process's alone."""
    from runwatch.worker.detector_process import release_memory

    config = RunwatchConfig.model_validate({"runs": {"silence_retention_s": 60, "max_runs": runs + 1}})
    proc = TelemetryProcessor(config, SECRET)
    warm = stream(20, steps, seed=9)
    for value, key, partition in warm:
        proc.process(value, key, partition)
    proc.tick(datetime.now(UTC) + timedelta(hours=2))
    release_memory()
    before = _rss_mib()
    rng, t0 = random.Random(4), datetime.now(UTC) - timedelta(hours=1)
    started = time.perf_counter()
    for step in range(steps):  # (made as they go: a list of them all would be most of what is measured)
        for r in range(runs):
            run = f"bench-{r}"
            proc.process(step_event(run, step, rng, t0).to_json(), run.encode(), r % PARTITIONS)
    fill_s = time.perf_counter() - started
    held = _rss_mib()
    assert len(proc.monitors) == runs
    proc.tick(datetime.now(UTC) + timedelta(hours=2))
    release_memory()
    after = _rss_mib()
    return {
        "runs": runs,
        "events_per_run": steps,
        "rss_before_mib": round(before, 1),
        "rss_holding_mib": round(held, 1),
        "kib_per_held_run": round((held - before) * 1024 / runs, 1),
        "rss_after_let_go_mib": round(after, 1),
        "fill_s": round(fill_s, 2),
    }


def held_memory_in_child(runs: int, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory", str(runs), str(steps)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- restore time ---------------------------------------------------------------------------------


def restore(bootstrap: str, runs: int, steps: int = 200) -> dict:
    from kafka import KafkaProducer

    from runwatch.worker.state.reader import StateReader

    builder = TelemetryProcessor(
        RunwatchConfig(),
        SECRET,
        state_reader=NoState(),
        state=StateOptions(interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    builder.keep_partitions(set(range(PARTITIONS)))
    for i, (value, key, partition) in enumerate(stream(runs, steps, seed=2)):
        builder.process(value, key, partition, i)
    records, _ = builder.take_snapshots(force_checkpoint=True)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        max_request_size=topics.STATE_MAX_BYTES,
        linger_ms=20,
    )
    for r in records:
        producer.send(topics.STATE, key=r.key.encode(), value=r.value, partition=r.partition)
    producer.flush(120)
    producer.close()
    total = sum(len(r.value or b"") for r in records)
    decode = decode_cost([r.value for r in records if r.value is not None])
    log(f"decoding the snapshots: {decode}")
    reader = StateReader(bootstrap, timeout_s=120)
    started = time.perf_counter()
    read = reader.read(set(range(PARTITIONS)))
    read_s = time.perf_counter() - started
    fresh = TelemetryProcessor(
        RunwatchConfig(),
        SECRET,
        state_reader=StateReader(bootstrap, timeout_s=120),
        state=StateOptions(interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    started = time.perf_counter()
    fresh.keep_partitions(set(range(PARTITIONS)))
    restore_s = time.perf_counter() - started
    reader.close()
    assert fresh.counters.restored_runs == runs == len(read), (fresh.counters.restored_runs, runs, len(read))
    return {
        "runs": runs,
        "events_per_run": steps,
        "mb": round(total / 1e6, 1),
        "median_snapshot_bytes": int(statistics.median(len(r.value or b"") for r in records)),
        "read_s": round(read_s, 2),
        "restore_s": round(restore_s, 2),
        "restore_s_per_1000_runs": round(restore_s / runs * 1000, 2),
        "decode": decode,
    }


def decode_cost(values: list[bytes], rounds: int = 5) -> dict:
    """Unpickling the snapshots' bodies with the worker's restricted unpickler (``decode_body``) against a
    plain ``pickle.loads`` of the same bytes, rounds in turn: ms per 1,000 runs and their ratio (what the
    allowlist costs a restore)."""
    import pickle
    import zlib

    from runwatch.worker.state.snapshot import decode_body, decode_header

    bodies = [decode_header(v, STATE_SECRET)[1] for v in values]
    took: dict[str, list[float]] = {"plain_pickle": [], "state_unpickler": []}
    for _ in range(rounds):
        for name, load in (
            ("plain_pickle", lambda b: pickle.loads(zlib.decompress(b))),
            ("state_unpickler", decode_body),
        ):
            started = time.perf_counter()
            for body in bodies:
                load(body)
            took[name].append((time.perf_counter() - started) / len(bodies) * 1e6)
    med = {k: statistics.median(v) for k, v in took.items()}
    return {
        "runs": len(bodies),
        "rounds": rounds,
        "ms_per_1000_runs": {k: round(v, 1) for k, v in med.items()},
        "ratio_state_unpickler_over_plain": round(med["state_unpickler"] / med["plain_pickle"], 3),
    }


# -- the published tail, full -------------------------------------------------------------------------


def tail_read(bootstrap: str, restored_runs: int = 1000, other_runs: int = 10_000) -> dict:
    """The successor's read of what was published, with every partition's tail full: ``TAIL_RECORDS``
    anomalies and actions per partition, keyed by runs restored here and by other runs."""
    from kafka import KafkaProducer

    from runwatch.worker.state.reader import StateReader

    rng = random.Random(3)
    now = datetime.now(UTC)
    restored = [f"restored-{i}" for i in range(restored_runs)]
    runs = restored + [f"other-{i}" for i in range(other_runs)]
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, linger_ms=20)
    total = TAIL_RECORDS * PARTITIONS
    for i in range(total):
        run = rng.choice(runs)
        anomaly = Anomaly(
            anomaly_id=f"{run}-a{i}",
            run_id=run,
            detector="loss_spike",
            metric="loss",
            severity="warning",
            message=f"loss {rng.uniform(2, 9):.3f} spiked over its median",
            ts=now,
            step=rng.randrange(100_000),
            score=rng.random(),
        )
        action = Action(
            action_id=f"{run}-x{i}",
            run_id=run,
            kind="alert",
            reason="loss spike",
            step=anomaly.step,
            anomaly_ids=[anomaly.anomaly_id],
            issued_at=now,
            expires_at=now + timedelta(minutes=5),
        )
        producer.send(topics.ANOMALIES, key=run.encode(), value=anomaly.to_json(), partition=i % PARTITIONS)
        producer.send(topics.ACTIONS, key=run.encode(), value=action.to_json(), partition=i % PARTITIONS)
    producer.flush(120)
    producer.close()
    reader = StateReader(bootstrap, timeout_s=120)
    try:
        started = time.perf_counter()
        published = read_published(reader.scan, restored)
        read_s = time.perf_counter() - started
    finally:
        reader.close()
    return {
        "records_per_partition_per_topic": TAIL_RECORDS,
        "partitions": PARTITIONS,
        "records_read": 2 * total,
        "restored_runs": restored_runs,
        "kept": len(published),
        "read_s": round(read_s, 2),
        "budget_s": READ_BUDGET_S,
        "within_budget": read_s < READ_BUDGET_S,
    }


# -- one worker against two ------------------------------------------------------------------------


def worker_process(bootstrap: str, group: str, state: str, out: str, ready: str) -> None:
    """A worker (create_app) that writes, per partition, when it handed its first and last event to
    its detector process and the newest offset, to ``out`` every 0.2 s."""
    import asyncio

    from faust.worker import Worker

    from runwatch.worker.app import create_app

    app, detectors = create_app(
        bootstrap,
        RunwatchConfig(),
        SECRET,
        app_id=group,
        web_port=free_port(),
        ready_file=Path(ready),
        state=StateOptions(enabled=state == "on"),
        state_secret=STATE_SECRET,
    )
    seen: dict[int, list] = {}
    submit = detectors.submit

    def timed_submit(kind, payload=None):
        reply = submit(kind, payload)
        if kind == "events":

            def done(_f) -> None:
                now = time.time()
                for _v, _k, p, o, _ts in payload:
                    entry = seen.setdefault(p, [now, now, o, 0])
                    entry[1], entry[2], entry[3] = now, max(entry[2], o), entry[3] + 1

            reply.add_done_callback(done)
        return reply

    detectors.submit = timed_submit

    @app.timer(0.2)
    async def write() -> None:
        Path(out).write_text(json.dumps(seen))
        await asyncio.sleep(0)

    sys.argv = [sys.argv[0]]
    Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def fill(bootstrap: str, n: int, runs: int) -> dict[int, int]:
    from kafka import KafkaProducer

    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        acks=1,
        linger_ms=20,
        batch_size=256 * 1024,
    )
    futures = [
        producer.send(topics.TELEMETRY, key=key, value=value)
        for value, key, _ in stream(runs, n // runs, seed=3)
    ]
    producer.flush(timeout=120)
    last: dict[int, int] = {}
    for f in futures:
        md = f.get(timeout=30)
        last[md.partition] = max(last.get(md.partition, -1), md.offset)
    producer.close()
    return last


def group_rate(workers: int, state: str, events: int, runs: int, tmp: Path, timeout: float) -> float:
    """Events/s of ``workers`` workers in one group, on a broker of their own (a fresh group reads from the
    earliest offset: an empty topic is the only way it reads just these events)."""
    with EmbeddedBroker(log_path=tmp / f"broker-{secrets.token_hex(3)}.log") as broker:
        ensure_topics(broker.bootstrap, partitions=PARTITIONS)
        return _group_rate(broker.bootstrap, workers, state, events, runs, tmp, timeout)


def _group_rate(
    bootstrap: str, workers: int, state: str, events: int, runs: int, tmp: Path, timeout: float
) -> float:
    group = f"bench-state-{secrets.token_hex(4)}"
    procs, outs, readies = [], [], []
    try:
        for w in range(workers):
            out, ready = tmp / f"{group}-{w}.json", tmp / f"{group}-{w}.ready"
            outs.append(out)
            readies.append(ready)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", bootstrap, group, state, str(out), str(ready)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=tmp,
                )
            )
        deadline = time.monotonic() + timeout

        def assigned() -> list[set[str]]:
            return [set(r.read_text().split(",")) - {""} if r.exists() else set() for r in readies]

        telemetry = {f"{topics.TELEMETRY}:{p}" for p in range(PARTITIONS)}
        while True:  # every worker holds some partitions and together they hold them all, once
            got = assigned()
            if (
                all(got)
                and set().union(*got) >= telemetry
                and sum(len(g & telemetry) for g in got) == PARTITIONS
            ):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the workers did not split the partitions: {got}")
            time.sleep(0.2)
        time.sleep(2)  # (settled)
        ends = fill(bootstrap, events, runs)
        while True:
            seen: dict[str, list] = {}
            for out in outs:
                if out.exists():
                    try:
                        seen.update(json.loads(out.read_text()))
                    except ValueError:
                        pass  # (being written)
            if all(str(p) in seen and seen[str(p)][2] >= end for p, end in ends.items()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not finish within {timeout} s: {seen} vs {ends}")
            time.sleep(0.2)
        first = min(v[0] for v in seen.values())
        last = max(v[1] for v in seen.values())
        counted = sum(v[3] for v in seen.values())
        if counted != events:
            raise RuntimeError(f"the workers handed on {counted} events, not the {events} published")
        return events / (last - first)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--restore-runs", type=int, default=1000)
    ap.add_argument(
        "--checkpoint-rate",
        type=float,
        default=3500.0,
        help="events/s one worker handles: a checkpoint (5 s) every rate x 5 events",
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--memory", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_process(*args.worker)
        return
    if args.memory:
        print(json.dumps(held_memory(*args.memory)))
        return
    started = time.monotonic()
    result: dict = {"benchmark": "state_snapshots_and_scale_out"}
    result["snapshot_cost"] = snapshot_cost(args.runs, 1000, int(args.checkpoint_rate * 5))
    result["snapshot_size_one_run"] = snapshot_size()
    log(f"snapshot size: {result['snapshot_size_one_run']}")
    result["memory_per_held_run"] = [held_memory_in_child(10_000, 3), held_memory_in_child(2_000, 200)]
    log(f"memory per held run: {result['memory_per_held_run']}")
    with tempfile.TemporaryDirectory() as tmp:
        with EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
            ensure_topics(broker.bootstrap, partitions=PARTITIONS)
            result["restore"] = restore(broker.bootstrap, args.restore_runs)
            log(f"restore: {result['restore']}")
            result["published_tail_read"] = tail_read(broker.bootstrap)
            log(f"published tail read: {result['published_tail_read']}")
        rounds = []
        for r in range(args.rounds):
            order = [(1, "on"), (2, "on"), (1, "off")]
            if r % 2:
                order.reverse()
            rates = {}
            for workers, state in order:
                rates[f"{workers}_worker_state_{state}"] = group_rate(
                    workers, state, args.events, args.runs, Path(tmp), args.timeout
                )
                log(
                    f"round {r}: {workers} worker(s), state {state}: "
                    f"{rates[f'{workers}_worker_state_{state}']:.0f} events/s"
                )
            rounds.append({k: round(v) for k, v in rates.items()})
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result["throughput"] = {
        "events": args.events,
        "runs": args.runs,
        "rounds": rounds,
        "median_events_per_s": {k: round(v) for k, v in med.items()},
        "ratio_two_workers_over_one": round(med["2_worker_state_on"] / med["1_worker_state_on"], 3),
        "ratio_state_on_over_off": round(med["1_worker_state_on"] / med["1_worker_state_off"], 3),
    }
    result["seconds"] = round(time.monotonic() - started)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
