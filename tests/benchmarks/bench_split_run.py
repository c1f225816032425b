"""One run as large as the largest training jobs, split by rank group over four workers (issue 36).

``runwatch simulate``'s synthetic run (local/runwatch/local/simulate.py) goes through four
``TelemetryProcessor`` in one process, each standing for a worker that owns the telemetry partitions
``p`` with ``p % 4 == w`` of 16: every record goes to the owner of its key's partition
(``topics.key_partition``), and so does every group report a processor sends (signed, serialised and
verified as on the wire). Time is simulated (a step a second, heartbeats every 5 s, every worker ticked
every second), so detection delays are in the run's seconds, whatever this machine's speed; CPU time
(``process_time``) is counted per worker. Faust, the broker and the detector process's pipe are not in it
(bench_throughput.py measures those); a 4-worker deployment runs the same code in four processes.

Phases (``--phase``):

- ``cost``: CPU per 1,000 rank-steps, every stage included, of 16,384 ranks split in groups of 64 over
  the four workers, against 64 ranks in one worker (the ratio is the figure), over the second half of
  ``--steps`` steps (the first fills the detectors' windows; rank 0 checkpoints every 10 steps); the
  joined record's and a group report's bytes; every key's snapshot bytes; events per worker (max/min).
- ``scenario``: 16,384 ranks: 200 healthy steps (every finding counted), then rank 12,345 1.5x slower
  from step 200, a NaN loss on rank 7 from step 230, rank 9,001 stopping before step 260; what was
  found, on which rank, how many seconds after the fault, and the actions.

    .venv/bin/python tests/benchmarks/bench_split_run.py --phase cost
    .venv/bin/python tests/benchmarks/bench_split_run.py --phase scenario
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
import zlib
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

WORKERS, PARTITIONS = 4, 16
HEARTBEAT_S = 5.0


class Cluster:
    """Four processors and the routing between them (see the module doc)."""

    def __init__(self) -> None:
        from runwatch.detectors import RunwatchConfig
        from runwatch.worker.processor import TelemetryProcessor

        self.now = datetime.now(UTC) - timedelta(hours=2)
        clock: Callable[[], datetime] = lambda: self.now  # noqa: E731 - the simulated wall clock
        self.workers = [TelemetryProcessor(RunwatchConfig(), bytes(32), clock=clock) for _ in range(WORKERS)]
        self.cpu = [0.0] * WORKERS
        self.events = [0] * WORKERS
        self.anomalies: list[Any] = []
        self.actions: list[Any] = []
        self.joined: list[Any] = []
        self.letters: list[str] = []
        self.report_bytes: list[int] = []

    def owner(self, key: bytes) -> int:
        from runwatch.contract.topics import key_partition

        return key_partition(key, PARTITIONS) % WORKERS

    def send(self, value: bytes, key: bytes) -> None:
        queue = [(value, key)]
        while queue:
            value, key = queue.pop()
            w = self.owner(key)
            began = time.process_time()
            result = self.workers[w].process(value, key, None, None, self.now.timestamp())
            reports = [(r.to_json(), r.run_id.encode()) for r in result.reports]
            self.cpu[w] += time.process_time() - began
            self.events[w] += 1
            self._keep(result)
            self.report_bytes += [len(v) for v, _ in reports]
            queue.extend(reversed(reports))

    def tick(self) -> None:
        for w, proc in enumerate(self.workers):
            began = time.process_time()
            result = proc.tick(now=self.now)
            reports = [(r.to_json(), r.run_id.encode()) for r in result.reports]
            self.cpu[w] += time.process_time() - began
            self._keep(result)
            for value, key in reports:
                self.send(value, key)

    def _keep(self, result: Any) -> None:
        if result.deadletter is not None:
            self.letters.append(result.deadletter.reason)
        self.anomalies += result.anomalies
        self.actions += result.actions
        self.joined += result.joined

    def monitors(self) -> dict[str, Any]:
        return {key: m for proc in self.workers for key, m in proc.monitors.items()}


def play(cluster: Cluster, run: Any, steps: range, heartbeats: bool = True, ticks: bool = True) -> None:
    """Steps at 1 s of simulated time each; every rank's heartbeat every HEARTBEAT_S; ticks every second."""
    for step in steps:
        cluster.now += timedelta(seconds=1)
        for rank, value in run.step(step, cluster.now):
            cluster.send(value, run.key(rank))
        if step and step % 10 == 0 and (run.hung_at() is None or step < run.hung_at()):
            cluster.send(run.checkpoint(step, cluster.now), run.key(0))
        if heartbeats and step % int(HEARTBEAT_S) == 0:
            last = step if run.hung_at() is None else min(step, run.hung_at() - 1)
            for rank, value in run.heartbeats(last, cluster.now, HEARTBEAT_S):
                cluster.send(value, run.key(rank))
        if ticks:
            cluster.tick()


