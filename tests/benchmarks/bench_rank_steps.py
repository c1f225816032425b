"""The worker's processor cost per 1,000 rank-steps as a run grows (issue 36), against an earlier commit.

One synchronous run of N ranks (every rank's step event of each step, as ``runwatch simulate`` sends
them; built here so that an older tree can run it too) goes through ``TelemetryProcessor`` in process:
decoding, the per-rank detectors, the cross-rank join and the run's detectors. CPU time (``process_time``)
per 1,000 rank-steps after two warm-up steps (every rank's detectors are built at its first), at each
world size. With ``--against REV`` the same runs in turn with REV's tree (a temporary git worktree first
on ``PYTHONPATH``), and the ratios are printed: a shared machine wanders, runs taken in turn do not.
Faust, the broker and the detector process's pipe are not in it (bench_throughput.py measures those).

    .venv/bin/python tests/benchmarks/bench_rank_steps.py [--against REV] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import commit_tree, rooms_path

WORLDS = ((64, 202), (1_024, 14), (4_096, 6), (16_384, 4))  # (ranks, steps): at least 40,000 rank-steps


def step_events(run_id: str, world: int, step: int, ts: datetime, rng: random.Random) -> list[bytes]:
    import orjson

    stamp = ts.isoformat().replace("+00:00", "Z")
    return [
        orjson.dumps(
            {
                "schema_version": 1,
                "event_id": f"{run_id}-{rank}-{step}",
                "run_id": run_id,
                "rank": rank,
                "ts": stamp,
                "kind": "step",
                "step": step,
                "loss": 2.0 * math.exp(rng.gauss(0, 0.01)),
                "grad_norm": 1.0 + 0.02 * rng.gauss(0, 1),
                "step_time_s": math.exp(rng.gauss(0, 0.01)),
                "compute_s": 0.8 * math.exp(rng.gauss(0, 0.01)),
                "samples_per_s": 32.0,
                "memory": {"allocated": 10 * 2**30, "reserved": 12 * 2**30},
            }
        )
        for rank in range(world)
    ]


def measure() -> dict[int, float]:
    from runwatch.detectors import RunwatchConfig
    from runwatch.worker.processor import TelemetryProcessor

    out = {}
    for world, steps in WORLDS:
        rng = random.Random(0)
        run_id = f"bench-{world}"
        proc = TelemetryProcessor(RunwatchConfig(), bytes(32))
        t0 = datetime.now(UTC) - timedelta(minutes=2)
        start = {
            "schema_version": 1,
            "event_id": f"{run_id}-start",
            "run_id": run_id,
            "rank": 0,
            "ts": t0.isoformat().replace("+00:00", "Z"),
            "kind": "run_start",
            "world_size": world,
        }
        key = run_id.encode()
        proc.process(json.dumps(start).encode(), key, None, None, t0.timestamp())
        rounds = [step_events(run_id, world, s, t0 + timedelta(seconds=s), rng) for s in range(steps)]
        cpu = 0.0
        for s, raws in enumerate(rounds):
            stamp = (t0 + timedelta(seconds=s)).timestamp()
            began = time.process_time()
            for raw in raws:
                proc.process(raw, key, None, None, stamp)
            if s >= 2:
                cpu += time.process_time() - began
        out[world] = round(cpu / (world * (steps - 2)) * 1e6, 1)  # ms per 1,000 rank-steps
    return out


def run_tree(pythonpath: str | None) -> dict[int, float]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--measure"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return {int(k): v for k, v in json.loads(done.stdout).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", metavar="REV", help="an earlier commit to compare with, in turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    sides: dict[str, list[dict[int, float]]] = {"now": []}
    with contextlib.ExitStack() as stack:
        old_tree = stack.enter_context(commit_tree(args.against)) if args.against else None
        if old_tree is not None:
            sides["against"] = []
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                path = rooms_path(old_tree, old_tree) if side == "against" and old_tree is not None else None
                sides[side].append(run_tree(path))
                print(json.dumps({"round": r, side: sides[side][-1]}), file=sys.stderr, flush=True)
    result: dict = {"unit": "processor CPU ms per 1,000 rank-steps (median of rounds)"}
    for side, runs in sides.items():
        medians = {w: statistics.median(run[w] for run in runs) for w, _ in WORLDS}
        result[side] = medians
        result[f"{side}_ratio_largest_over_64"] = round(medians[WORLDS[-1][0]] / medians[64], 2)
    if "against" in sides:
        result["against_rev"] = args.against
    print(json.dumps(result))


if __name__ == "__main__":
    main()
