"""The detectors' cost against an earlier commit's, as a ratio measured in one run on one machine.

Runs ``bench_detectors.py`` of the checkout and of REV (checked out into a temporary git worktree, its
rooms put first on ``PYTHONPATH`` ahead of the editable install) in turn, ROUNDS times each, and prints
JSON: each side's single runs, the medians of the all-detectors mean and p50, and the ratio of the medians.
A shared machine wanders by 10-20% from minute to minute; runs taken in turn see the same weather, so
the ratio is the figure to compare, not either side's microseconds. Not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_detectors_compare.py be19ff9 [--rounds 5] [--events 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import ROOT, commit_tree, rooms_path

BENCH = Path("tests/benchmarks/bench_detectors.py")


def run_bench(tree: Path, events: int, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, str(tree / BENCH), "--events", str(events)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    ).stdout
    result: dict = json.loads(out)["all_detectors"]
    return result


def summary(runs: list[dict]) -> dict:
    return {
        "mean_us_runs": [r["mean_us"] for r in runs],
        "mean_us": statistics.median(r["mean_us"] for r in runs),
        "p50_us": statistics.median(r["p50_us"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--events", type=int, default=5000)
    args = ap.parse_args()
    with commit_tree(args.rev) as old:
        old_path = rooms_path(old)
        runs: dict[str, list[dict]] = {args.rev: [], "checkout": []}
        for i in range(args.rounds):
            runs[args.rev].append(run_bench(old, args.events, old_path))
            runs["checkout"].append(run_bench(ROOT, args.events, None))
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    sides = {name: summary(r) for name, r in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "detectors_per_step_event_against_a_commit",
                "events": args.events,
                "rounds": args.rounds,
                **sides,
                "ratio_mean": round(sides["checkout"]["mean_us"] / sides[args.rev]["mean_us"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
