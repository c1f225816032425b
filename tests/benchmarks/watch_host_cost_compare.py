"""runwatch's host time per step in the trainer against an earlier commit's, measured in one run.

Runs ``watch_host_cost.py`` (this checkout's script: the 150-tensor model, runwatch's calls and its
threads' CPU per step, the broker reachable) with REV's runwatch (checked out into a temporary git
worktree, its rooms first on ``PYTHONPATH``) and with this checkout's, in turn, ROUNDS times each, on one
embedded broker; prints JSON: each side's single runs, their medians, and the ratio of the medians. A
shared machine wanders by 10-20% from minute to minute, and a loaded one slows the loop, which spreads the
publisher's per-request cost over fewer steps; runs taken in turn see the same weather, so the ratio is
the figure to compare. It also records ``record_seeded_run.py``'s seeded runs with both and says whether
they published the same events (``events_identical``). Not part of the test suite.

    .venv/bin/python tests/benchmarks/watch_host_cost_compare.py 2ffb10c [--rounds 7] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import ROOT, commit_tree, rooms_path

HERE = Path(__file__).resolve().parent
FIGURES = ("host_us", "calls_us", "clip_us", "background_cpu_us")


def run_measure(pythonpath: str, bootstrap: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    script = HERE / "watch_host_cost.py"
    command = [sys.executable, str(script), "--bootstrap", bootstrap, "--steps", str(steps)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=900).stdout
    result: dict = json.loads(out.strip().splitlines()[-1])
    return result


def summary(runs: list[dict]) -> dict:
    out: dict = {f"{name}_runs": [r[name] for r in runs] for name in FIGURES}
    out.update({name: round(statistics.median(r[name] for r in runs), 1) for name in FIGURES})
    out["per_call_us"] = {
        call: round(statistics.median(r["per_call_us"][call] for r in runs), 1)
        for call in runs[0]["per_call_us"]
    }
    roles = sorted({role for r in runs for role in r.get("background_by_thread_us", {})})
    out["background_by_thread_us"] = {
        role: round(statistics.median(r.get("background_by_thread_us", {}).get(role, 0.0) for r in runs), 1)
        for role in roles
    }
    out["dropped"] = sum(r["dropped"] for r in runs)
    return out


def same_events(old_path: str, new_path: str, tmp: Path) -> tuple[bool, list[str]]:
    sys.path.insert(0, str(HERE))
    from record_seeded_run import RUNS, comparable, differences

    for name, path in (("before", old_path), ("now", new_path)):
        env = {**os.environ, "PYTHONPATH": path}
        script = HERE / "record_seeded_run.py"
        subprocess.run(
            [sys.executable, str(script), str(tmp / name)],
            env=env,
            capture_output=True,
            check=True,
            timeout=600,
        )
    found = []
    for run in RUNS:
        found += [
            f"{run}: {d}"
            for d in differences(
                comparable(tmp / "before" / f"{run}.jsonl"), comparable(tmp / "now" / f"{run}.jsonl")
            )
        ]
    return not found, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    from runwatch.local.broker import EmbeddedBroker, ensure_topics

    with commit_tree(args.rev) as old, tempfile.TemporaryDirectory(prefix="runwatch-events-") as tmp:
        old_path, new_path = rooms_path(old), rooms_path(ROOT)
        identical, differences = same_events(old_path, new_path, Path(tmp))
        runs: dict[str, list[dict]] = {args.rev: [], "checkout": []}
        with EmbeddedBroker() as broker:
            ensure_topics(broker.bootstrap)
            for i in range(args.rounds):
                runs[args.rev].append(run_measure(old_path, broker.bootstrap, args.steps))
                runs["checkout"].append(run_measure(new_path, broker.bootstrap, args.steps))
                print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    sides = {name: summary(r) for name, r in runs.items()}
    ratios = [
        new["host_us"] / old["host_us"] for old, new in zip(runs[args.rev], runs["checkout"], strict=True)
    ]
    print(
        json.dumps(
            {
                "benchmark": "watch_host_cost_against_a_commit",
                "steps": args.steps,
                "rounds": args.rounds,
                "events_identical": identical,
                "event_differences": differences[:10],
                **sides,
                "ratio_host_us": round(sides["checkout"]["host_us"] / sides[args.rev]["host_us"], 3),
                "ratio_host_us_per_round": [round(r, 3) for r in ratios],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
