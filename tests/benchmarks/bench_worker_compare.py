"""The worker's throughput and detection latency against an earlier commit's, measured in one run, in turn.

Runs ``bench_throughput.py`` and ``bench_latency.py`` of the checkout and of REV (checked out into a temporary
git worktree, its rooms put first on ``PYTHONPATH``, as bench_detectors_compare.py does) in turn, ROUNDS times
each, and prints JSON: every run's figures, each side's medians, and the ratios checkout / REV. Each
throughput run also measures its own no-op Faust agent, so each side has its ratio to the same baseline.
On a shared machine the ratios are the figures to compare. Not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_worker_compare.py 2ffb10c [--rounds 2] [--events N] [--runs 30]
    .venv/bin/python tests/benchmarks/bench_worker_compare.py 3613505 --latency-only --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import ROOT, commit_tree, rooms_path


def run(tree: Path, bench: str, args: list[str], pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.setdefault("RUNWATCH_STATE_SECRET", secrets.token_hex(32))  # (the worker's state is on)
    out = subprocess.run(
        [sys.executable, str(tree / "tests" / "benchmarks" / bench), *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    ).stdout
    result: dict = json.loads(out)
    return result


def side(throughput: list[dict], latency: list[dict]) -> dict:
    figures: dict = {
        "latency_p50_ms": [r["p50_ms"] for r in latency],
        "latency_p99_ms": [r["p99_ms"] for r in latency],
        "median_latency_p50_ms": statistics.median(r["p50_ms"] for r in latency),
        "median_latency_p99_ms": statistics.median(r["p99_ms"] for r in latency),
    }
    if not throughput:  # (--latency-only)
        return figures
    return {
        "worker_events_per_s": [r["median_runwatch_worker_events_per_s"] for r in throughput],
        "noop_agent_events_per_s": [r["median_noop_agent_events_per_s"] for r in throughput],
        "ratio_worker_over_noop": [r["median_ratio_worker_over_noop"] for r in throughput],
        **figures,
        "median_worker_events_per_s": statistics.median(
            r["median_runwatch_worker_events_per_s"] for r in throughput
        ),
        "median_ratio_worker_over_noop": statistics.median(
            r["median_ratio_worker_over_noop"] for r in throughput
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--events", type=int, default=40_000)
    ap.add_argument("--runs", type=int, default=30, help="bench_latency.py --runs")
    ap.add_argument("--latency-only", action="store_true", help="bench_latency.py alone, no throughput runs")
    args = ap.parse_args()
    throughput_args = ["--events", str(args.events), "--rounds", "1"]
    latency_args = ["--runs", str(args.runs)]
    runs: dict[str, dict[str, list[dict]]] = {
        name: {"throughput": [], "latency": []} for name in (args.rev, "checkout")
    }
    with commit_tree(args.rev) as old:
        trees = {args.rev: (old, rooms_path(old)), "checkout": (ROOT, rooms_path(ROOT))}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order if not args.latency_only else ():
                tree, path = trees[name]
                runs[name]["throughput"].append(run(tree, "bench_throughput.py", throughput_args, path))
            for name in order:
                tree, path = trees[name]
                runs[name]["latency"].append(run(tree, "bench_latency.py", latency_args, path))
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    sides = {name: side(r["throughput"], r["latency"]) for name, r in runs.items()}
    new, base = sides["checkout"], sides[args.rev]
    print(
        json.dumps(
            {
                "benchmark": "worker_throughput_and_latency_against_a_commit",
                "events": args.events,
                "latency_runs": args.runs,
                "rounds": args.rounds,
                **sides,
                **(
                    {}
                    if args.latency_only
                    else {
                        "ratio_worker_events_per_s": round(
                            new["median_worker_events_per_s"] / base["median_worker_events_per_s"], 3
                        )
                    }
                ),
                "ratio_latency_p50": round(new["median_latency_p50_ms"] / base["median_latency_p50_ms"], 3),
                "ratio_latency_p99": round(new["median_latency_p99_ms"] / base["median_latency_p99_ms"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
