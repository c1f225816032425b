"""bench_state.py's measures in one process: the snapshot cost per event (state off against on), one
run's snapshot bytes and time to take as it grows, and the resident memory per held run."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

# (beside this file: bench_state.py, which imports this module, puts this folder on sys.path)
from state_bench_events import (
    PARTITIONS,
    SECRET,
    STATE_SECRET,
    NoState,
    log,
    snapshotting_processor,
    step_event,
    stream,
)

from runwatch.detectors import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from runwatch.worker.state.run_states import StateOptions

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
    proc = snapshotting_processor()
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
        proc = snapshotting_processor()
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
