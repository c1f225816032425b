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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runwatch.local.broker import EmbeddedBroker, ensure_topics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from state_bench_events import PARTITIONS, log
from state_bench_group import group_rate, worker_process
from state_bench_in_process import held_memory, snapshot_cost, snapshot_size
from state_bench_restore import restore, tail_read


def held_memory_in_child(runs: int, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory", str(runs), str(steps)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