def snapshot_bytes(monitor: Any) -> int:
    from runwatch.worker.processor import RunState

    return len(zlib.compress(pickle.dumps(RunState(monitor, None), protocol=pickle.HIGHEST_PROTOCOL), 1))


def cost(steps: int) -> dict[str, Any]:
    from runwatch.local.simulate import SyntheticRun

    out: dict[str, Any] = {"steps": steps, "measured_from_step": steps // 2}
    for ranks in (64, 16_384):
        cluster = Cluster()
        run = SyntheticRun(f"cost-{ranks}", ranks, seed=1)
        for rank in run.leaders():
            cluster.send(run.run_start(cluster.now, rank), run.key(rank))
        # the first half fills the detectors' windows (a rank's detectors are built at its first step)
        play(cluster, run, range(steps // 2), heartbeats=False, ticks=False)
        cpu_before, events_before = sum(cluster.cpu), list(cluster.events)
        play(cluster, run, range(steps // 2, steps), heartbeats=False, ticks=False)
        cpu = sum(cluster.cpu) - cpu_before
        per_worker = [after - before for after, before in zip(cluster.events, events_before, strict=True)]
        busy = [n for n in per_worker if n]
        snapshots = {key: snapshot_bytes(m) for key, m in cluster.monitors().items()}
        out[str(ranks)] = {
            "ms_per_1000_rank_steps": round(cpu / (ranks * (steps - steps // 2)) * 1e6, 1),
            "events_per_worker": per_worker,
            "max_over_min_events": round(max(busy) / min(busy), 3) if busy else None,
            "joined_record_bytes": max(len(j.to_json()) for j in cluster.joined) if cluster.joined else None,
            "group_report_bytes_max": max(cluster.report_bytes, default=0),
            "snapshot_bytes_max": max(snapshots.values()),
            "snapshot_bytes_run_key": snapshots.get(f"cost-{ranks}"),
            "snapshots": len(snapshots),
            "dead_letters": len(cluster.letters),
        }
    out["cost_ratio_16384_over_64"] = round(
        out["16384"]["ms_per_1000_rank_steps"] / out["64"]["ms_per_1000_rank_steps"], 3
    )
    return out


def scenario(healthy: int = 200) -> dict[str, Any]:
    from runwatch.local.simulate import SyntheticRun, parse_fault

    ranks = 16_384
    slow_at, nan_at, hang_at = healthy, healthy + 30, healthy + 60
    cluster = Cluster()
    calm = SyntheticRun("big-run", ranks, seed=2)
    faulty = SyntheticRun(
        "big-run",
        ranks,
        faults=[parse_fault(f, ranks) for f in ("slow:12345:1.5", f"nan:7:{nan_at}", f"hang:9001:{hang_at}")],
        seed=3,
    )
    started = time.monotonic()
    for rank in calm.leaders():
        cluster.send(calm.run_start(cluster.now, rank), calm.key(rank))
    play(cluster, calm, range(healthy))
    healthy_findings = [(a.detector, a.rank, a.step) for a in cluster.anomalies]
    at_slow = cluster.now
    play(cluster, faulty, range(slow_at, hang_at + 90))  # (90 s after the hang, ticking)

    def first(detector: str) -> dict[str, Any] | None:
        found = [a for a in cluster.anomalies if a.detector == detector]
        if not found:
            return None
        a = found[0]
        return {"rank": a.rank, "step": a.step, "ts": a.ts.isoformat(), "message": a.message[:200]}

    hung = first("hung_rank")
    actions = Counter(a.kind for a in cluster.actions)
    return {
        "ranks": ranks,
        "group_size": 64,
        "workers": WORKERS,
        "healthy_steps": healthy,
        "findings_over_healthy_steps": healthy_findings,
        "straggler": first("straggler"),
        "non_finite": first("non_finite"),
        "hung_rank": hung,
        "hang_detected_after_s": (
            round(
                (
                    datetime.fromisoformat(hung["ts"]) - (at_slow + timedelta(seconds=hang_at - slow_at))
                ).total_seconds()
            )
            if hung
            else None
        ),
        "rollbacks": actions["rollback"],
        "actions": dict(actions),
        "findings_by_detector": dict(Counter(a.detector for a in cluster.anomalies)),
        "events_per_worker": cluster.events,
        "max_over_min_events": round(max(cluster.events) / min(cluster.events), 3),
        "cpu_s_per_worker": [round(c, 1) for c in cluster.cpu],
        "dead_letters": cluster.letters[:5],
        "wall_s": round(time.monotonic() - started),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("cost", "scenario"), default="cost")
    ap.add_argument(
        "--steps", type=int, default=200, help="cost: steps of each run (half warm the detectors)"
    )
    ap.add_argument("--healthy-steps", type=int, default=200)
    args = ap.parse_args()
    result = cost(args.steps) if args.phase == "cost" else scenario(args.healthy_steps)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
