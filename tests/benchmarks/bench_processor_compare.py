"""The detector process's work per step event, against an earlier commit's, as a ratio measured in one run.

The work is what the worker's detector process does for a batch of step events, without the pipe: a
``TelemetryProcessor`` (state off) fed the events through ``detector_process.handle`` in batches, as
docs/profiles/worker.md's "How it was measured" describes. The events are bench_throughput.py's (its
``step_event``: 20 module norms, 8 categories, memory and timing fields), built once here and given to
both sides as the same bytes: 8,000 events over 40 runs, the first 2,000 a warm-up outside the figure.
Each side runs in its own process with its tree's rooms first on ``PYTHONPATH`` (REV: a temporary git
worktree, commit_tree.py), in turn, the order alternating by round. Prints JSON: each side's µs per step
event per round (of the process's CPU time, which other jobs on a shared machine disturb less than the
wall clock; the wall clock's too), their medians, and the ratio of the medians (the figure to compare).

    .venv/bin/python tests/benchmarks/bench_processor_compare.py [REV, default 3613505] [--rounds 5]
    # one side alone (the checkout), e.g. to profile: --child EVENTS --profile out.pstats
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import ROOT, commit_tree, rooms_path

BASE = "3613505"
PARTITIONS = 8


def build_events(path: Path, n: int, runs: int) -> None:
    """``n`` step events of ``runs`` runs, as (value, key, partition, offset) written to ``path``."""
    from bench_throughput import step_event

    rng = random.Random(0)
    t0 = datetime.now(UTC) - timedelta(hours=1)  # (ts must lie near the record time: the child's now)
    offsets = [0] * PARTITIONS
    events = []
    for i in range(n):
        run = f"bench-{i % runs}"
        partition = (i % runs) % PARTITIONS
        events.append((step_event(rng, i, runs, t0).to_json(), run.encode(), partition, offsets[partition]))
        offsets[partition] += 1
    path.write_bytes(pickle.dumps(events))


def child(events_path: Path, batch: int, warmup: int, profile: Path | None) -> dict:
    """One side's measurement, in the tree whose rooms lead ``PYTHONPATH``."""
    import secrets

    from runwatch.detectors import RunwatchConfig
    from runwatch.worker.detector_process import handle
    from runwatch.worker.processor import TelemetryProcessor
    from runwatch.worker.state.run_states import StateOptions

    stored = pickle.loads(events_path.read_bytes())
    now = time.time()  # the records' broker time
    events = [(value, key, partition, offset, now) for value, key, partition, offset in stored]
    off = StateOptions(enabled=False)
    processor = TelemetryProcessor(RunwatchConfig(), secrets.token_bytes(32), state=off)
    for start in range(0, warmup, batch):
        handle(processor, "events", events[start : min(start + batch, warmup)])
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t, cpu = time.perf_counter(), time.process_time()
    for start in range(warmup, len(events), batch):
        handle(processor, "events", events[start : start + batch])
    seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    import runwatch.detectors

    return {
        "us_per_step_event": round(cpu_seconds / (len(events) - warmup) * 1e6, 2),
        "wall_us_per_step_event": round(seconds / (len(events) - warmup) * 1e6, 2),
        "processed": processor.counters.processed,
        "deadlettered": processor.counters.deadlettered,
        "runwatch": str(Path(runwatch.detectors.__file__).resolve().parents[3]),
    }


def run_side(events_path: Path, pythonpath: str, batch: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    argv = [sys.executable, __file__, "--child", str(events_path)]
    argv += ["--batch", str(batch), "--warmup", str(warmup)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=900).stdout
    result: dict = json.loads(out)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", nargs="?", default=BASE, help="the earlier commit to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--events", type=int, default=8000)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=Path, help="with --child: write the timed part's cProfile stats here")
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.batch, args.warmup, args.profile)))
        return
    names = (args.rev, "checkout")
    per_round: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp, commit_tree(args.rev) as old:
        events_path = Path(tmp) / "events.pickle"
        build_events(events_path, args.events, args.runs)
        paths = {args.rev: rooms_path(old), "checkout": rooms_path(ROOT)}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                side = run_side(events_path, paths[name], args.batch, args.warmup)
                if side["processed"] != args.events or side["deadlettered"]:
                    raise RuntimeError(f"{name}: {side}")
                per_round[name].append(side["us_per_step_event"])
                wall[name].append(side["wall_us_per_step_event"])
            print(f"round {r + 1}/{args.rounds}: {json.dumps(per_round)}", file=sys.stderr, flush=True)
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    print(
        json.dumps(
            {
                "benchmark": "detector_process_us_per_step_event_against_a_commit",
                "events": args.events,
                "runs": args.runs,
                "warmup": args.warmup,
                "batch": args.batch,
                "rounds": args.rounds,
                "cpu_us_per_step_event_per_round": per_round,
                "wall_us_per_step_event_per_round": wall,
                "median_cpu_us_per_step_event": medians,
                "ratio_checkout_over_rev": round(medians["checkout"] / medians[args.rev], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
