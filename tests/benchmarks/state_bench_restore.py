"""bench_state.py's measures of what a successor reads, on an embedded broker: the restore time of
``runwatch.state`` (with the cost of the restricted unpickler), and the read of the published tail at
its largest against its budget."""

from __future__ import annotations

import random
import statistics
import time
from datetime import UTC, datetime, timedelta

# (beside this file: bench_state.py, which imports this module, puts this folder on sys.path)
from state_bench_events import PARTITIONS, SECRET, STATE_SECRET, log, snapshotting_processor, stream

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly
from runwatch.detectors import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from runwatch.worker.state.published import READ_BUDGET_S, TAIL_RECORDS, read_published
from runwatch.worker.state.run_states import StateOptions

# -- restore time ---------------------------------------------------------------------------------


def restore(bootstrap: str, runs: int, steps: int = 200) -> dict:
    from kafka import KafkaProducer

    from runwatch.worker.state.reader import StateReader

    builder = snapshotting_processor()
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
